"""Metrics of next-token predictions, ablations and activation patching (pure functions).

Inputs are logits ``[..., vocab]`` (the model's pre-softmax next-token scores; position ``p``
predicts token ``p + 1``); everything is computed in float32 at least (float64 stays float64).
Units: log-probabilities, losses, entropies and KL divergences in **nats** (natural log).

Sources: S004 ("verify with an intervention — ablate the head or patch its activation and see
whether the behaviour changes", docs/sources.md); TransformerLens ``patching.py`` (the grids
``[layer, head]`` / ``[layer, pos]`` of a metric of the patched logits; the normalised metric
``(patched - corrupted) / (clean - corrupted)``: 0 = the patch changed nothing, 1 = it restored
the clean run's value); Wang et al. 2022 (IOI: the logit difference between a target and a
distractor token); Nanda 2023 "Attribution Patching" and Kramár et al. 2024 "AtP*" (the
linear estimate ``grad_z(metric)|corrupted . (z_clean - z_corrupted)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def _f(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities ``[..., vocab]`` (nats) of the next-token distribution."""
    return torch.log_softmax(_f(logits), dim=-1)


def entropy(logp: torch.Tensor) -> torch.Tensor:
    """Entropy ``-sum_v p_v log p_v`` ``[...]`` in nats, from log-probabilities ``[..., vocab]``
    (0 * log 0 counts as 0)."""
    p = logp.exp()
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)


def kl_divergence(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) = ``sum_v p_v (log p_v - log q_v)`` ``[...]`` in nats, from log-probabilities
    ``[..., vocab]`` (broadcasting; terms with p_v = 0 count as 0). Here p is the clean run and
    q the ablated one: the information lost by the ablation."""
    p = logp.exp()
    return (p * (logp - logq).masked_fill(p == 0, 0.0)).sum(-1)


def token_loss(logp: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """Per-token loss ``-log p(next token)`` ``[..., P]`` in nats: ``logp`` ``[..., P, vocab]``
    at P positions, ``next_ids`` ``[P]`` the tokens that actually follow them."""
    idx = next_ids.to(logp.device).long().expand(*logp.shape[:-1])
    return -logp.gather(-1, idx[..., None])[..., 0]


def rank_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rank ``[..., P]`` of token ``ids[p]`` among the logits ``[..., P, vocab]``: 1 = the
    model's top choice; 1 + the number of tokens with a strictly larger logit (ties share the
    better rank)."""
    idx = ids.to(logits.device).long().expand(*logits.shape[:-1])
    chosen = logits.gather(-1, idx[..., None])
    return (logits > chosen).sum(-1) + 1


def logit_diff(logits: torch.Tensor, target: int, distractor: int) -> torch.Tensor:
    """``logit[target] - logit[distractor]`` ``[...]`` from logits ``[..., vocab]`` (Wang et al.
    2022). Logits, not log-probs: the normaliser cancels, so the two are equal."""
    return _f(logits[..., target]) - _f(logits[..., distractor])


def normalized(patched: torch.Tensor, clean: float | torch.Tensor,
               corrupted: float | torch.Tensor) -> torch.Tensor:
    """TransformerLens' normalised patching metric ``(patched - corrupted) / (clean -
    corrupted)``: 0 where the patch changed nothing, 1 where it restored the clean value. A
    clean and corrupted run with equal metrics have no scale: NaN (IEEE inf/NaN), which the
    caller reports instead of a number."""
    patched = _f(patched)
    return (patched - corrupted) / (clean - corrupted)


@dataclass
class NextTokenStats:
    """Per position of one text of T tokens (tensors on CPU, float32/float64):

    ``top_ids``/``top_logits``/``top_probs`` ``[T, k]`` (descending probability);
    ``entropy`` ``[T]`` (nats); for positions ``0 .. T-2`` (the last has no next token):
    ``next_logprob`` ``[T-1]`` = log p(actual next token), ``next_rank`` ``[T-1]`` (1 = top),
    ``loss`` ``[T-1]`` = ``-next_logprob`` (nats); ``mean_loss`` = their mean (NaN for T = 1).
    """

    top_ids: torch.Tensor
    top_logits: torch.Tensor
    top_probs: torch.Tensor
    entropy: torch.Tensor
    next_logprob: torch.Tensor
    next_rank: torch.Tensor
    loss: torch.Tensor
    mean_loss: float


def next_token_stats(logits: torch.Tensor, input_ids: Sequence[int], top_k: int) -> NextTokenStats:
    """Prediction statistics of one text: ``logits`` ``[T, vocab]`` (position p predicts token
    p + 1), ``input_ids`` its T token ids, ``top_k`` ≤ vocab. The per-token loss is Hugging
    Face's ``GPT2LMHeadModel`` loss before its mean (cross-entropy of the shifted labels)."""
    logits = _f(logits).cpu()
    logp = log_softmax(logits)
    top_logits, top_ids = logits.topk(min(top_k, logits.shape[-1]), dim=-1)
    top_probs = logp.gather(-1, top_ids).exp()
    nxt = torch.tensor(list(input_ids[1:]), dtype=torch.long)
    T = logits.shape[0]
    if T > 1:
        nlp = -token_loss(logp[:-1], nxt)
        rank = rank_of(logits[:-1], nxt)
    else:
        nlp = torch.empty(0, dtype=logp.dtype)
        rank = torch.empty(0, dtype=torch.long)
    loss = -nlp
    return NextTokenStats(top_ids, top_logits, top_probs, entropy(logp), nlp, rank, loss,
                          float(loss.mean()) if len(loss) else float("nan"))


def topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, logits, probs)`` each ``[..., k]`` of the k most probable next tokens."""
    logits = _f(logits)
    vals, ids = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return ids, vals, log_softmax(logits).gather(-1, ids).exp()


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two flattened tensors (NaN when either is constant)."""
    x, y = x.double().flatten(), y.double().flatten()
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / (x.norm() * y.norm()))


def attribution(grad_z: torch.Tensor, z_clean: torch.Tensor, z_corrupted: torch.Tensor,
                per_position: bool = False) -> torch.Tensor:
    """Attribution patching (Nanda 2023; Kramár et al. 2024 AtP): the first-order estimate of
    the change of the metric when a head's z is patched from the clean run into the corrupted
    one, ``sum_{pos, d} grad[l, pos, h, d] * (z_clean - z_corrupted)[l, pos, h, d]``.

    ``grad_z``: d(metric)/dz on the corrupted run ``[layer, pos, head, d_head]``; ``z_clean``,
    ``z_corrupted`` the same shape. Returns ``[layer, head]`` (all positions patched at once,
    TransformerLens ``get_act_patch_attn_head_out_all_pos``) or ``[layer, head, pos]``
    (``per_position``), in the metric's units (not normalised). Exact for a metric linear in z;
    otherwise a linear approximation.
    """
    prod = _f(grad_z) * (_f(z_clean) - _f(z_corrupted))  # [layer, pos, head, d_head]
    per = prod.sum(-1).transpose(1, 2)  # [layer, head, pos]
    return per if per_position else per.sum(-1)


# ------------------------------------------------------------------ declared metrics
#: the run roles of a declared metric's KL terms: 0 = the run measured, 1 = the reference run
#: (the clean run of /v1/patch, the unablated run of /v1/ablate)
RUN, REFERENCE = 0, 1


@dataclass(frozen=True)
class DeclaredMetric:
    """A metric declared by a request, resolved against one prompt of T tokens.

    ``kind``: 'logit_diff' | 'prob' | 'logprob' | 'loss' | 'kl'; ``terms``: per term
    ``(position, target, distractor)`` / ``(position, target)`` / ``(position, next_id)`` /
    ``(run_a, run_b, position)`` (KL(P_a ‖ P_b), runs :data:`RUN` / :data:`REFERENCE`), every
    position in ``0..T-1``; ``reduce``: 'mean' (TransformerLens / IOI convention) or 'sum' of
    the terms' values. ``positions``: the sorted distinct positions the terms read (the logits
    a forward needs). Units: logits (logit_diff), probability in [0, 1], nats (logprob,
    loss, kl)."""

    kind: str
    terms: tuple
    reduce: str = "mean"

    @property
    def positions(self) -> list[int]:
        return sorted({t[2] if self.kind == "kl" else t[0] for t in self.terms})

    def values(self, logits: torch.Tensor, reference_logp: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The metric ``[batch]`` of logits ``[batch, len(positions), vocab]`` (read at
        :attr:`positions`, in that order); ``reference_logp`` ``[len(positions), vocab]``: the
        reference run's log-probabilities there (KL terms only). float32 at least."""
        col = {p: i for i, p in enumerate(self.positions)}
        lg = _f(logits)
        if self.kind == "kl":
            lp = log_softmax(lg)
            ref = reference_logp.to(lp.device)[None].expand_as(lp)
            runs = (lp, ref)
            vals = [kl_divergence(runs[a][:, col[p]], runs[b][:, col[p]]).clamp(min=0)
                    for a, b, p in self.terms]
        elif self.kind == "logit_diff":
            vals = [lg[:, col[p], t] - lg[:, col[p], d] for p, t, d in self.terms]
        else:
            lp = log_softmax(lg)
            vals = [lp[:, col[t[0]], t[1]] for t in self.terms]
            if self.kind == "prob":
                vals = [v.exp() for v in vals]
            elif self.kind == "loss":
                vals = [-v for v in vals]
        v = torch.stack(vals, dim=-1)
        return v.mean(-1) if self.reduce == "mean" else v.sum(-1)


def patch_attribution(grad: torch.Tensor, act_clean: torch.Tensor, act_corrupted: torch.Tensor,
                      keep: Sequence[int]) -> torch.Tensor:
    """Attribution patching at any hook (Nanda 2023; Kramár et al. 2024, AtP): the first-order
    estimate of the metric's change when the clean activation replaces the corrupted one in
    a cell, ``sum grad * (act_clean - act_corrupted)`` over every axis NOT in ``keep``.

    ``grad``: d(metric)/d(activation) on the corrupted run, the hook's shape without batch
    (``[pos, d_model]``, ``[pos, head, d_head]``, ``[head, query_pos, key_pos]``); the two
    activations the same shape; ``keep``: the axes that index the grid's cells, in the
    order the result has them (e.g. ``(1,)`` -> ``[head]``, ``(0, 1)`` -> ``[pos, head]``).
    In the metric's units, not normalised; exact for a metric linear in the activation."""
    prod = _f(grad) * (_f(act_clean) - _f(act_corrupted))
    drop = [a for a in range(prod.ndim) if a not in keep]
    out = prod.sum(dim=drop) if drop else prod
    order = sorted(keep)
    return out.permute([order.index(a) for a in keep]) if list(keep) != order else out
