"""Logit lens and direct logit attribution: pure functions on tensors.

Logit lens (nostalgebraist 2020, "interpreting GPT: the logit lens"; TransformerLens
``ActivationCache.accumulated_resid(apply_ln=True)`` then the unembedding): each residual
state ``x`` ``[pos, d_model]`` is read as if it were the last one,
``logits = LN(x) W_U`` with

* ``"own"``: ``LN(x) = (x - mean x) / sqrt(var x + eps) * w + b``, x's own statistics (TL 4.3's
  ``accumulated_resid(apply_ln=True)`` over the full stack, i.e. ``apply_ln_to_stack(...,
  recompute_ln=True)``, applies ``model.ln_final`` to each state);
* ``"final"``: ``LN(x) = (x - mean x) / s * w + b`` with ``s`` = ``ln_final.hook_scale`` of the
  run (the last state's ``sqrt(var + eps)`` at that position, frozen: TL's
  ``apply_ln_to_stack(..., recompute_ln=False)``, which centres and divides, then ln_final's
  ``w`` and ``b``, not folded into ``W_U`` in unprocessed weights).

Direct logit attribution (Elhage et al. 2021; Wang et al. 2022; TransformerLens
``stack_head_results`` / ``decompose_resid`` + ``apply_ln_to_stack``): with the final scale
frozen, ln_final is affine in the residual state, so the final state's sum of components
``x = embed + pos_embed + sum_l (sum_h result_lh + b_O^l + mlp_out_l)`` splits the logit
difference exactly:
``logit[t] - logit[d] = sum_c ((c - mean c) / s) . (w * (u_t - u_d)) + b . (u_t - u_d)``,
``u_t`` = ``W_U[:, t]``; the last term (ln_final's bias) is no component's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LN_DESCRIPTION = {
    "own": "each residual state x normalised by its own statistics: logits = ((x - mean x) / "
           "sqrt(var x + eps) * w + b) W_U, w and b ln_final's (TransformerLens 4.3 "
           "accumulated_resid(apply_ln=True): the final norm recomputed per state)",
    "final": "the final LayerNorm's scale frozen from the run: logits = ((x - mean x) / s * w "
             "+ b) W_U, s = ln_final.hook_scale of the last residual state at that position "
             "(TransformerLens apply_ln_to_stack(recompute_ln=False), then ln_final's w and b)",
}

DLA_DESCRIPTION = (
    "direct logit attribution through ln_final with its scale frozen from the run "
    "(TransformerLens apply_ln_to_stack): part(c) = ((c - mean c) / s) . (w * (W_U[:, target] "
    "- W_U[:, distractor])), s = ln_final.hook_scale at the position, w ln_final's weight; "
    "components: hook_embed, hook_pos_embed, every blocks.{l}.attn.hook_result head (without "
    "b_O), every layer's b_O, every blocks.{l}.hook_mlp_out. The parts sum to the logit "
    "difference up to ln_final's bias term b . (W_U[:, target] - W_U[:, distractor]), which is "
    "reported (ln_final_bias); residual_error is what float rounding leaves."
)


def lens_logits(x: torch.Tensor, unembed: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                eps: float, ln: str, final_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Lens logits ``[pos, vocab]`` of one residual state ``x`` ``[pos, d_model]``.

    ``unembed``: ``lm_head.weight`` ``[vocab, d_model]`` (W_U transposed); ``w``, ``b``, ``eps``:
    ln_final's; ``ln`` "own" or "final" (module docstring); ``final_scale`` ``[pos, 1]``
    (ln_final.hook_scale, needed for "final")."""
    if ln == "own":
        h = F.layer_norm(x, (x.shape[-1],), w, b, eps)
    elif ln == "final":
        if final_scale is None:
            raise ValueError("ln 'final' needs the run's ln_final scale")
        h = (x - x.mean(-1, keepdim=True)) / final_scale * w + b
    else:
        raise ValueError(f"ln is 'own' or 'final', got {ln!r}")
    return F.linear(h, unembed)


@dataclass
class LensStats:
    """One state's lens statistics. ``loss``: mean next-token cross entropy over positions
    0..T-2 (nats; None for T = 1); ``top_ids``/``top_probs``/``top_logits`` ``[n_pos, k]``;
    ``target_rank``/``target_logprob`` ``[n_pos]`` (rank = tokens with a strictly higher
    logit; entries where ``targets`` is negative are undefined)."""

    loss: float | None
    top_ids: torch.Tensor
    top_probs: torch.Tensor
    top_logits: torch.Tensor
    target_rank: torch.Tensor
    target_logprob: torch.Tensor


def log_normaliser(logits: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """``logsumexp`` over the vocabulary ``[pos]`` in float64, ``rows`` positions at a time
    (no float64 copy of the whole ``[pos, vocab]``)."""
    return torch.cat([torch.logsumexp(logits[i:i + rows].double(), -1)
                      for i in range(0, logits.shape[0], rows)])


def lens_stats(logits: torch.Tensor, ids: torch.Tensor, positions: list[int], top_k: int,
               targets: torch.Tensor) -> LensStats:
    """Statistics of lens ``logits`` ``[pos, vocab]`` for token ids ``ids`` ``[pos]``:
    the loss over every position, and at ``positions`` the ``top_k`` tokens and the rank and
    log-prob of ``targets`` ``[len(positions)]`` (a negative target: none). Log-probs are
    ``logit - logsumexp(logits)`` in float64 (float32 logits; nats)."""
    logits = logits.float()
    lse = log_normaliser(logits)  # [pos] float64
    T = logits.shape[0]
    ids = ids.to(logits.device)
    loss = None
    if T >= 2:
        nxt = logits[:-1].gather(-1, ids[1:, None])[:, 0].double()
        loss = float((lse[:-1] - nxt).mean())
    pos = torch.tensor(positions, dtype=torch.long, device=logits.device)
    lg, z = logits[pos], lse[pos][:, None]
    k = min(top_k, logits.shape[-1])
    top_l, top_i = lg.topk(k, dim=-1)
    top_p = (top_l.double() - z).exp()
    t = targets.to(logits.device).clamp(min=0)[:, None]
    t_logit = lg.gather(-1, t)
    rank = (lg > t_logit).sum(-1)
    return LensStats(loss, top_i, top_p, top_l, rank, (t_logit.double() - z)[:, 0])


# ------------------------------------------------------------------ direct logit attribution
def apply_ln_to_stack(stack: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """TransformerLens ``apply_ln_to_stack`` (recompute_ln False): each component centred
    over d_model and divided by the frozen scale. ``stack`` ``[component, ..., d_model]``,
    ``scale`` ``[..., 1]``."""
    return (stack - stack.mean(-1, keepdim=True)) / scale


def logit_direction(unembed: torch.Tensor, target: torch.Tensor,
                    distractor: torch.Tensor | None) -> torch.Tensor:
    """``W_U[:, target] - W_U[:, distractor]`` (or ``W_U[:, target]``) per entry:
    ``[n, d_model]`` from ``unembed`` = lm_head.weight ``[vocab, d_model]``."""
    d = unembed[target]
    return d if distractor is None else d - unembed[distractor]


def direct_logit_attribution(stack: torch.Tensor, scale: torch.Tensor, w: torch.Tensor,
                             direction: torch.Tensor) -> torch.Tensor:
    """Each component's part ``[component, n]`` of the logit direction, in float64:
    ``stack`` ``[component, n, d_model]`` (the components at n (prompt, position) entries),
    ``scale`` ``[n, 1]`` (ln_final.hook_scale there), ``w`` ln_final's weight, ``direction``
    ``[n, d_model]`` (:func:`logit_direction`)."""
    s = apply_ln_to_stack(stack.double(), scale.double())
    return torch.einsum("cnd,nd->cn", s, direction.double() * w.double())


def ln_bias_term(b: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """``b . direction`` ``[n]`` (float64): ln_final's bias on the logit direction."""
    return direction.double() @ b.double()


# ----------------------------------------------------------- RMSNorm families (issue 28)
RMS_LN_DESCRIPTION = {
    "own": "each residual state x through the model's own final RMSNorm, as Hugging Face "
           "computes it (float32 upcast: h = x * rsqrt(mean(x^2) + eps); Llama, Mistral, "
           "Qwen2: w * h cast to the dtype; Gemma, Gemma 2: (h * (1 + w)) cast), then the "
           "unembedding (and Gemma 2's final soft-cap tanh(z / cap) * cap): logits = "
           "norm(x) W_U. No centring, no bias. The final_post state is bit for bit the model's "
           "own logits",
    "final": "the final RMSNorm's scale frozen from the run: logits = (x / s * w') W_U (then "
             "Gemma 2's soft-cap), s = ln_final.hook_scale = sqrt(mean(x_L^2) + eps) of the "
             "last residual state x_L at that position (float32), w' = w (Llama, Mistral, "
             "Qwen2) or 1 + w (Gemma, Gemma 2); no centring (RMSNorm has none), no bias",
}

RMS_DLA_DESCRIPTION = (
    "direct logit attribution through the final RMSNorm with its scale frozen from the run: "
    "part(c) = (c / s) . (w' * (W_U[:, target] - W_U[:, distractor])), s = "
    "ln_final.hook_scale = sqrt(mean(x^2) + eps) of the last residual state at the position, "
    "w' = w (Llama, Mistral, Qwen2) or 1 + w (Gemma, Gemma 2); no centring and no bias "
    "(RMSNorm has neither; ln_final_bias is 0). Components: hook_embed (no hook_pos_embed: "
    "positions enter through RoPE), every blocks.{l}.attn.hook_result head (without b_O), "
    "b_O per layer where the model has one (attn_bias, else null), every "
    "blocks.{l}.hook_mlp_out. Gemma 2: each head's part is its share of hook_attn_out (what "
    "enters the residual stream) with the post-attention norm ln1_post's scale frozen too, "
    "result_h / s_post * (1 + w_post); and the parts sum to the logit difference before the "
    "final soft-cap (pre_softcap_logit_diff; the capped logit_diff is tanh of it, not a sum). "
    "residual_error is what float rounding leaves."
)


def rms_final(x: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool,
              scale: torch.Tensor | None = None) -> torch.Tensor:
    """The final RMSNorm ``[pos, d_model]`` of ``x`` ``[pos, d_model]`` as Hugging Face computes
    it (LlamaRMSNorm: ``w * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(dtype)``; GemmaRMSNorm
    ``(x_f32 * rsqrt(...) * (1 + w_f32)).to(dtype)``), or with ``scale`` ``[pos, 1]`` (float32,
    ``ln_final.hook_scale``) frozen: ``x_f32 / scale`` in place of the rsqrt."""
    xf = x.float()  # HF upcasts to float32 in every dtype (float64 too)
    if scale is None:
        h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    else:
        h = xf / scale.float()
    if gemma:
        return (h * (1.0 + w.float())).to(x.dtype)
    return w * h.to(x.dtype)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's final-logit soft-cap ``tanh(z / cap) * cap`` (HF's three operations); the
    identity for ``cap`` None."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def rms_lens_logits(x: torch.Tensor, unembed: torch.Tensor, w: torch.Tensor, eps: float,
                    ln: str, gemma: bool, cap: float | None,
                    final_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Lens logits ``[pos, vocab]`` of one residual state ``x`` ``[pos, d_model]`` on an
    RMSNorm model (:data:`RMS_LN_DESCRIPTION`): ``ln`` "own" (the norm recomputed from x, as
    HF) or "final" (``final_scale`` ``[pos, 1]`` = ln_final.hook_scale); ``unembed``
    lm_head.weight ``[vocab, d_model]``; ``cap`` Gemma 2's final_logit_softcapping or None."""
    if ln == "own":
        h = rms_final(x, w, eps, gemma)
    elif ln == "final":
        if final_scale is None:
            raise ValueError("ln 'final' needs the run's ln_final scale")
        h = rms_final(x, w, eps, gemma, final_scale)
    else:
        raise ValueError(f"ln is 'own' or 'final', got {ln!r}")
    return softcap(F.linear(h, unembed), cap)


def rms_direct_logit_attribution(stack: torch.Tensor, scale: torch.Tensor, w_eff: torch.Tensor,
                                 direction: torch.Tensor) -> torch.Tensor:
    """Each component's part ``[component, n]`` of the logit direction through a frozen
    RMSNorm, float64: ``(c / s) . (w_eff * direction)`` (no centring). ``stack``
    ``[component, n, d_model]``, ``scale`` ``[n, 1]`` (ln_final.hook_scale), ``w_eff`` the
    norm's effective weight (``w``, Gemma ``1 + w``), ``direction`` ``[n, d_model]``."""
    s = stack.double() / scale.double()
    return torch.einsum("cnd,nd->cn", s, direction.double() * w_eff.double())
