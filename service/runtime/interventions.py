"""Intervention forwards of the resident causal LM: head ablation and activation patching.

The runtime owns torch and the model; every forward here is ONE hooked forward
(service/runtime/hooked.py ``run``: the model's own parameter tensors, Hugging Face's eager
operations in Hugging Face's order, TransformerLens 4.3 hook points), the path ``/v1/run``
serves and ``/v1/verify`` checks through the LM head's logits. The edits are its declarative
interventions: ``Zero`` / ``Mean`` / ``Set`` on ``blocks.{l}.attn.hook_z`` with a head
selection (one forward) or a per-row ``mask`` (a batch of variants, row i editing its own
head, or head and position), ``Set`` on ``blocks.{l}.hook_resid_pre`` for the residual grid;
metrics read its logits; attribution is its ``GradRequest``. No module hook is registered,
nothing outlives a call.

Vocabulary (TransformerLens): a head's output **z** is its attention-weighted value vectors
before the output projection, ``z[pos, head, :] = sum_k pattern[head, pos, k] * v[head, k, :]``
(``hook_z``, ``[batch, pos, head, d_head]``). The **residual stream** entering layer ``l``
(``hook_resid_pre``) is the recorded ``hidden_states[l]`` for ``l < n_layers`` (index 0 is the
embedding output).

A batch of variants starts at the layer its edit is in (``hooked.run(start=l,
resid_pre=...)``) from the recorded residual stream entering it: the layers below are the
text's own and are not run again.

Causal LMs only (GPT-2 family): an encoder has no LM head to read a metric from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from ..errors import InvalidRequest
from . import hooked


class NoLanguageModelHead(InvalidRequest):
    """The loaded model has no language-model head (an encoder): predictions, ablation and
    patching read next-token logits and cannot run (422, type ``unsupported_model``)."""

    type = "unsupported_model"


@dataclass
class RunOutput:
    """What one intervention run returns (tensors on the runtime's device).

    ``logits``: ``[batch, len(positions), vocab]`` (all positions when ``positions`` is None).
    ``start``: the first layer that ran. ``patterns``: per layer from ``start``,
    ``[batch, head, query_pos, key_pos]`` when ``capture_patterns``.
    """

    logits: torch.Tensor
    start: int
    patterns: list[torch.Tensor] = field(default_factory=list)


def lm_parts(rt):
    """The hooked forward's :class:`hooked.GPT2Parts` of a causal LM (made once, kept in
    ``rt.memo["hooked_parts"]``, shared with ``/v1/run``), or raise
    :class:`NoLanguageModelHead`."""
    if not rt.adapter.causal:
        raise NoLanguageModelHead(
            f"{rt.info.get('id')} is an encoder ({rt.adapter.family}) without a language-model "
            "head: predictions, ablation and patching need next-token logits (causal LMs such "
            "as GPT-2)", "text",
        )
    head = rt.model.get_output_embeddings() if hasattr(rt.model, "get_output_embeddings") else None
    base = rt.adapter.base()
    if head is None or not any(hasattr(base, n) for n in ("ln_f", "norm", "final_layer_norm")):
        raise NoLanguageModelHead(
            f"{rt.info.get('id')} was loaded without a language-model head (no next-token "
            "logits): predictions, ablation and patching are unavailable", "text",
        )
    p = rt.memo.get("hooked_parts")
    if p is None:
        p = rt.memo["hooked_parts"] = hooked.gpt2_parts(rt.model)
    return p


def _ids(ids, batch: int, device) -> torch.Tensor:
    """``[batch, pos]`` token ids (the same row repeated: variants of one text)."""
    t = torch.as_tensor(list(ids), dtype=torch.long, device=device)
    return t[None].expand(batch, -1)


def _z(layer: int) -> str:
    return f"blocks.{layer}.attn.hook_z"


def run_variants(rt, ids: Sequence[int], resid: torch.Tensor, start: int,
                 interventions: Sequence = (), positions: Sequence[int] | None = None,
                 cache: dict | None = None) -> hooked.RunResult:
    """One hooked forward of a batch of variants of the text ``ids`` from layer ``start``:
    ``resid`` ``[batch | 1, pos, d_model]`` enters block ``start`` (a recorded
    ``hidden_states[start]``), ``interventions`` apply (hooked.py), logits at ``positions``.
    Runs under ``torch.inference_mode`` (the hooked forward's own)."""
    p = lm_parts(rt)
    resid = resid.to(device=p.device)
    B = resid.shape[0]
    return hooked.run(p, _ids(ids, B, p.device), cache=cache, interventions=interventions,
                 logit_positions=positions, start=start, resid_pre=resid)


def recorded_logits(rt, ft, positions: Sequence[int] | None = None,
                    ids: Sequence[int] | None = None) -> torch.Tensor:
    """Next-token logits ``[P, vocab]`` of a recorded forward ``ft`` (ForwardTensors) at
    ``positions`` (all if None): its last block re-run by the hooked forward from the cached
    residual stream entering it, then ``ln_f`` and the LM head. Equal to Hugging Face's
    ``GPT2LMHeadModel`` logits (bit for bit on the runtime's use_cache=False call).
    ``ids``: the text's token ids (only a Loss metric reads them; zeros otherwise)."""
    L = rt.adapter.n_layers
    T = ft.hidden_states.shape[1]
    ids = [0] * T if ids is None else ids
    return run_variants(rt, ids, ft.hidden_states[L - 1][None], L - 1,
                        positions=positions).logits[0]


def embedding_output(rt, input_ids: Sequence[int]) -> torch.Tensor:
    """The residual stream entering layer 0 ``[pos, d_model]`` (GPT-2: token plus position
    embeddings; rotary families: token embeddings; ``hidden_states[0]`` of a recorded forward): the hooked forward's first step
    (``hooked.embedding``; Gemma: times sqrt(d_model)) without running any block."""
    p = lm_parts(rt)
    ids = _ids(input_ids, 1, p.device)
    with torch.inference_mode():
        return hooked.embedding(p, ids)[0]


def head_z(pattern: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """z ``[layer, pos, head, d_head]`` from a recorded pattern ``[layer, head, query_pos,
    key_pos]`` and values ``[layer, head | kv_head, pos, d_head]``: ``pattern @ v`` (the
    attention's own product; TransformerLens ``hook_z`` layout). Grouped-query values are
    repeated as Hugging Face's ``repeat_kv`` does (kv head j serves query heads j*g .. j*g+g-1)."""
    if v.shape[1] != pattern.shape[1]:
        v = v.repeat_interleave(pattern.shape[1] // v.shape[1], dim=1)
    return torch.matmul(pattern, v).transpose(1, 2)


def attribution_grads(rt, input_ids: Sequence[int], metric, with_z: bool = False):
    """One hooked forward and one backward of a text from its token ids: returns ``(metric,
    grads)``, the scalar value of ``metric`` (a hooked metric, e.g. ``LogitDiff(terms=[(0,
    pos, target, distractor)])`` or ``Loss``) and its gradient with respect to every layer's
    ``hook_z``, each ``[pos, head, d_head]`` (the total derivative: paths through all later
    layers included; ``GradRequest``); with ``with_z`` also the z themselves ``[layer, pos,
    head, d_head]`` (so the corrupted run needs no recorded forward of its own).

    Used by attribution patching (Nanda 2023; Kramár et al. 2024, AtP): the gradient on the
    corrupted run times the clean-minus-corrupted z is the first-order estimate of each
    patch's effect.
    """
    p = lm_parts(rt)
    L = p.n_layers
    names = [_z(layer) for layer in range(L)]
    res = hooked.run(p, _ids(input_ids, 1, p.device),
                cache={"blocks.*.attn.hook_z": None} if with_z else None,
                logit_positions=[-1], grad=hooked.GradRequest(metric=metric, hooks=names))
    grads = [res.grads[n][0].detach() for n in names]
    if with_z:
        return res.grad_value, grads, torch.stack([res.cache[n][0] for n in names])
    return res.grad_value, grads


# ------------------------------------------------------------------ memory estimates
def variant_batch_bytes(rt, n_variants: int, n_tokens: int, n_positions: int,
                        grad: bool = False) -> int:
    """Estimated peak bytes of one intervention batch: ``n_variants`` rows of ``n_tokens``
    tokens through the blocks (one block's transients at a time: residual, ln, q/k/v, z and
    output ``~8*T*D``, the MLP ``~8*T*D``, scores + pattern ``2*H*T^2``, the z edit's mask and
    value), plus logits, log-probabilities and probabilities at ``n_positions`` positions
    (``3*P*vocab``), in the model's dtype (float32 for the metric math). ``grad``: every
    layer's activations kept for the backward (attribution patching)."""
    a = rt.adapter
    es = max(4, next(rt.model.parameters()).element_size())
    T, D, H = n_tokens, a.d_model, a.n_heads
    block = 16 * T * D + 3 * H * T * T
    vocab = int(rt.info.get("vocab_size") or rt.model.config.vocab_size)
    per_row = (block * (a.n_layers if grad else 1) + 3 * n_positions * vocab + 2 * T * D)
    return es * n_variants * per_row


# ------------------------------------------------------------------ grids and ablations
def _one_hot_heads(n_heads: int, n_tokens: int | None, device) -> torch.Tensor:
    """Masks of one variant per head ``[head, 1, head]`` (all positions), or per (head, pos)
    ``[head * pos, pos, head]`` (row ``h * T + p`` patches head h at position p only)."""
    eye = torch.eye(n_heads, dtype=torch.bool, device=device)
    if n_tokens is None:
        return eye[:, None, :]
    T = n_tokens
    m = torch.zeros(n_heads, T, T, n_heads, dtype=torch.bool, device=device)
    for h in range(n_heads):
        m[h, torch.arange(T), torch.arange(T), h] = True
    return m.reshape(n_heads * T, T, n_heads)


def head_patch_grid(rt, clean, corrupted, metric, positions: Sequence[int] | None,
                    per_position: bool = False, layers: Sequence[int] | None = None) -> torch.Tensor:
    """Activation patching of head outputs, clean -> corrupted (TransformerLens
    ``get_act_patch_attn_head_out_all_pos``, or ``..._by_pos`` with ``per_position``).

    ``clean``, ``corrupted``: recorded forwards (ForwardTensors) of two texts of equal length.
    For each layer l, one hooked forward of a batch of variants starts from the corrupted
    run's cached residual stream entering l (layers below are the corrupted run's own), with
    ``Set`` on ``blocks.{l}.attn.hook_z`` from the clean run's z under a per-row mask (row h:
    head h at all positions; per position, row ``h * T + p``: head h at position p);
    ``metric(logits [batch, P, vocab]) -> [batch]`` reads the logits at ``positions``.
    Returns the raw metric ``[layer, head]`` or ``[layer, head, pos]`` (float32, CPU; layers
    not in ``layers`` NaN). The corrupted text's ids are not needed (no Loss metric here)."""
    a = rt.adapter
    L, Hn, T = a.n_layers, a.n_heads, clean.hidden_states.shape[1]
    z_clean = head_z(clean.pattern, clean.v)  # [layer, pos, head, d_head]
    dev = lm_parts(rt).device
    mask = _one_hot_heads(Hn, T if per_position else None, dev)
    out = torch.full((L, Hn * T) if per_position else (L, Hn), float("nan"))
    ids = [0] * T
    for layer in (range(L) if layers is None else layers):
        edit = hooked.Set(hook=_z(layer), value=z_clean[layer], mask=mask)
        run = run_variants(rt, ids, corrupted.hidden_states[layer][None].expand(
            mask.shape[0], -1, -1), layer, [edit], positions)
        out[layer] = metric(run.logits).float().cpu()
    return out.reshape(L, Hn, T) if per_position else out


def resid_patch_grid(rt, clean, corrupted, metric, positions: Sequence[int] | None) -> torch.Tensor:
    """Activation patching of the residual stream entering each layer at each position
    (TransformerLens ``get_act_patch_resid_pre``): for layer l, one hooked forward of T
    variants of the corrupted run's cached ``hidden_states[l]`` from layer l, with ``Set`` on
    ``blocks.{l}.hook_resid_pre`` under the mask ``eye(T)`` (row p: position p from the
    clean run). Returns the raw metric ``[layer, pos]`` (float32, CPU)."""
    L, T = rt.adapter.n_layers, clean.hidden_states.shape[1]
    dev = lm_parts(rt).device
    out = torch.empty(L, T)
    mask = torch.eye(T, dtype=torch.bool, device=dev)  # [batch = patched position, pos]
    ids = [0] * T
    for layer in range(L):
        edit = hooked.Set(hook=f"blocks.{layer}.hook_resid_pre",
                          value=clean.hidden_states[layer], mask=mask)
        run = run_variants(rt, ids, corrupted.hidden_states[layer][None].expand(T, -1, -1),
                           layer, [edit], positions)
        out[layer] = metric(run.logits).float().cpu()
    return out


def mean_z(fts: Sequence) -> torch.Tensor:
    """Mean head output z ``[layer, head, d_head]`` over every position of the recorded
    forwards ``fts`` (one text, or a list of reference texts; all positions pooled)."""
    zs = [head_z(ft.pattern, ft.v) for ft in fts]  # each [layer, pos, head, d_head]
    return torch.cat(zs, dim=1).mean(dim=1)


@dataclass
class AblationValue:
    """What an ablation writes into z: ``method`` (zero / mean / resample) and, per layer,
    ``tensor``: the mean z ``[layer, head, d_head]`` (mean; for ``hooked.Mean(reference=)``),
    the other text's z ``[layer, pos, head, d_head]`` (resample; for ``hooked.Set``), or
    None (zero)."""

    method: str
    tensor: torch.Tensor | None

    def edit(self, layer: int, heads: Sequence[int] | None = None,
             mask: torch.Tensor | None = None):
        """The hooked intervention on ``blocks.{layer}.attn.hook_z`` (``heads`` selected, or
        ``mask``)."""
        kw = dict(hook=_z(layer), heads=None if heads is None else list(heads), mask=mask)
        if self.method == "zero":
            return hooked.Zero(**kw)
        if self.method == "mean":
            return hooked.Mean(reference=self.tensor[layer], **kw)
        value = self.tensor[layer]
        if heads is not None:
            value = value[:, list(heads)]
        return hooked.Set(value=value, **kw)


def ablation_value(method: str, ft, references: Sequence = (), resample=None) -> AblationValue:
    """The replacement of an ablation (:class:`AblationValue`): ``zero`` -> 0; ``mean`` -> the
    mean z over the text's own positions (or over the ``references``' positions); ``resample``
    -> the z of the other text ``resample`` (same length)."""
    if method == "zero":
        return AblationValue("zero", None)
    if method == "mean":
        return AblationValue("mean", mean_z(list(references) or [ft]))
    if method == "resample":
        return AblationValue("resample", head_z(resample.pattern, resample.v))
    raise InvalidRequest(f"unknown ablation method {method!r}", "method")


def ablate(rt, ft, heads: Sequence[tuple[int, int]], value: AblationValue,
           positions: Sequence[int] | None = None, capture_patterns: bool = False) -> RunOutput:
    """One text's hooked forward with the ``heads`` ``[(layer, head), ...]`` ablated (one
    intervention per layer on its ``hook_z``, those heads selected, every position), from the
    cached residual stream entering the lowest ablated layer. ``RunOutput.logits`` ``[1, P,
    vocab]``; with ``capture_patterns`` the patterns (``hook_pattern``) of the layers from
    ``RunOutput.start`` up."""
    L = rt.adapter.n_layers
    start = min(layer for layer, _ in heads)
    edits = [value.edit(layer, sorted(h for lyr, h in heads if lyr == layer))
             for layer in sorted({layer for layer, _ in heads})]
    T = ft.hidden_states.shape[1]
    cache = ({f"blocks.{layer}.attn.hook_pattern": None for layer in range(start, L)}
             if capture_patterns else None)
    run = run_variants(rt, [0] * T, ft.hidden_states[start][None], start, edits, positions,
                       cache)
    patterns = [run.cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(start, L)] \
        if capture_patterns else []
    return RunOutput(run.logits, start, patterns)


def ablation_scan(rt, ft, value: AblationValue, metric,
                  positions: Sequence[int] | None) -> torch.Tensor:
    """Every head ablated alone: for each layer one hooked forward of ``n_heads`` variants
    from the cached residual stream entering it, variant h with head h's z ablated (the
    intervention of ``value`` under a one-hot head mask). Returns ``metric(logits [batch, P,
    vocab]) -> [batch]`` as ``[layer, head]`` (float32, CPU)."""
    a = rt.adapter
    mask = _one_hot_heads(a.n_heads, None, lm_parts(rt).device)
    out = torch.empty(a.n_layers, a.n_heads)
    T = ft.hidden_states.shape[1]
    for layer in range(a.n_layers):
        run = run_variants(rt, [0] * T, ft.hidden_states[layer][None].expand(a.n_heads, -1, -1),
                           layer, [value.edit(layer, mask=mask)], positions)
        out[layer] = metric(run.logits).float().cpu()
    return out


def served_logits(rt, input_ids: Sequence[int]) -> torch.Tensor | None:
    """The next-token logits ``[pos, vocab]`` the hooked forward serves for ``input_ids``
    (embeddings to the LM head, nothing edited: ``/v1/run``'s forward, the blocks every
    intervention runs), for ``/v1/verify`` to compare with its float64 recomputation; None
    for a model the hooked forward does not run (an encoder, an unsupported GPT-2 switch)."""
    try:
        p = lm_parts(rt)
    except InvalidRequest:
        return None
    return hooked.run(p, _ids(input_ids, 1, p.device)).logits[0]


# ------------------------------------------------------------------ patching at any hook
#: /v1/patch ``hook`` -> (TL name suffix of ``blocks.{l}.<suffix>``, kind of cells):
#: 'pos' hooks ``[batch, pos, d]`` patch one position at a time (TL ``layer_pos_patch_setter``);
#: 'head' hooks ``[batch, pos, head, d]`` one head (all positions, or one position);
#: 'pattern' ``[batch, head, query_pos, key_pos]`` one head (all rows, or one query row).
PATCH_HOOKS: dict[str, tuple[str, str]] = {
    "resid_pre": ("hook_resid_pre", "pos"),
    "resid_mid": ("hook_resid_mid", "pos"),
    "resid_post": ("hook_resid_post", "pos"),
    "attn_out": ("hook_attn_out", "pos"),
    "mlp_out": ("hook_mlp_out", "pos"),
    "z": ("attn.hook_z", "head"),
    "q": ("attn.hook_q", "head"),
    "k": ("attn.hook_k", "head"),
    "v": ("attn.hook_v", "head"),
    "pattern": ("attn.hook_pattern", "pattern"),
}

#: the TransformerLens 4.3 ``patching`` function each (hook, by_position) grid equals
TL_FUNCTIONS: dict[tuple[str, bool], str] = {
    **{(h, True): f"get_act_patch_{h}" for h in ("resid_pre", "resid_mid", "attn_out",
                                                   "mlp_out")},
    ("resid_post", True): "(none in TransformerLens: the resid_pre setter on hook_resid_post)",
    ("z", False): "get_act_patch_attn_head_out_all_pos",
    ("z", True): "get_act_patch_attn_head_out_by_pos",
    **{(h, False): f"get_act_patch_attn_head_{h}_all_pos" for h in ("q", "k", "v", "pattern")},
    **{(h, True): f"get_act_patch_attn_head_{h}_by_pos" for h in ("q", "k", "v", "pattern")},
}


def patch_hook_name(hook: str, layer: int) -> str:
    """The TL name ``blocks.{layer}.<suffix>`` of a /v1/patch ``hook``."""
    return f"blocks.{layer}.{PATCH_HOOKS[hook][0]}"


def patch_grid_axes(hook: str, by_position: bool) -> tuple[str, ...]:
    """The grid's axes, TL's order: ``(layer, pos)`` for position hooks; ``(layer, head)``
    (all positions) or ``(layer, pos, head)`` (by position) for z/q/k/v; ``(layer, head)`` or
    ``(layer, head, dest_pos)`` for the pattern."""
    kind = PATCH_HOOKS[hook][1]
    if kind == "pos":
        return ("layer", "pos")
    if kind == "head":
        return ("layer", "pos", "head") if by_position else ("layer", "head")
    return ("layer", "head", "dest_pos") if by_position else ("layer", "head")


def _cells(kind: str, by_position: bool, T: int, H: int, heads: Sequence[int] | None,
           positions: Sequence[int] | None):
    """The cells of one layer: ``(index in the layer's grid, mask of the hook's leading axes
    without batch)`` pairs, as a list of grid indices and one bool mask ``[n, *lead]``."""
    hs = list(range(H)) if heads is None else list(heads)
    ps = list(range(T)) if positions is None else list(positions)
    if kind == "pos":
        idx = [(p,) for p in ps]
        mask = torch.zeros(len(idx), T, dtype=torch.bool)
        mask[torch.arange(len(idx)), torch.tensor(ps)] = True
        return idx, mask
    if kind == "head":
        if by_position:
            idx = [(p, h) for p in ps for h in hs]
            mask = torch.zeros(len(idx), T, H, dtype=torch.bool)
            n = torch.arange(len(idx))
            mask[n, torch.tensor([p for p, _ in idx]), torch.tensor([h for _, h in idx])] = True
        else:
            idx = [(h,) for h in hs]
            mask = torch.zeros(len(idx), T, H, dtype=torch.bool)
            for i, h in enumerate(hs):
                mask[i, ps, h] = True  # every position (or the chosen ones), together
        return idx, mask
    # pattern: leading axes [head, query_pos]
    if by_position:
        idx = [(h, d) for h in hs for d in ps]
        mask = torch.zeros(len(idx), H, T, dtype=torch.bool)
        n = torch.arange(len(idx))
        mask[n, torch.tensor([h for h, _ in idx]), torch.tensor([d for _, d in idx])] = True
    else:
        idx = [(h,) for h in hs]
        mask = torch.zeros(len(idx), H, T, dtype=torch.bool)
        for i, h in enumerate(hs):
            mask[i, h, ps] = True
    return idx, mask


def hook_heads(rt, hook: str) -> int:
    """The size of a /v1/patch hook's head axis (key/value heads for k and v under grouped-
    query attention, as TransformerLens' k/v grids count ``n_key_value_heads``); n_heads for
    hooks without one."""
    hp = hooked.resolve(lm_parts(rt), patch_hook_name(hook, 0))[0]
    return hp.sizes[hp.head_axis] if hp.head_axis is not None else rt.adapter.n_heads


def patch_grid_shape(rt, hook: str, by_position: bool, T: int) -> tuple[int, ...]:
    a = rt.adapter
    size = {"layer": a.n_layers, "pos": T, "dest_pos": T, "head": hook_heads(rt, hook)}
    return tuple(size[x] for x in patch_grid_axes(hook, by_position))


def patch_cells(rt, hook: str, by_position: bool, T: int, layers=None, heads=None,
                positions=None) -> int:
    """How many patched forwards (rows) a grid needs."""
    L = len(range(rt.adapter.n_layers) if layers is None else layers)
    idx, _ = _cells(PATCH_HOOKS[hook][1], by_position, T, hook_heads(rt, hook), heads, positions)
    return L * len(idx)


def hook_runs(rt, ids: Sequence[int], hooks: Sequence[str],
              positions: Sequence[int] = (-1,)) -> hooked.RunResult:
    """One hooked forward of one prompt from its token ids, caching ``hooks`` (TL names),
    logits ``[1, len(positions), vocab]`` at ``positions``."""
    p = lm_parts(rt)
    return hooked.run(p, _ids(ids, 1, p.device), cache={h: None for h in hooks},
                      logit_positions=list(positions))


def hook_patch_grid(rt, clean_ids: Sequence[int], corrupted_ids: Sequence[int], hook: str,
                    by_position: bool, metric, positions: Sequence[int],
                    layers: Sequence[int] | None = None, heads: Sequence[int] | None = None,
                    patch_positions: Sequence[int] | None = None, max_rows: int = 1 << 30,
                    progress=None, continuation: bool = True) -> torch.Tensor:
    """Activation patching clean -> corrupted at any hook of :data:`PATCH_HOOKS`, equal to
    TransformerLens 4.3's ``get_act_patch_*`` of the same name (:data:`TL_FUNCTIONS`).

    The clean run caches ``blocks.*.<hook>``, the corrupted run ``blocks.*.hook_resid_pre``;
    for each layer l the cells (one position; one head at every position; one (position,
    head); one head's pattern, or one query row of it) are rows of hooked forwards that start
    from the corrupted run's residual stream entering l, with ``Set`` of the clean activation
    under a per-row mask, at most ``max_rows`` rows a forward. ``metric(logits [rows,
    len(positions), vocab]) -> [rows]`` reads the logits at ``positions``. ``layers`` /
    ``heads`` / ``patch_positions``: the cells computed (by position: the positions of the
    grid; all positions: the positions patched together; null = all); the rest stay NaN.
    ``progress(done, total)`` is called after each forward.

    GPT-2 (``continuation``, default): a KV-cache continuation instead (:func:`_window_forward`).
    A cell whose patched entries first differ from the corrupted run's at position s leaves
    every activation before s unchanged (causal), so its row runs blocks l .. n_layers - 1 over
    positions s .. max(positions) only, attending to the corrupted run's cached ``hook_k`` /
    ``hook_v`` of positions < s, the metric's positions before s read from the corrupted run's
    logits; the rows of one (layer, s) are one batched forward. Per cell that is
    ``max(positions) - s + 1`` positions instead of T (a head x position grid: about half the
    work). Other families, or ``continuation=False``: rows of the whole length from layer l.

    Cells that cannot change the metric are not run and get the corrupted run's value: those
    whose clean activation equals the corrupted one at every patched entry (bit for bit: e.g.
    positions before the first token where the prompts differ, in a causal model), and those
    whose patched positions all come after the last position the metric reads (causal: later
    positions never reach earlier logits). Returns ``(grid, skipped)``: the raw metric grid
    (float32, CPU), shaped :func:`patch_grid_shape` (axes :func:`patch_grid_axes`), and the
    number of cells skipped."""
    a = rt.adapter
    L, Hn, T = a.n_layers, hook_heads(rt, hook), len(clean_ids)
    suffix, kind = PATCH_HOOKS[hook]
    lyrs = list(range(L)) if layers is None else list(layers)
    names = [f"blocks.{lyr}.{suffix}" for lyr in lyrs]
    kv = continuation and kv_continuation_supported(rt) and bool(lyrs)
    clean = hook_runs(rt, clean_ids, names)
    extra = [f"blocks.{lyr}.hook_resid_pre" for lyr in lyrs]
    if kv:  # every block's keys and values from the lowest patched layer up
        extra += [f"blocks.{j}.attn.hook_{kv_}" for j in range(min(lyrs), L) for kv_ in "kv"]
    corr = hook_runs(rt, corrupted_ids, list(dict.fromkeys(names + extra)), positions)
    k_val = metric(corr.logits).float().cpu()[0]
    idx, mask = _cells(kind, by_position, T, Hn, heads, patch_positions)
    dev = lm_parts(rt).device
    mask = mask.to(dev)
    # positions after the last one the metric reads cannot change it (causal models)
    pos_axis = 1 if kind == "pattern" else 0
    shape = [1] * (mask.dim() - 1)
    shape[pos_axis] = T
    late = (torch.arange(T, device=dev) > max(positions)).view(shape)
    out = torch.full(patch_grid_shape(rt, hook, by_position, T), float("nan"))
    index = torch.tensor(idx, dtype=torch.long)  # [n, k] grid indices within a layer
    todo, first = {}, {}
    for layer, name in zip(lyrs, names):
        c, k = clean.cache[name][0], corr.cache[name][0]
        n_lead = mask.dim() - 1
        differ = (c != k).flatten(n_lead).any(-1) & ~late  # [*lead]
        live = mask & differ  # [n, *lead]: the entries a cell changes
        todo[layer] = live.flatten(1).any(1).nonzero()[:, 0].cpu()
        # each cell's first changed position: every activation before it is the corrupted
        # run's own (causal), so its variant runs from there on (KV-cache continuation)
        by_pos = (live.any(1) if kind == "pattern" else live if kind == "pos"
                  else live.flatten(2).any(2))  # [n, T]
        first[layer] = by_pos.int().argmax(1).cpu()
    groups = {}  # layer -> [(window start, rows of one forward)]
    for layer in lyrs:
        rows = todo[layer]
        if not kv:
            groups[layer] = [(0, rows[s:s + max_rows]) for s in range(0, len(rows), max_rows)]
            continue
        st = first[layer][rows]
        groups[layer] = [(int(s0), grp[i:i + max_rows])
                         for s0 in torch.unique(st).tolist() for grp in [rows[st == s0]]
                         for i in range(0, len(grp), max_rows)]
    total = sum(len(g) for g in groups.values())
    done, skipped = 0, 0
    e = max(positions)
    p_ = lm_parts(rt)
    site = suffix
    for layer, name in zip(lyrs, names):
        value = clean.cache[name][0]
        resid = corr.cache[f"blocks.{layer}.hook_resid_pre"]
        v = torch.full((len(idx),), float(k_val))  # cells that change nothing: the corrupted run
        skipped += len(idx) - len(todo[layer])
        for s, sel in groups[layer]:
            m = mask[sel.to(dev)]
            if kv:
                win = slice(s, e + 1)
                if kind == "pattern":
                    val, mw = value[:, win, :e + 1], m[:, :, win]
                else:
                    val, mw = value[win], m[:, win]
                past = [tuple(corr.cache[f"blocks.{j}.attn.hook_{x}"][:, :s].transpose(1, 2)
                              for x in "kv") for j in range(layer, L)]
                with torch.inference_mode():
                    xo = _window_forward(p_, layer, s, resid[:, win], past, site, val, mw)
                    logits = _window_logits(p_, xo, s, list(positions), corr.logits)
                v[sel] = metric(logits).float().cpu()
            else:
                edit = hooked.Set(hook=name, value=value, mask=m)
                run = run_variants(rt, corrupted_ids, resid.expand(m.shape[0], -1, -1), layer,
                                   [edit], positions)
                v[sel] = metric(run.logits).float().cpu()
            done += 1
            if progress is not None:
                progress(done, total)
        out[(torch.full((len(idx),), layer),) + tuple(index.T)] = v
    return out, skipped


# ------------------------------------------------------------------ KV-cache continuation
#: sites the window forward (:func:`_window_forward`) can edit at its first layer, the
#: /v1/patch hooks' sites (``PATCH_HOOKS``), in forward order
_WINDOW_SITES = ("hook_resid_pre", "attn.hook_q", "attn.hook_k", "attn.hook_v",
                 "attn.hook_pattern", "attn.hook_z", "hook_attn_out", "hook_resid_mid",
                 "hook_mlp_out", "hook_resid_post")


def _addmm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """transformers' ``Conv1D``: ``addmm(b, x.view(-1, nx), w)`` (the hooked forward's kernel)."""
    return torch.addmm(b, x.reshape(-1, x.size(-1)), w).view(x.size()[:-1] + (w.shape[1],))


def kv_continuation_supported(rt) -> bool:
    """Whether :func:`_window_forward` runs this model (GPT-2 parts; the rotary families and
    GPT-NeoX keep the full-length variant forwards)."""
    return isinstance(lm_parts(rt), hooked.GPT2Parts)


def _window_forward(p, layer: int, s: int, x: torch.Tensor, past_kv: Sequence,
                    site: str, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A KV-cache continuation of GPT-2 blocks ``layer .. n_layers - 1`` over the window of
    positions ``s .. s + W - 1`` only, for ``B`` variant rows; returns the last block's output
    ``[B, W, d_model]`` (before ln_f).

    ``x`` ``[B | 1, W, d_model]``: the residual stream entering block ``layer`` at the window's
    positions; ``past_kv[j - layer]``: block j's keys and values of positions ``0 .. s - 1``
    ``([1, head, s, d_head], [1, head, s, d_head])`` (``hook_k`` / ``hook_v`` of the run the
    variants edit, transposed). In a causal model an edit at positions ``>= s`` leaves every
    activation at positions ``< s`` unchanged, so those keys and values are the run's own and
    the window's queries attend over ``past + window`` keys (``key <= query``, the additive
    ``finfo.min`` mask). At block ``layer`` the hook ``site`` (a suffix of
    :data:`_WINDOW_SITES`) is set to ``value`` (one prompt's hook value cut to the window:
    ``[W, d]``, ``[W, head, d_head]``, ``[head, W, s + W]``) where ``mask`` (the hook's leading
    axes with batch, ``[B, W]``, ``[B, W, head]``, ``[B, head, W]``) is True: the same
    ``Set`` the hooked forward applies. Hugging Face's eager GPT-2 operations in its order
    (Conv1D addmm, F.layer_norm, ``q.k^T * scaling + mask``, softmax in the dtype,
    ``pattern @ v``), so each cell equals the full-length forward up to float32 rounding of
    the shorter matrix products."""
    B, W = mask.shape[0], x.shape[1]
    H, dh, D = p.n_heads, p.d_head, p.d_model
    dt, dev = x.dtype, x.device
    x = x.expand(B, W, D)
    qa = torch.arange(s, s + W, device=dev)[:, None]
    add = torch.zeros(W, s + W, dtype=dt, device=dev).masked_fill(
        torch.arange(s + W, device=dev)[None] > qa, torch.finfo(dt).min)
    m = mask.unsqueeze(-1)
    val = value.to(dtype=dt, device=dev)

    def at(j: int, name: str, t: torch.Tensor) -> torch.Tensor:
        return torch.where(m, val, t) if j == layer and name == site else t

    for j in range(layer, p.n_layers):
        blk = p.blocks[j]
        x = at(j, "hook_resid_pre", x)
        h = F.layer_norm(x, (D,), blk.ln1_w, blk.ln1_b, p.eps)
        qkv = _addmm(h, blk.attn_w, blk.attn_b)
        q, k, v = (t.reshape(B, W, H, dh) for t in qkv.split(D, dim=2))
        q, k, v = at(j, "attn.hook_q", q), at(j, "attn.hook_k", k), at(j, "attn.hook_v", v)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, head, W, d_head]
        pk, pv = past_kv[j - layer]
        if s:
            k = torch.cat([pk.expand(B, -1, -1, -1), k], dim=2)
            v = torch.cat([pv.expand(B, -1, -1, -1), v], dim=2)
        scores = torch.matmul(q, k.transpose(-1, -2)) * blk.scaling
        scores = scores + add
        pattern = torch.softmax(scores, dim=-1).type(v.dtype)
        pattern = at(j, "attn.hook_pattern", pattern)
        z = at(j, "attn.hook_z", torch.matmul(pattern, v).transpose(1, 2))
        attn = at(j, "hook_attn_out", _addmm(z.reshape(B, W, D).contiguous(), blk.proj_w,
                                             blk.proj_b))
        x = at(j, "hook_resid_mid", attn + x)
        h = F.layer_norm(x, (D,), blk.ln2_w, blk.ln2_b, p.eps)
        mlp = _addmm(p.act(_addmm(h, blk.fc_w, blk.fc_b)), blk.out_w, blk.out_b)
        x = at(j, "hook_resid_post", x + at(j, "hook_mlp_out", mlp))
    return x


def _window_logits(p, x: torch.Tensor, s: int, positions: Sequence[int],
                   before: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, len(positions), vocab]`` of window outputs ``x`` ``[B, W, d_model]``
    (positions ``s ..``): ln_f and the LM head at the positions ``>= s``; the positions before
    the window take ``before`` ``[1, len(positions), vocab]`` (the edited run's own logits,
    unchanged there in a causal model)."""
    B = x.shape[0]
    inside = [i for i, q in enumerate(positions) if q >= s]
    rel = torch.tensor([positions[i] - s for i in inside], device=x.device)
    h = F.layer_norm(x[:, rel], (p.d_model,), p.lnf_w, p.lnf_b, p.eps)
    lg = F.linear(h, p.unembed)
    if len(inside) == len(positions):
        return lg
    out = before.to(lg.dtype).expand(B, -1, -1).clone()
    out[:, inside] = lg
    return out


def hook_attribution(rt, clean_ids: Sequence[int], corrupted_ids: Sequence[int], hook: str,
                     grad_metric, with_clean_row: bool = False):
    """The ingredients of attribution patching at any hook of :data:`PATCH_HOOKS` (Nanda 2023;
    Kramár et al. 2024, AtP): one clean forward caching every layer's ``blocks.{l}.<hook>``,
    and one forward of the corrupted prompt (row 0; with ``with_clean_row`` the clean prompt
    as row 1, for a KL term against it) caching the same hooks and differentiating
    ``grad_metric`` (a hooked metric) with respect to them in one backward.

    Returns ``(value, grads, clean, corrupted)``: the metric's value on the corrupted run (0-d)
    and per layer lists of the gradient, the clean and the corrupted activation, each the
    hook's shape without batch (``[pos, d_model]``, ``[pos, head, d_head]``, ``[head,
    query_pos, key_pos]``). The analysis reduces them to cells
    (``analysis.interventions.patch_attribution``)."""
    p = lm_parts(rt)
    L = p.n_layers
    names = [patch_hook_name(hook, layer) for layer in range(L)]
    clean = hook_runs(rt, clean_ids, names)
    rows = [list(corrupted_ids)] + ([list(clean_ids)] if with_clean_row else [])
    ids = torch.tensor(rows, dtype=torch.long, device=p.device)
    res = hooked.run(p, ids, cache={n: None for n in names}, logit_positions=[-1],
                     grad=hooked.GradRequest(metric=grad_metric, hooks=names))
    grads = [res.grads[n][0].detach() for n in names]
    return (res.grad_value, grads, [clean.cache[n][0] for n in names],
            [res.cache[n][0] for n in names])


# ------------------------------------------------------------------ ablation of any component
@dataclass
class Component:
    """One ablated component, resolved: ``kind`` 'head' (``layer``, ``head``), 'mlp' / 'attn'
    (``layer``), 'neuron' (``layer``, ``neurons``), 'direction' (``hook``, unit ``vector``
    ``[d]`` on the hook's last axis, ``positions`` or None = all)."""

    kind: str
    layer: int
    head: int | None = None
    neurons: Sequence[int] | None = None
    hook: str | None = None
    vector: torch.Tensor | None = None
    positions: Sequence[int] | None = None
    norm: float = 1.0  # a direction's vector norm as given (before normalising)

    @property
    def hook_name(self) -> str:
        if self.kind == "head":
            return _z(self.layer)
        if self.kind == "mlp":
            return f"blocks.{self.layer}.hook_mlp_out"
        if self.kind == "attn":
            return f"blocks.{self.layer}.hook_attn_out"
        if self.kind == "neuron":
            return f"blocks.{self.layer}.mlp.hook_post"
        return self.hook


def _site_order(rt, name: str) -> tuple[int, int]:
    hp = hooked.resolve(lm_parts(rt), name)[0]
    return (hp.layer, list(hooked.LAYER_SITES).index(hp.site))


def _coef(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``x . u`` over the last axis ``[...]``."""
    return (x * u.to(x.dtype)).sum(-1)


def _by_length(texts: Sequence[Sequence[int]]) -> dict[int, list[int]]:
    """The indices of ``texts`` grouped by token count (one batched forward per group)."""
    groups: dict[int, list[int]] = {}
    for i, ids in enumerate(texts):
        groups.setdefault(len(ids), []).append(i)
    return groups


def _parts_upto(rt, n_blocks: int):
    """The hooked forward's parts with only the first ``n_blocks`` blocks (a forward that only
    needs a hook of block ``n_blocks - 1`` stops there; its ln_f and LM head then read that
    block's output, which nothing uses). The same tensors, memoised per parts object."""
    import dataclasses

    p = lm_parts(rt)
    if n_blocks >= p.n_layers:
        return p
    key, memo = rt.memo.get("hooked_parts_upto", (None, {}))
    if key is not p:
        memo = {}
        rt.memo["hooked_parts_upto"] = (p, memo)
    if n_blocks not in memo:
        memo[n_blocks] = dataclasses.replace(p, blocks=tuple(p.blocks[:n_blocks]))
    return memo[n_blocks]


def _rows_per_forward(rt, T: int, max_bytes: int | None) -> int:
    """How many rows of ``T`` tokens one batched forward may hold under ``max_bytes`` (the
    estimate :func:`variant_batch_bytes` with logits at every position); at least 1."""
    if not max_bytes:
        return 1 << 30
    return max(1, int(max_bytes) // max(1, variant_batch_bytes(rt, 1, T, T)))


def component_sources(rt, comps: Sequence[Component], method: str,
                      texts: Sequence[Sequence[int]], resample_ids: Sequence[int] | None,
                      max_bytes: int | None = None):
    """What each component's ablation writes, from unedited hooked forwards: method 'mean' ->
    per component the mean over every position of ``texts`` (the text itself, or the
    reference texts, pooled) of its hook's value (heads, MLPs, attention layers: the vector;
    neurons: their activations ``[n]``; directions: the coefficient ``x . u``); 'resample' ->
    the resample text's value at every position; 'zero' -> None each.

    The texts of one token count run as one batched forward (``[n, pos]``, at most
    ``max_bytes`` of :func:`variant_batch_bytes` a forward), each text's rows then pooled in
    the order given (float32 mean over all positions)."""
    if method == "zero":
        return [None] * len(comps)
    names = sorted({c.hook_name for c in comps})
    p = _parts_upto(rt, 1 + max(_site_order(rt, n)[0] for n in names))
    if method == "resample":
        res = hook_runs(rt, resample_ids, names)
        per = {n: res.cache[n][0] for n in names}  # [pos, ...]
    else:
        rows: dict[str, list] = {n: [None] * len(texts) for n in names}
        for T, idx in _by_length(texts).items():
            step = _rows_per_forward(rt, T, max_bytes)
            for s in range(0, len(idx), step):
                part = idx[s:s + step]
                ids = torch.tensor([list(texts[i]) for i in part], dtype=torch.long,
                                   device=p.device)
                res = hooked.run(p, ids, cache={n: None for n in names}, logit_positions=[-1])
                for n in names:
                    for j, i in enumerate(part):
                        rows[n][i] = res.cache[n][j]
        per = {n: torch.cat(v, dim=0) for n, v in rows.items()}  # [all positions, ...]
    out = []
    for c in comps:
        x = per[c.hook_name]
        if c.kind == "neuron":
            v = x[..., list(c.neurons)]
        elif c.kind == "direction":
            v = _coef(x, c.vector)
        else:
            v = x
        out.append(v.mean(0) if method == "mean" else v)
    return out


def ablate_components(rt, ids: Sequence[int], comps: Sequence[Component], method: str,
                      sources: Sequence, capture_patterns: bool = False) -> RunOutput:
    """One text's hooked forward with every component of ``comps`` ablated together by
    ``method`` ('zero' / 'mean' / 'resample'; ``sources`` from :func:`component_sources`).

    Heads, MLPs and attention layers are hooked interventions on ``hook_z`` (the head
    selected), ``hook_mlp_out``, ``hook_attn_out``: ``Zero``, ``Mean(reference=)``, ``Set``.
    Neurons (``mlp.hook_post[..., n]``) and directions (``x - (x . u) u + c u``, c = 0, the
    mean coefficient or the resample text's) depend on the value arriving at their hook, so
    each such hook (in forward order) first gets one forward with every edit upstream of it
    applied, caching the hook; its edited value then enters as ``Set`` (downstream edits do
    not change an upstream value, so the final forward sees exactly those values). Every
    forward runs from the embeddings. Returns logits ``[1, pos, vocab]``; patterns from layer
    0 with ``capture_patterns``."""
    p = lm_parts(rt)
    return _ablate_rows(rt, _ids(ids, 1, p.device), comps, method, sources, capture_patterns)


def ablate_components_many(rt, texts: Sequence[Sequence[int]], comps: Sequence[Component],
                           method: str, sources: Sequence, each, max_bytes: int | None = None
                           ) -> None:
    """:func:`ablate_components` of many texts with the same ``sources`` (a dataset's mean
    ablation: the means taken once, by :func:`component_sources`): the texts of one token
    count as rows of one batched hooked forward (at most ``max_bytes`` of
    :func:`variant_batch_bytes` a forward; per-row edits are the single text's, so each row
    equals its single-text forward up to float32 rounding of the batched matrix products).
    Calls ``each(i, logits [pos, vocab])`` (the runtime's device) for every text i, a
    forward's texts after it (only one forward's logits are held at a time)."""
    p = lm_parts(rt)
    for T, idx in _by_length(texts).items():
        step = _rows_per_forward(rt, T, max_bytes)
        for s in range(0, len(idx), step):
            part = idx[s:s + step]
            ids = torch.tensor([list(texts[i]) for i in part], dtype=torch.long, device=p.device)
            run = _ablate_rows(rt, ids, comps, method, sources)
            for j, i in enumerate(part):
                each(i, run.logits[j])
            del run


def _ablate_rows(rt, ids: torch.Tensor, comps: Sequence[Component], method: str,
                 sources: Sequence, capture_patterns: bool = False) -> RunOutput:
    """:func:`ablate_components` on ``ids`` ``[batch, pos]`` (rows of one length, the same
    edits on each)."""
    p = lm_parts(rt)
    simple, valued = [], {}
    for c, src in zip(comps, sources):
        if c.kind in ("neuron", "direction"):
            valued.setdefault(c.hook_name, []).append((c, src))
            continue
        kw = dict(hook=c.hook_name, heads=[c.head] if c.kind == "head" else None)
        if method == "zero":
            simple.append(hooked.Zero(**kw))
        elif method == "mean":
            simple.append(hooked.Mean(reference=src, **kw))  # heads: every head's [head, d]
        else:
            simple.append(hooked.Set(value=src[:, [c.head]] if c.kind == "head" else src, **kw))
    edits = [(_site_order(rt, e.hook)[0], e) for e in simple]  # (layer, edit)
    # a valued hook's forward runs from the residual stream entering the previous valued
    # hook's block (that forward cached it, every edit below already in it) up to its own
    # block; the final forward from the last one's. The same operations as from the
    # embeddings: equal bit for bit.
    start, resid = 0, None
    for name in sorted(valued, key=lambda n: _site_order(rt, n)):
        layer = _site_order(rt, name)[0]
        want = {name: None}
        if layer > start and not capture_patterns:
            want[f"blocks.{layer - 1}.hook_resid_post"] = None
        run = hooked.run(_parts_upto(rt, layer + 1), ids, cache=want,
                         interventions=[e for lyr, e in edits if start <= lyr <= layer],
                         logit_positions=[-1], start=start, resid_pre=resid)
        x = run.cache[name]  # [batch, pos, ...]
        if len(want) > 1:
            start, resid = layer, run.cache[f"blocks.{layer - 1}.hook_resid_post"]
        new = x.clone()
        for c, src in valued[name]:
            pos = slice(None) if c.positions is None else list(c.positions)
            if c.kind == "neuron":
                nn = list(c.neurons)
                if method == "zero":
                    val = torch.zeros_like(new[..., nn])
                elif method == "mean":
                    val = src.to(new.dtype).expand_as(new[..., nn])
                else:
                    val = src.to(new.dtype)
                new[..., nn] = val
                continue
            u = c.vector.to(device=new.device, dtype=new.dtype)
            region = new[:, pos]
            coef = _coef(region, u)
            if method == "zero":
                target = torch.zeros_like(coef)
            elif method == "mean":
                target = src.to(new.dtype).expand_as(coef)
            else:
                target = src.to(new.dtype)[pos]
            new[:, pos] = region + (target - coef)[..., None] * u
        edits.append((layer, hooked.Set(hook=name, value=new)))
    cache = {"blocks.*.attn.hook_pattern": None} if capture_patterns else None
    run = hooked.run(p, ids, cache=cache, interventions=[e for lyr, e in edits if lyr >= start],
                     start=start, resid_pre=resid)
    patterns = ([run.cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(p.n_layers)]
                if capture_patterns else [])
    return RunOutput(run.logits, start, patterns)
