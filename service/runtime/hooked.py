"""One hooked forward with TransformerLens 4.x hook points (the core of ``/v1/run``).

GPT-2 here; Llama, Mistral, Qwen2, Gemma, Gemma 2 and GPT-NeoX in :mod:`.hooked_families`
(the same plan, sites, interventions, metrics and gradients; :func:`parts` / :func:`gpt2_parts`
choose by ``config.model_type``; hook names and shapes per family: that module's docstring and
docs/api.md 'Hook names per family'). For GPT-2, a functional forward over the loaded Hugging
Face ``GPT2LMHeadModel``'s own parameter tensors (detached views, no copy) that:

* runs Hugging Face's eager operations in Hugging Face's order (Conv1D ``torch.addmm(bias,
  x.view(-1, nx), weight)``, ``F.layer_norm`` with the config eps, ``ACT2FN[activation]``,
  ``matmul(q, k^T) * scaling`` plus the additive ``finfo(dtype).min`` causal mask, softmax in
  the dtype, ``matmul(pattern, v)``), so that with nothing edited its residual stream and
  logits equal ``model(input_ids, use_cache=False)`` with ``attn_implementation="eager"``
  bit for bit (the runtime's own call; with ``use_cache=True`` Hugging Face's DynamicCache
  makes k and v contiguous, another matmul kernel: ~1e-5 on logits; ``tests/test_hooked.py``);
* exposes every activation under its TransformerLens 4.3 name and shape, those of
  ``TransformerBridge.boot_transformers(path).enable_compatibility_mode(no_processing=True)``
  (``HookedTransformer.from_pretrained_no_processing`` in TL 2/3): our model is the
  unprocessed checkpoint, so TL's default weight processing (fold_ln, centring) is NOT what
  the numbers are compared with;
* caches what is asked (only that, sliced as asked), applies declarative interventions in
  order at their hook inside the forward, computes declared metrics from the logits and, on
  request, the gradient of one metric with respect to chosen hooks from one backward
  (attribution patching, Nanda 2023; Kramár et al. 2024; docs/sources.md).

Hook semantics (TransformerLens 4.3 bridge, checked in ``tests/test_hooked.py``):

* ``ln*.hook_scale`` = ``sqrt(var(x) + eps)`` ``[batch, pos, 1]``; ``ln*.hook_normalized`` =
  ``(x - mean) / scale``, BEFORE the affine weight and bias (TL 4's bridge; TL 2's
  ``LayerNorm`` put ``w, b`` inside the hook). Editing either rebuilds the output as
  ``normalized * w + b`` (the bridge's reconstruction); unedited, the output is
  ``F.layer_norm``'s.
* ``attn.hook_attn_scores`` holds ``q.k^T * scaling`` with ``-inf`` above the diagonal (TL's
  convention; Hugging Face adds ``finfo.min`` there). After an edit of the scores the causal
  mask is applied again (TL feeds an edit straight to the softmax, so a value written above
  the diagonal would let a query see later keys: we keep the model causal). ``mean`` over
  positions of the scores is refused (the masked entries are ``-inf``).
* ``attn.hook_result`` ``[batch, pos, head, d_model]`` = ``z_h W_O^h`` without ``b_O``
  (``hook_attn_out = sum_h result_h + b_O``); computed only when cached, edited or
  differentiated (then, and only then, ``hook_attn_out`` is that sum, equal to the Conv1D's
  output to float rounding).
* ``blocks.{l}.hook_{q,k,v}_input`` ``[batch, pos, head, d_model]``: TL's
  ``use_split_qkv_input``: ``hook_resid_pre`` repeated per head; ln1 is applied to each
  head's copy and head ``h``'s q (k, v) is projected from its own copy, so one head's query,
  key or value input can be set alone (path patching, Wang et al. 2022). As in TL 4.3's
  bridge, ``ln1.hook_scale`` stays ``[batch, pos, 1]`` (the bridge applies ln1 to the copies
  without firing ln1's hooks; TL 2 fired them per head, ``[batch, pos, head, 1]``). Only the
  heads an edit touches are recomputed from their copy; the others keep the fused
  projection's value (equal to float rounding). An edit of ``ln1.*`` together with an
  edit of a split input in the same layer is refused (TL 2 and TL 4 disagree on it).
* ``hook_resid_mid`` edits the residual stream itself (HookedTransformer's meaning). TL 4.3's
  bridge aliases it to ``ln2.hook_in``, so there an edit reaches the MLP's input only.
* Cached values are the values that flow on: after the interventions at that hook.

Shapes carry the batch axis first, as TL's cache does. Only float tensors of the model's
dtype and device come back; they are fresh tensors (never views of the forward's buffers).
"""

from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Mapping, Sequence, Union

import torch
import torch.nn.functional as F

from ..errors import InvalidRequest, UnsupportedModelConfig
from .hooked_families import PartsShape

# --------------------------------------------------------------------------------------------
# The hook catalogue
# --------------------------------------------------------------------------------------------

#: internal site -> (TL name suffix, axes). Per-layer sites are ``blocks.{l}.<suffix>``; the
#: order is the forward's order (interventions at different hooks apply in this order).
LAYER_SITES: dict[str, tuple[str, tuple[str, ...]]] = {
    "resid_pre": ("hook_resid_pre", ("batch", "pos", "d_model")),
    "ln1_scale": ("ln1.hook_scale", ("batch", "pos", "1")),
    "ln1_normalized": ("ln1.hook_normalized", ("batch", "pos", "d_model")),
    "q_input": ("hook_q_input", ("batch", "pos", "head", "d_model")),
    "k_input": ("hook_k_input", ("batch", "pos", "head", "d_model")),
    "v_input": ("hook_v_input", ("batch", "pos", "head", "d_model")),
    "q": ("attn.hook_q", ("batch", "pos", "head", "d_head")),
    "k": ("attn.hook_k", ("batch", "pos", "head", "d_head")),
    "v": ("attn.hook_v", ("batch", "pos", "head", "d_head")),
    "scores": ("attn.hook_attn_scores", ("batch", "head", "query_pos", "key_pos")),
    "pattern": ("attn.hook_pattern", ("batch", "head", "query_pos", "key_pos")),
    "z": ("attn.hook_z", ("batch", "pos", "head", "d_head")),
    "result": ("attn.hook_result", ("batch", "pos", "head", "d_model")),
    "attn_out": ("hook_attn_out", ("batch", "pos", "d_model")),
    "resid_mid": ("hook_resid_mid", ("batch", "pos", "d_model")),
    "ln2_scale": ("ln2.hook_scale", ("batch", "pos", "1")),
    "ln2_normalized": ("ln2.hook_normalized", ("batch", "pos", "d_model")),
    "mlp_pre": ("mlp.hook_pre", ("batch", "pos", "d_mlp")),
    "mlp_post": ("mlp.hook_post", ("batch", "pos", "d_mlp")),
    "mlp_out": ("hook_mlp_out", ("batch", "pos", "d_model")),
    "resid_post": ("hook_resid_post", ("batch", "pos", "d_model")),
}
#: model-level sites: before the blocks (embed, pos_embed) and after them (ln_final)
GLOBAL_SITES: dict[str, tuple[str, tuple[str, ...]]] = {
    "embed": ("hook_embed", ("batch", "pos", "d_model")),
    "pos_embed": ("hook_pos_embed", ("batch", "pos", "d_model")),
    "lnf_scale": ("ln_final.hook_scale", ("batch", "pos", "1")),
    "lnf_normalized": ("ln_final.hook_normalized", ("batch", "pos", "d_model")),
}
#: the site -> TL name map the forward reads (a test plants a wrong copy of it)
TL_NAMES: dict[str, str] = {s: v[0] for s, v in {**LAYER_SITES, **GLOBAL_SITES}.items()}
_AXES = {s: v[1] for s, v in {**LAYER_SITES, **GLOBAL_SITES}.items()}
_VARIABLE_AXES = ("batch", "pos", "query_pos", "key_pos")
_SPLIT = ("q_input", "k_input", "v_input")


@dataclass(frozen=True)
class HookPoint:
    """One hook point of the resident model (an entry of ``GET /v1/hooks``).

    ``axes``: named axes (TL's), e.g. ``("batch", "pos", "head", "d_head")``; ``sizes``: the
    size of each axis, ``None`` for those set by the request (batch, pos, query_pos,
    key_pos); ``layer``: the block, ``None`` for model-level hooks."""

    name: str
    axes: tuple[str, ...]
    sizes: tuple[int | None, ...]
    layer: int | None
    site: str

    def shape(self, batch: int, pos: int) -> tuple[int, ...]:
        """The concrete shape for ``batch`` prompts of ``pos`` tokens."""
        return tuple(batch if a == "batch" else pos if a in _VARIABLE_AXES[1:] else s
                     for a, s in zip(self.axes, self.sizes))

    @property
    def head_axis(self) -> int | None:
        return self.axes.index("head") if "head" in self.axes else None

    @property
    def pos_axis(self) -> int:
        """The position axis a position selection applies to (query_pos for patterns)."""
        return self.axes.index("query_pos") if "query_pos" in self.axes else 1


# --------------------------------------------------------------------------------------------
# The model's parts
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    """One GPT-2 block's tensors (Conv1D weights stored ``[in, out]``)."""

    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    attn_w: torch.Tensor  # [d_model, 3 d_model], columns q | k | v (head-major inside each)
    attn_b: torch.Tensor
    proj_w: torch.Tensor  # [d_model (= head d_head), d_model]
    proj_b: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    fc_w: torch.Tensor  # [d_model, d_mlp]
    fc_b: torch.Tensor
    out_w: torch.Tensor  # [d_mlp, d_model]
    out_b: torch.Tensor
    scaling: float  # q.k multiplier: 1/sqrt(d_head) if scale_attn_weights, / (layer+1) if ...


@dataclass(frozen=True)
class GPT2Parts(PartsShape):
    """A GPT-2 LM's parameter tensors (detached views of the CURRENT parameters, no copies) and
    config values, plus the site -> TL name map. Build with :func:`gpt2_parts`."""

    wte: torch.Tensor  # [vocab, d_model]
    wpe: torch.Tensor  # [n_ctx, d_model]
    blocks: tuple[Block, ...]
    lnf_w: torch.Tensor
    lnf_b: torch.Tensor
    unembed: torch.Tensor  # lm_head.weight [vocab, d_model] (tied to wte in GPT-2)
    n_heads: int
    d_head: int
    d_mlp: int
    eps: float
    act: object  # transformers.activations.ACT2FN[config.activation_function]
    names: Mapping[str, str] = field(default_factory=lambda: dict(TL_NAMES))

    @property
    def n_ctx(self) -> int:
        return self.wpe.shape[0]


def gpt2_parts(model) -> GPT2Parts:
    """The parts of a Hugging Face ``GPT2LMHeadModel`` (or an adapter holding one as ``.model``);
    for a Llama, Mistral, Qwen2, Gemma, Gemma 2 or GPT-NeoX causal LM, its
    :class:`.hooked_families.FamilyParts` (the name is kept for its callers; :func:`parts` is
    the same function).

    Raises :class:`UnsupportedModelConfig` (an ``InvalidRequest``) for another family, for
    ``reorder_and_upcast_attn`` (another attention kernel order, float32 upcast) and for
    cross-attention (and the family switches hooked_families.family_parts names)."""
    from transformers.activations import ACT2FN

    from . import hooked_families as HF

    hf = model if isinstance(model, torch.nn.Module) else getattr(model, "model", model)
    if getattr(getattr(hf, "config", None), "model_type", None) in HF.FAMILIES:
        return HF.family_parts(hf)
    model = getattr(model, "model", model) if not hasattr(model, "transformer") else model
    cfg = model.config
    if getattr(cfg, "model_type", None) != "gpt2" or not hasattr(model, "transformer") \
            or not hasattr(model, "lm_head"):
        raise UnsupportedModelConfig(
            f"the hooked forward supports GPT-2 LM checkpoints (model_type 'gpt2' with an LM "
            f"head) only; this model is {getattr(cfg, 'model_type', None)!r}", "model")
    for key in ("reorder_and_upcast_attn", "add_cross_attention"):
        if getattr(cfg, key, False):
            raise UnsupportedModelConfig(f"the hooked forward does not implement {key}=True",
                                         "model")
    tr = model.transformer
    H = cfg.n_head
    dh = cfg.n_embd // H

    def d(t):
        return t.detach()

    blocks = []
    for i, b in enumerate(tr.h):
        scaling = dh ** -0.5 if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            scaling /= float(i + 1)
        blocks.append(Block(
            d(b.ln_1.weight), d(b.ln_1.bias), d(b.attn.c_attn.weight), d(b.attn.c_attn.bias),
            d(b.attn.c_proj.weight), d(b.attn.c_proj.bias), d(b.ln_2.weight), d(b.ln_2.bias),
            d(b.mlp.c_fc.weight), d(b.mlp.c_fc.bias), d(b.mlp.c_proj.weight),
            d(b.mlp.c_proj.bias), float(scaling)))
    return GPT2Parts(d(tr.wte.weight), d(tr.wpe.weight), tuple(blocks), d(tr.ln_f.weight),
                     d(tr.ln_f.bias), d(model.lm_head.weight), H, dh,
                     blocks[0].fc_w.shape[1] if blocks else 4 * cfg.n_embd,
                     float(cfg.layer_norm_epsilon), ACT2FN[cfg.activation_function])


def _as_parts(x):
    """:class:`GPT2Parts` or :class:`.hooked_families.FamilyParts` of ``x`` (parts, a Hugging
    Face causal LM or an adapter holding one as ``.model``), by ``config.model_type``."""
    from . import hooked_families as HF

    return x if isinstance(x, (GPT2Parts, HF.FamilyParts)) else gpt2_parts(x)


def parts(model):
    """The hooked forward's parts of ``model`` (a Hugging Face GPT-2, Llama, Mistral, Qwen2,
    Gemma, Gemma 2 or GPT-NeoX causal LM, or an adapter holding one as ``.model``): detached
    views of its current parameters. Raises :class:`UnsupportedModelConfig` (422
    ``unsupported_model_config``) naming what the forward does not implement."""
    return _as_parts(model)


def _sites(p):
    """(per-layer sites in forward order, sites before the blocks, after them, axes, and
    the sites whose head axis is the key/value heads) of ``p``."""
    if isinstance(p, GPT2Parts):
        return tuple(LAYER_SITES), ("embed", "pos_embed"), ("lnf_scale", "lnf_normalized"), \
            _AXES, frozenset()
    from . import hooked_families as HF

    return p.layer_sites, ("embed", "rot_cos", "rot_sin"), ("lnf_scale", "lnf_normalized"), \
        HF.AXES, HF.KV_SITES


def embedding(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The residual stream entering block 0 ``[batch, pos, d_model]`` for ``input_ids``
    ``[batch, pos]`` (GPT-2: ``wte[ids] + wpe[pos]``; Gemma: ``wte[ids] * sqrt(d_model)``; the
    other rotary families ``wte[ids]``), as the forward computes it."""
    p = _as_parts(model)
    if isinstance(p, GPT2Parts):
        T = input_ids.shape[1]
        pos = torch.arange(T, device=input_ids.device).unsqueeze(0)
        return F.embedding(input_ids, p.wte) + F.embedding(pos, p.wpe)
    from . import hooked_families as HF

    return HF.embed(p, input_ids)


def normalized(model, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., d_model]`` normalised as the model's norms do before their weight (the
    value of ``ln*.hook_normalized``): LayerNorm (GPT-2, GPT-NeoX) ``(x - mean) / sqrt(var +
    eps)``; RMSNorm (Llama, Mistral, Qwen2, Gemma, Gemma 2) ``x * rsqrt(mean(x^2) + eps)`` in
    float32 (TL 4.3's bridge and HF's upcast)."""
    p = _as_parts(model)
    if getattr(p, "norm", "ln") == "ln":
        xc = x - x.mean(-1, keepdim=True)
        return xc / (xc.pow(2).mean(-1, keepdim=True) + p.eps).sqrt()
    xf = x.float() if x.dtype not in (torch.float32, torch.float64) else x
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + p.eps)


def _unembed(p, h: torch.Tensor) -> torch.Tensor:
    """``lm_head`` (``F.linear`` with its weight), then Gemma 2's final soft-cap
    ``tanh(logits / cap) * cap`` where the model has one."""
    logits = F.linear(h, p.unembed)
    cap = getattr(p, "final_softcap", None)
    if cap is not None:
        logits = logits / cap
        logits = torch.tanh(logits)
        logits = logits * cap
    return logits


def hook_points(model) -> list[HookPoint]:
    """Every hook point of ``model`` (:class:`GPT2Parts`, a ``GPT2LMHeadModel`` or an adapter) in
    forward order, with TL names, named axes and fixed sizes (``GET /v1/hooks``)."""
    p = _as_parts(model)
    layer_sites, before, after, axes_of, kv_sites = _sites(p)
    sizes = {"1": 1, "head": p.n_heads, "d_head": p.d_head, "d_model": p.d_model,
             "d_mlp": p.d_mlp, "d_rotary": getattr(p, "rotary_dim", None)}
    kv_sizes = dict(sizes, head=getattr(p, "n_kv_heads", p.n_heads))

    def hp(site, layer):
        axes = axes_of[site]
        name = p.names[site] if layer is None else f"blocks.{layer}.{p.names[site]}"
        sz = kv_sizes if site in kv_sites else sizes
        return HookPoint(name, axes, tuple(sz.get(a) for a in axes), layer, site)

    out = [hp(s, None) for s in before]
    for layer in range(p.n_layers):
        out += [hp(s, layer) for s in layer_sites]
    out += [hp(s, None) for s in after]
    return out


def _catalogue(p: GPT2Parts) -> dict[str, HookPoint]:
    cat = getattr(p, "_cat", None)
    if cat is None:
        cat = {h.name: h for h in hook_points(p)}
        object.__setattr__(p, "_cat", cat)  # frozen dataclass: a memo, not state
    return cat


def resolve(model, pattern: str, param: str = "hook") -> list[HookPoint]:
    """The hook points ``pattern`` names: an exact TL name, or an fnmatch pattern
    (``blocks.*.hook_resid_post``, ``blocks.[0-3].attn.hook_z``) matched against the whole
    catalogue. Raises ``InvalidRequest(param=param)`` naming the closest real names (difflib)
    when nothing matches, ``UnsupportedModelConfig`` naming the family where it is the reason
    (:func:`.hooked_families.absent_hook`: GPT-NeoX's ``hook_resid_mid``)."""
    cat = _catalogue(_as_parts(model))
    if not isinstance(pattern, str) or not pattern:
        raise InvalidRequest(f"{param}: a hook name is a non-empty string", param)
    if pattern in cat:
        return [cat[pattern]]
    if any(c in pattern for c in "*?["):
        hits = [h for n, h in cat.items() if fnmatch.fnmatchcase(n, pattern)]
        if hits:
            return hits
    p = _as_parts(model)
    if not isinstance(p, GPT2Parts):
        from . import hooked_families as HF

        why = HF.absent_hook(p, pattern)
        if why is not None:
            raise UnsupportedModelConfig(f"{param}: {why}", param)
    close = difflib.get_close_matches(pattern, list(cat), n=3, cutoff=0.4)
    hint = f"; closest: {', '.join(close)}" if close else ""
    raise InvalidRequest(f"{param}: no hook point is named {pattern!r}{hint} "
                         f"(GET /v1/hooks lists them)", param)


# --------------------------------------------------------------------------------------------
# Requests: cache selections, interventions, metrics, gradients
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class CacheSelect:
    """What to keep of a cached hook (every field optional; None = all). Axes are kept (a
    selection of one head gives a head axis of size 1). ``positions`` index the ``pos`` axis
    (``query_pos`` for patterns and scores); negative positions count from the end.
    ``layers`` filters the hooks a pattern matched (model-level hooks always pass)."""

    layers: Sequence[int] | None = None
    prompts: Sequence[int] | None = None
    heads: Sequence[int] | None = None
    positions: Sequence[int] | None = None


@dataclass(frozen=True, kw_only=True)
class Intervention:
    """Common fields: ``hook`` (a TL name or fnmatch pattern: applied at every match, in forward
    order), ``prompts`` (batch rows), ``heads`` (hooks with a head axis), ``positions`` (the
    pos axis; query_pos for patterns/scores; negative from the end). None = all."""

    hook: str
    prompts: Sequence[int] | None = None
    heads: Sequence[int] | None = None
    positions: Sequence[int] | None = None
    #: bool, one axis per leading axis of the hook (``[batch, pos]``, ``[batch, pos, head]``;
    #: ``[batch, head, query_pos]`` for scores and patterns), each of size 1 or the axis's: the
    #: edit applies where it is True (and inside the other selections), e.g. a batch of
    #: patching variants, row i editing its own head or position. None = everywhere.
    mask: torch.Tensor | None = None


@dataclass(frozen=True, kw_only=True)
class Zero(Intervention):
    """Set the selection to 0 (zero ablation)."""

    kind: Literal["zero"] = "zero"


@dataclass(frozen=True, kw_only=True)
class Scale(Intervention):
    """Multiply the selection by ``factor``."""

    factor: float
    kind: Literal["scale"] = "scale"


@dataclass(frozen=True, kw_only=True)
class Add(Intervention):
    """Add ``scale * vector`` to every selected vector (steering): ``vector`` ``[d]``, ``d`` the
    hook's last axis (d_model, d_head, d_mlp, key_pos, 1)."""

    vector: torch.Tensor
    scale: float = 1.0
    kind: Literal["add"] = "add"


@dataclass(frozen=True, kw_only=True)
class Mean(Intervention):
    """Mean ablation. Without ``reference``: the mean of the values arriving at the hook in this
    forward, ``over`` "pos" (each prompt's mean over its positions), "batch" (per position,
    over all prompts of the batch) or "batch_pos" (over both). With ``reference``: a
    precomputed mean (e.g. :func:`reference_means` over reference prompts), shaped as one
    prompt's hook value (``[pos, head, d_head]`` for hook_z) or without its pos axis
    (``[head, d_head]``); ``over`` is then ignored."""

    over: Literal["pos", "batch", "batch_pos"] = "batch_pos"
    reference: torch.Tensor | None = None
    kind: Literal["mean"] = "mean"


@dataclass(frozen=True, kw_only=True)
class Set(Intervention):
    """Replace the selection: from ``source_prompt`` (the same hook's value of that batch row in
    this forward, at the same positions and heads: activation patching in one call; the
    source row should not itself be edited upstream) or from ``value``, shaped as one
    prompt's selection (hook shape without batch, pos/head axes cut to the selection) or with
    a leading axis of the selected prompts. Exactly one of the two."""

    source_prompt: int | None = None
    value: torch.Tensor | None = None
    kind: Literal["set"] = "set"


AnyIntervention = Union[Zero, Scale, Add, Mean, Set]


@dataclass(frozen=True, kw_only=True)
class LogitDiff:
    """``logits[prompt, position, target] - logits[prompt, position, distractor]`` per term
    (``terms``: ``(prompt | None, position, target, distractor)``, prompt None = every
    prompt); ``value`` = mean over terms (TL / IOI convention, Wang et al. 2022) or sum."""

    terms: Sequence[tuple]
    reduce: Literal["mean", "sum"] = "mean"


@dataclass(frozen=True, kw_only=True)
class Prob:
    """Next-token probability of ``target`` at ``position`` (softmax of the logits, in [0, 1]);
    terms ``(prompt | None, position, target)``."""

    terms: Sequence[tuple]
    reduce: Literal["mean", "sum"] = "mean"


@dataclass(frozen=True, kw_only=True)
class LogProb:
    """Next-token log-probability (nats, <= 0); terms ``(prompt | None, position, target)``."""

    terms: Sequence[tuple]
    reduce: Literal["mean", "sum"] = "mean"


@dataclass(frozen=True, kw_only=True)
class Loss:
    """Next-token cross entropy (nats) at ``position``, the target being the prompt's own token
    at ``position + 1``; terms ``(prompt | None, position)``, ``position < pos - 1``."""

    terms: Sequence[tuple]
    reduce: Literal["mean", "sum"] = "mean"


@dataclass(frozen=True, kw_only=True)
class KL:
    """``KL(P_a || P_b)`` of the next-token distributions of two prompts at one position
    (nats, >= 0): ``sum_v P_a(v) (log P_a(v) - log P_b(v))``; terms ``(prompt_a, prompt_b,
    position)``."""

    terms: Sequence[tuple]
    reduce: Literal["mean", "sum"] = "mean"


AnyMetric = Union[LogitDiff, Prob, LogProb, Loss, KL]


@dataclass(frozen=True, kw_only=True)
class GradRequest:
    """The gradient of ``metric``'s ``value`` (a scalar) with respect to the hooks ``hooks``
    name (TL names or patterns), one backward; the gradient is with respect to the value that
    flows on from the hook (after its interventions)."""

    metric: AnyMetric
    hooks: Sequence[str]


@dataclass
class MetricValue:
    """``values`` ``[n_terms]`` (after prompt None is expanded, prompt-major) and ``value``
    (0-d: their mean or sum), float in the model's dtype."""

    values: torch.Tensor
    value: torch.Tensor


@dataclass
class RunResult:
    """``cache``: TL name -> tensor (TL shape with batch, cut to the selection);
    ``logits`` ``[batch, len(logit_positions), vocab]``; ``metrics``: name -> value;
    ``grads``: TL name -> gradient (the hook's full shape); ``grad_value``: the
    differentiated metric's value (None without ``grad``)."""

    cache: dict[str, torch.Tensor]
    logits: torch.Tensor
    logit_positions: list[int]
    metrics: dict[str, MetricValue]
    grads: dict[str, torch.Tensor]
    grad_value: torch.Tensor | None = None


# --------------------------------------------------------------------------------------------
# Resolution and validation (cheap, before any forward)
# --------------------------------------------------------------------------------------------

def _indices(values, size: int, what: str, param: str, allow_negative: bool, device):
    if values is None:
        return None
    if isinstance(values, (int, bool)) or not isinstance(values, Sequence):
        raise InvalidRequest(f"{param}: a list of {what} indices", param)
    out = []
    lo = -size if allow_negative else 0
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidRequest(f"{param}: {what} indices are integers, got {v!r}", param)
        if not lo <= v < size:
            rng = f"{lo}..{size - 1}" if size else "none"
            raise InvalidRequest(f"{param}: {what} {v} is out of range ({rng})", param)
        out.append(v % size)
    if not out:
        raise InvalidRequest(f"{param}: an empty list of {what}s (omit it to select all)", param)
    return torch.tensor(out, dtype=torch.long, device=device)


class _Sel:
    """A resolved (prompts, heads, positions) selection on one hook of one forward."""

    __slots__ = ("rows", "heads", "pos", "n_lead", "index", "hp")

    def __init__(self, hp: HookPoint, B: int, T: int, sel, param: str, device):
        self.hp = hp
        self.rows = _indices(sel.prompts, B, "prompt", f"{param}.prompts", False, device)
        if sel.heads is not None and hp.head_axis is None:
            raise InvalidRequest(f"{param}.heads: {hp.name} has no head axis "
                                 f"(axes {list(hp.axes)})", f"{param}.heads")
        H = hp.sizes[hp.head_axis] if hp.head_axis is not None else 0
        self.heads = _indices(sel.heads, H, "head", f"{param}.heads", False, device)
        self.pos = _indices(sel.positions, T, "position", f"{param}.positions", True, device)
        self.n_lead = 3 if hp.head_axis is not None else 2
        if self.rows is None and self.heads is None and self.pos is None:
            self.index = None
        else:
            shape = hp.shape(B, T)
            per_axis = [None] * self.n_lead
            per_axis[0] = self.rows
            per_axis[hp.pos_axis] = self.pos
            if hp.head_axis is not None:
                per_axis[hp.head_axis] = self.heads
            idx = []
            for a, t in enumerate(per_axis):
                t = torch.arange(shape[a], device=device) if t is None else t
                view = [1] * self.n_lead
                view[a] = -1
                idx.append(t.view(view))
            self.index = tuple(idx)

    def region_shape(self, B: int, T: int) -> tuple[int, ...]:
        shape = list(self.hp.shape(B, T))
        if self.rows is not None:
            shape[0] = len(self.rows)
        if self.pos is not None:
            shape[self.hp.pos_axis] = len(self.pos)
        if self.heads is not None:
            shape[self.hp.head_axis] = len(self.heads)
        return tuple(shape)

    def key(self):
        return tuple(None if t is None else tuple(t.tolist()) for t in (self.rows, self.heads,
                                                                         self.pos))

    def take(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone() if self.index is None else x[self.index]


class _Edit:
    __slots__ = ("iv", "sel", "payload", "param", "mask")

    def __init__(self, iv, sel: _Sel, payload, param: str, mask=None):
        self.iv, self.sel, self.payload, self.param = iv, sel, payload, param
        self.mask = mask  # None, or bool of x.ndim axes (trailing ones of size 1)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.mask is None:
            return self._apply(x, False)
        return torch.where(self.mask, self._apply(x, True), x)

    def _apply(self, x: torch.Tensor, masked: bool) -> torch.Tensor:
        """The edited tensor; ``masked``: the caller selects from it with ``torch.where``
        (no fresh copy needed when the selection is everything)."""
        iv, sel = self.iv, self.sel
        region = x if sel.index is None else x[sel.index]
        kind = iv.kind
        if kind == "zero":
            new = torch.zeros_like(region)
        elif kind == "scale":
            new = region * iv.factor
        elif kind == "add":
            new = region + self.payload
        elif kind == "mean":
            if self.payload is not None:  # reference [pos, ...] or [...]: broadcast to x
                full = self.payload.expand_as(x[0]).unsqueeze(0).expand_as(x)
            else:
                dims = {"pos": (sel.hp.pos_axis,), "batch": (0,),
                        "batch_pos": (0, sel.hp.pos_axis)}[iv.over]
                full = x.mean(dim=dims, keepdim=True).expand_as(x)
            new = full if sel.index is None else full[sel.index]
        elif self.payload is not None:  # set from a tensor (already region-shaped)
            new = self.payload.expand_as(region)
        else:  # set from a prompt of the batch
            s = iv.source_prompt
            full = x[s:s + 1].expand_as(x)
            new = full if sel.index is None else full[sel.index]
        if sel.index is None:  # a fresh tensor (an expanded view would not .view() later)
            if masked:
                return new.to(x.dtype)
            return new.to(x.dtype).contiguous() if new.data_ptr() != x.data_ptr() \
                else new.to(x.dtype).clone(memory_format=torch.contiguous_format)
        x = x.clone()
        x[sel.index] = new.to(x.dtype)
        return x


class _Site:
    """What one forward does at one hook point."""

    __slots__ = ("hp", "edits", "cache", "grad")

    def __init__(self, hp: HookPoint):
        self.hp = hp
        self.edits: list[_Edit] = []
        self.cache: _Sel | None = None
        self.grad = False

    def heads_touched(self, H: int) -> list[int]:
        hs = set()
        for e in self.edits:
            if e.sel.heads is None:
                return list(range(H))
            hs.update(e.sel.heads.tolist())
        return sorted(hs)


def _tensor(t, param: str, p: GPT2Parts) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        try:
            t = torch.as_tensor(t)
        except Exception:
            raise InvalidRequest(f"{param}: a numeric tensor is needed", param) from None
    if not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
        raise InvalidRequest(f"{param}: a numeric tensor is needed, got {t.dtype}", param)
    t = t.to(device=p.device, dtype=p.dtype)
    if not torch.isfinite(t).all():
        raise InvalidRequest(f"{param}: the tensor holds NaN or infinite values", param)
    return t


def _payload(iv, sel: _Sel, B: int, T: int, p: GPT2Parts, param: str):
    kind = getattr(iv, "kind", None)
    hp = sel.hp
    if kind == "zero":
        return None
    if kind == "scale":
        if not isinstance(iv.factor, (int, float)) or not torch.isfinite(
                torch.tensor(float(iv.factor))):
            raise InvalidRequest(f"{param}.factor: a finite number", f"{param}.factor")
        return None
    if kind == "add":
        d = hp.shape(B, T)[-1]
        v = _tensor(iv.vector, f"{param}.vector", p)
        if tuple(v.shape) != (d,):
            raise InvalidRequest(f"{param}.vector: shape {list(v.shape)} given, {hp.name} needs "
                                 f"[{d}] (its last axis, {hp.axes[-1]})", f"{param}.vector")
        return v * float(iv.scale)
    if kind == "mean":
        if iv.reference is None:
            if iv.over not in ("pos", "batch", "batch_pos"):
                raise InvalidRequest(f"{param}.over: 'pos', 'batch' or 'batch_pos', got "
                                     f"{iv.over!r}", f"{param}.over")
            if hp.site == "scores" and "pos" in iv.over:
                raise InvalidRequest(f"{param}.over: a mean over positions of {hp.name} is "
                                     "undefined (its masked entries are -inf)", f"{param}.over")
            return None
        r = _tensor(iv.reference, f"{param}.reference", p)
        one = hp.shape(B, T)[1:]
        no_pos = tuple(s for a, s in enumerate(one) if a + 1 != hp.pos_axis)
        if tuple(r.shape) == one:
            return r
        if tuple(r.shape) == no_pos:
            return r.unsqueeze(hp.pos_axis - 1)
        raise InvalidRequest(f"{param}.reference: shape {list(r.shape)} given, {hp.name} needs "
                             f"{list(one)} or {list(no_pos)} (without {hp.axes[hp.pos_axis]})",
                             f"{param}.reference")
    if kind == "set":
        if (iv.source_prompt is None) == (iv.value is None):
            raise InvalidRequest(f"{param}: give exactly one of source_prompt and value", param)
        if iv.source_prompt is not None:
            s = iv.source_prompt
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < B:
                raise InvalidRequest(f"{param}.source_prompt: prompt {s!r} is out of range "
                                     f"(0..{B - 1}: {B} prompt{'s' if B != 1 else ''})",
                                     f"{param}.source_prompt")
            return None
        v = _tensor(iv.value, f"{param}.value", p)
        region = sel.region_shape(B, T)
        if tuple(v.shape) == region[1:]:
            return v.unsqueeze(0)
        if tuple(v.shape) == region:
            return v
        raise InvalidRequest(f"{param}.value: shape {list(v.shape)} given, {hp.name} after the "
                             f"selection needs {list(region[1:])} (or {list(region)} with the "
                             f"selected prompts first)", f"{param}.value")
    raise InvalidRequest(f"{param}: unknown intervention kind {kind!r} (zero, mean, set, add, "
                         f"scale)", param)


def _mask(iv, hp: HookPoint, B: int, T: int, param: str, device) -> torch.Tensor | None:
    """``iv.mask`` checked against the hook's leading axes and shaped for ``torch.where``."""
    m = getattr(iv, "mask", None)
    if m is None:
        return None
    if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
        raise InvalidRequest(f"{param}.mask: a bool tensor", f"{param}.mask")
    shape = hp.shape(B, T)
    n_lead = 3 if hp.head_axis is not None else 2
    lead = shape[:n_lead]
    if m.dim() != n_lead or any(a not in (1, b) for a, b in zip(m.shape, lead)):
        raise InvalidRequest(f"{param}.mask: shape {list(m.shape)} given, {hp.name} needs "
                             f"{n_lead} axes ({', '.join(hp.axes[:n_lead])}), each of size 1 or "
                             f"{list(lead)}", f"{param}.mask")
    return m.to(device).view(*m.shape, *([1] * (len(shape) - n_lead)))


_TERM_ARITY = {LogitDiff: 4, Prob: 3, LogProb: 3, Loss: 2, KL: 3}


def _check_metric(m, B: int, T: int, V: int, param: str) -> list[tuple]:
    """Expanded, normalised terms of metric ``m`` (positions non-negative)."""
    n = _TERM_ARITY.get(type(m))
    if n is None:
        raise InvalidRequest(f"{param}: unknown metric {type(m).__name__} (LogitDiff, Prob, "
                             f"LogProb, Loss, KL)", param)
    if m.reduce not in ("mean", "sum"):
        raise InvalidRequest(f"{param}.reduce: 'mean' or 'sum', got {m.reduce!r}",
                             f"{param}.reduce")
    if not m.terms:
        raise InvalidRequest(f"{param}.terms: at least one term", f"{param}.terms")
    out = []

    def rng(v, lo, hi, what, tp):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v < hi:
            raise InvalidRequest(f"{tp}: {what} {v!r} is out of range ({lo}..{hi - 1})", tp)
        return v

    for i, t in enumerate(m.terms):
        tp = f"{param}.terms[{i}]"
        if not isinstance(t, Sequence) or len(t) != n:
            raise InvalidRequest(f"{tp}: {type(m).__name__} terms have {n} fields", tp)
        if isinstance(m, KL):
            a, b, pos = t
            out.append((rng(a, 0, B, "prompt", tp), rng(b, 0, B, "prompt", tp),
                        rng(pos, -T, T, "position", tp) % T))
            continue
        prompts = range(B) if t[0] is None else [rng(t[0], 0, B, "prompt", tp)]
        pos = rng(t[1], -T, T, "position", tp) % T
        if isinstance(m, Loss) and pos >= T - 1:
            raise InvalidRequest(f"{tp}: position {t[1]} has no next token (the loss at a "
                                 f"position predicts position + 1; last is {T - 2})", tp)
        toks = tuple(rng(v, 0, V, "token id", tp) for v in t[2:])
        out += [(pr, pos) + toks for pr in prompts]
    return out


def _metric(m, terms: list[tuple], logits_at, ids: torch.Tensor) -> MetricValue:
    """``logits_at(prompt_idx [n], pos_idx [n]) -> [n, vocab]``."""
    dev = ids.device
    col = [torch.tensor(c, dtype=torch.long, device=dev) for c in zip(*terms)]
    if isinstance(m, KL):
        la = torch.log_softmax(logits_at(col[0], col[2]), -1)
        lb = torch.log_softmax(logits_at(col[1], col[2]), -1)
        # >= 0 in exact arithmetic; float32 rounding across batch rows left -1e-9 for two
        # equal prompts (a breaker's finding): clamped, as the schema promises
        vals = (la.exp() * (la - lb)).sum(-1).clamp(min=0)
    else:
        lg = logits_at(col[0], col[1])
        n = torch.arange(len(terms), device=dev)
        if isinstance(m, LogitDiff):
            vals = lg[n, col[2]] - lg[n, col[3]]
        elif isinstance(m, Loss):
            vals = -torch.log_softmax(lg, -1)[n, ids[col[0], col[1] + 1]]
        else:
            lp = torch.log_softmax(lg, -1)[n, col[2]]
            vals = lp.exp() if isinstance(m, Prob) else lp
    return MetricValue(vals, vals.mean() if m.reduce == "mean" else vals.sum())


class _Plan:
    def __init__(self):
        self.sites: dict[tuple[int | None, str], _Site] = {}
        self.layers: list[dict[str, _Site]] = []
        self.glob: dict[str, _Site] = {}

    def site(self, hp: HookPoint) -> _Site:
        k = (hp.layer, hp.site)
        if k not in self.sites:
            self.sites[k] = _Site(hp)
        return self.sites[k]


def _plan(p: GPT2Parts, B: int, T: int, cache, interventions, grad) -> _Plan:
    plan = _Plan()
    dev = p.device
    for key, sel in (cache or {}).items():
        param = f"cache[{key!r}]"
        sel = CacheSelect() if sel is None else sel
        if not isinstance(sel, CacheSelect):
            raise InvalidRequest(f"{param}: a CacheSelect or None", param)
        hits = resolve(p, key, param)
        if sel.layers is not None:
            _indices(sel.layers, p.n_layers, "layer", f"{param}.layers", False, dev)
            keep = set(sel.layers)
            hits = [h for h in hits if h.layer is None or h.layer in keep]
            if not hits:
                raise InvalidRequest(f"{param}.layers: no hook of {key!r} is in layers "
                                     f"{sorted(keep)}", f"{param}.layers")
        for hp in hits:
            s = _Sel(hp, B, T, sel, param, dev)
            site = plan.site(hp)
            if site.cache is not None and site.cache.key() != s.key():
                raise InvalidRequest(f"{param}: {hp.name} is cached twice with different "
                                     "selections", param)
            site.cache = s
    for i, iv in enumerate(interventions or ()):
        param = f"interventions[{i}]"
        if not isinstance(iv, Intervention):
            raise InvalidRequest(f"{param}: an intervention (Zero, Mean, Set, Add, Scale)", param)
        for hp in resolve(p, iv.hook, f"{param}.hook"):
            s = _Sel(hp, B, T, iv, param, dev)
            plan.site(hp).edits.append(_Edit(iv, s, _payload(iv, s, B, T, p, param), param,
                                             _mask(iv, hp, B, T, param, dev)))
    if grad is not None:
        for j, name in enumerate(grad.hooks):
            for hp in resolve(p, name, f"grad.hooks[{j}]"):
                plan.site(hp).grad = True
    plan.layers = [dict() for _ in range(p.n_layers)]
    for (layer, site), s in plan.sites.items():
        (plan.glob if layer is None else plan.layers[layer])[site] = s
    for layer, d in enumerate(plan.layers):
        # a gradient at ln1 is as off the rerouted heads' path as an edit there
        ln1_edit = [s for k, s in d.items() if k.startswith("ln1") and (s.edits or s.grad)]
        split_edit = [s for k, s in d.items() if k in _SPLIT and (s.edits or s.grad)]
        if ln1_edit and split_edit:
            where = ("interventions" if ln1_edit[0].edits or split_edit[0].edits
                     else "grad.hooks")
            raise InvalidRequest(
                f"{where}: {ln1_edit[0].hp.name} and {split_edit[0].hp.name} cannot both "
                "be edited or differentiated in one forward (the split inputs are normalised "
                "per head from hook_resid_pre, apart from ln1's hooks)", where)
    return plan


# --------------------------------------------------------------------------------------------
# The forward
# --------------------------------------------------------------------------------------------

class _Run:
    """One forward's state: the plan, what it keeps, the gradient inputs."""

    def __init__(self, plan: _Plan, grad: bool, keep=None, into=None):
        self.plan = plan
        self.out: dict[str, Any] = {}
        self.grad_inputs: dict[str, torch.Tensor] = {}
        self.grad = grad
        self.keep = keep
        self.into: Mapping[str, Any] = into or {}
        self._scores: torch.Tensor | None = None  # with ``into``: every layer's scores buffer
        #: a recorded forward (:func:`record`): kind -> per-layer targets of tensors that are
        #: no TL hook (the attention's input, q/k/v as recorded, the output projection's)
        self.rec: Mapping[str, Sequence] | None = None
        self.layer = 0  # the block running (set by the forward loops)

    def record(self, kind: str, x: torch.Tensor) -> None:
        """A recorded forward: ``x`` ``[batch, ...]`` copied into this layer's target of
        ``kind`` (:func:`record`'s ``layers_into``); nothing otherwise."""
        t = self.rec.get(kind) if self.rec else None
        if t is not None:
            _put(t[self.layer], x)

    def target(self, site: _Site | None, like: torch.Tensor) -> torch.Tensor | None:
        """``into``'s tensor of ``site`` when the forward may compute the hook's value
        straight into it (unedited, no gradient, ``like``'s shape, dtype and device)."""
        t = None if site is None or site.edits or site.grad else self.into.get(site.hp.name)
        if not isinstance(t, torch.Tensor) or t.shape != like.shape or t.dtype != like.dtype \
                or t.device != like.device or not t.is_contiguous():
            return None
        return t

    def scores(self, site: _Site | None, q: torch.Tensor, k: torch.Tensor, scaling: float,
               mask: torch.Tensor, softcap: float | None = None) -> torch.Tensor | None:
        """With ``into`` (a recorded forward) and no scores hook: ``q.k^T * scaling``
        (``c * tanh(s / c)`` with a soft-cap) ``+ mask`` in ONE buffer every layer reuses, the
        same kernels in place (bit for bit); else None (the caller's out-of-place code). At
        T = 1024 on GPT-2-small shapes each fresh [head, query_pos, key_pos] tensor is 50 MB
        faulted in afresh, three per layer."""
        if not self.into or site is not None or self.grad or q.requires_grad:
            return None
        shape = (*q.shape[:-1], k.shape[-2])
        buf = self._scores
        if buf is None or buf.shape != shape or buf.dtype != q.dtype or buf.device != q.device:
            buf = self._scores = torch.empty(shape, dtype=q.dtype, device=q.device)
        torch.matmul(q, k.transpose(-1, -2), out=buf)
        buf.mul_(scaling)
        if softcap is not None:
            buf.div_(softcap).tanh_().mul_(softcap)
        return buf.add_(mask)

    def at(self, site: _Site, x: torch.Tensor, tl_view=None) -> torch.Tensor:
        """Apply ``site``'s edits in order, register it for the gradient, keep its cache
        (a hook of ``into``: copied there, or already computed there)."""
        for e in site.edits:
            x = e.apply(x)
        if site.grad:
            if not x.requires_grad:  # nothing upstream needs a gradient: a leaf here
                x = x.detach().requires_grad_(True)
            self.grad_inputs[site.hp.name] = x
        t = self.into.get(site.hp.name) if site.cache is not None else None
        if t is not None:
            if t is not x:
                _put(t, (x if tl_view is None else tl_view(x)).detach())
            self.out[site.hp.name] = t
            return x
        if site.cache is not None:
            v = site.cache.take(x if tl_view is None else tl_view(x))
            if self.keep is not None:  # e.g. the wire form: the clone is freed right here
                v = self.keep(site.hp.name, v.detach())
            self.out[site.hp.name] = v
        return x


def _put(target, x: torch.Tensor) -> None:
    """Copy ``x`` ``[batch, ...]`` into ``target``: one tensor of its shape, or a list of one
    tensor per batch row (texts of one length forwarded together, each into its own buffer)."""
    if isinstance(target, torch.Tensor):
        target.copy_(x)
    else:
        for b, t in enumerate(target):
            t.copy_(x[b])


def _conv1d(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """transformers' ``Conv1D.forward``: ``addmm(b, x.view(-1, nx), w)``, same kernel."""
    return torch.addmm(b, x.view(-1, x.size(-1)), w).view(x.size()[:-1] + (w.shape[1],))


def _ln(r: _Run, sites: dict, pre: str, x: torch.Tensor, w, b, eps: float) -> torch.Tensor:
    """LayerNorm with TL's ``hook_scale`` / ``hook_normalized`` (pre-affine, TL 4.3 bridge)."""
    s_scale, s_norm = sites.get(pre + "_scale"), sites.get(pre + "_normalized")
    if s_scale is None and s_norm is None:
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    xc = x - x.mean(-1, keepdim=True)
    scale = (xc.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    edited = False
    if s_scale is not None:
        new = r.at(s_scale, scale)
        edited |= new is not scale or s_scale.grad
        scale = new
    norm = xc / scale
    if s_norm is not None:
        new = r.at(s_norm, norm)
        edited |= new is not norm or s_norm.grad
        norm = new
    if edited:
        return norm * w + b
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def _block(p: GPT2Parts, blk: Block, r: _Run, sites: dict, x: torch.Tensor,
           mask: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    B, T, D = x.shape
    H, dh = p.n_heads, p.d_head
    get = sites.get
    if (s := get("resid_pre")) is not None:
        x = r.at(s, x)
    h = _ln(r, sites, "ln1", x, blk.ln1_w, blk.ln1_b, p.eps)
    if r.rec:
        r.record("attn_input", h)
    # 1. q, k, v: one fused Conv1D, split, [batch, pos, head, d_head] views (HF's order)
    qkv = _conv1d(h, blk.attn_w, blk.attn_b)
    if r.rec:
        r.record("qkv", qkv)
    qkv4 = [t.view(B, T, H, dh) for t in qkv.split(D, dim=2)]
    for i, name in enumerate(_SPLIT):
        s = get(name)
        if s is None:
            continue
        rep = x.unsqueeze(2).expand(B, T, H, D)
        rep = r.at(s, rep.contiguous() if s.grad else rep)
        heads = list(range(H)) if s.grad else s.heads_touched(H)
        if heads:  # those heads' q (k, v) from their own copy: ln1 per head, their W columns
            hi = torch.tensor(heads, device=x.device)
            hn = F.layer_norm(rep.index_select(2, hi), (D,), blk.ln1_w, blk.ln1_b, p.eps)
            w = blk.attn_w[:, i * D:(i + 1) * D].view(D, H, dh).index_select(1, hi)
            bias = blk.attn_b[i * D:(i + 1) * D].view(H, dh).index_select(0, hi)
            new = torch.einsum("bthd,dhe->bthe", hn, w) + bias
            if len(heads) == H:
                qkv4[i] = new
            else:
                full = qkv4[i].clone()
                full[:, :, hi] = new
                qkv4[i] = full
    for i, name in enumerate(("q", "k", "v")):
        if (s := get(name)) is not None:
            qkv4[i] = r.at(s, qkv4[i])
    q, k, v = (t.transpose(1, 2) for t in qkv4)  # [batch, head, pos, d_head]
    # 2. scores = q.k^T * scaling + mask (finfo.min above the diagonal), [b, head, q, k]
    scores = r.scores(get("scores"), q, k, blk.scaling, mask)
    if scores is None:
        scores = torch.matmul(q, k.transpose(-1, -2)) * blk.scaling
        scores = scores + mask
    if (s := get("scores")) is not None:
        new = r.at(s, scores, tl_view=lambda t: t.masked_fill(masked, float("-inf")))
        if s.edits:  # keep the model causal after an edit
            new = new.masked_fill(masked, torch.finfo(new.dtype).min)
        scores = new
    # 3. pattern = softmax in the dtype; z = pattern @ v, [batch, pos, head, d_head]
    pattern = torch.softmax(scores, dim=-1, out=r.target(get("pattern"), scores)).type(v.dtype)
    if (s := get("pattern")) is not None:
        pattern = r.at(s, pattern)
    z = torch.matmul(pattern, v).transpose(1, 2)
    if (s := get("z")) is not None:
        z = r.at(s, z)
    # 4. output projection; per head (hook_result, without b_O) only when asked
    if (s := get("result")) is not None:
        res = torch.einsum("bthe,hed->bthd", z, blk.proj_w.view(H, dh, D))
        new = r.at(s, res)
        if new is not res or s.grad:
            attn = new.sum(2) + blk.proj_b
        else:
            attn = _conv1d(z.reshape(B, T, D).contiguous(), blk.proj_w, blk.proj_b)
    else:
        attn = _conv1d(z.reshape(B, T, D).contiguous(), blk.proj_w, blk.proj_b)
    if r.rec:
        r.record("attn_output", attn)
    if (s := get("attn_out")) is not None:
        attn = r.at(s, attn)
    x = attn + x
    if (s := get("resid_mid")) is not None:
        x = r.at(s, x)
    h = _ln(r, sites, "ln2", x, blk.ln2_w, blk.ln2_b, p.eps)
    # 5. MLP: Conv1D, activation, Conv1D
    pre = _conv1d(h, blk.fc_w, blk.fc_b)
    if (s := get("mlp_pre")) is not None:
        pre = r.at(s, pre)
    post = p.act(pre)
    if (s := get("mlp_post")) is not None:
        post = r.at(s, post)
    mlp = _conv1d(post, blk.out_w, blk.out_b)
    if (s := get("mlp_out")) is not None:
        mlp = r.at(s, mlp)
    x = x + mlp
    if (s := get("resid_post")) is not None:
        x = r.at(s, x)
    return x


def _check_ids(p: GPT2Parts, input_ids) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        try:
            input_ids = torch.as_tensor(input_ids)
        except Exception:
            raise InvalidRequest("input_ids: a [batch, pos] array of token ids",
                                 "input_ids") from None
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32) \
            or 0 in input_ids.shape:
        raise InvalidRequest(f"input_ids: a non-empty [batch, pos] integer array (equal "
                             f"lengths), got shape {list(input_ids.shape)} {input_ids.dtype}",
                             "input_ids")
    T = input_ids.shape[1]
    if T > p.n_ctx:
        raise InvalidRequest(f"input_ids: {T} tokens, the model's context is {p.n_ctx}",
                             "input_ids")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= p.d_vocab:
        raise InvalidRequest(f"input_ids: token id {lo if lo < 0 else hi} is out of range "
                             f"(0..{p.d_vocab - 1})", "input_ids")
    return input_ids.to(device=p.device, dtype=torch.long)


def run(model, input_ids, *, cache: Mapping[str, CacheSelect | None] | None = None,
        interventions: Sequence[AnyIntervention] = (),
        logit_positions: Sequence[int] | None = None,
        metrics: Mapping[str, AnyMetric] | None = None,
        grad: GradRequest | None = None,
        start: int = 0, resid_pre: torch.Tensor | None = None,
        keep: Callable[[str, torch.Tensor], Any] | None = None) -> RunResult:
    """One hooked forward of ``input_ids`` ``[batch, pos]`` (int64, equal lengths, no padding)
    on ``model`` (:class:`GPT2Parts` / :class:`.hooked_families.FamilyParts`, or a Hugging Face
    GPT-2, Llama, Mistral, Qwen2, Gemma, Gemma 2 or GPT-NeoX causal LM, or an adapter).

    ``cache``: hook name or fnmatch pattern -> :class:`CacheSelect` (or None: all of it);
    ``interventions``: applied in list order at their hook (different hooks in forward order);
    ``logit_positions``: the positions whose logits come back (None: all, the full
    ``[batch, pos, vocab]`` computed as Hugging Face does; negatives from the end);
    ``metrics``: name -> metric, from the (edited) logits; ``grad``: one metric's gradient with
    respect to hooks (one backward, ``torch.enable_grad``; otherwise the forward runs under
    ``torch.inference_mode``). Everything is validated before the forward; errors are
    :class:`InvalidRequest` with ``param`` naming the field (``input_ids``,
    ``cache['<key>'].heads``, ``interventions[2].value``, ``metrics['ld'].terms[0]``,
    ``grad.hooks[1]``, ...).

    ``start`` and ``resid_pre``: begin at block ``start`` with ``resid_pre`` ``[batch | 1, pos,
    d_model]`` (the model's dtype) as the residual stream entering it, i.e. the value of
    ``blocks.{start}.hook_resid_pre`` before its interventions (e.g. a recorded forward's
    ``hidden_states[start]``, whose layers below are then not run again: patching grids start
    each batch of variants at the layer its edit is in). The embeddings and blocks below
    ``start`` do not run, so none of their hooks may be cached, edited or differentiated;
    ``input_ids`` still give the batch, the length and the metrics' next tokens. ``start =
    n_layers``: ln_f and the unembedding only.

    ``keep(name, value)``: called with each cached value (detached, TL shape, cut to the
    selection) as soon as its hook has run; what it returns is stored in ``cache[name]``
    instead (e.g. the value's wire form, so the forward never holds every cached tensor in
    the model's dtype next to its encoded copy). Exceptions it raises end the run."""
    p = _as_parts(model)
    ids = _check_ids(p, input_ids)
    B, T = ids.shape
    plan = _plan(p, B, T, cache, interventions, grad)
    resid_pre = _check_start(p, plan, B, T, start, resid_pre)
    lpos = None if logit_positions is None else _indices(
        list(logit_positions), T, "position", "logit_positions", True, p.device)
    checked = {}
    for name, m in (metrics or {}).items():
        checked[name] = _check_metric(m, B, T, p.d_vocab, f"metrics[{name!r}]")
    gterms = None if grad is None else _check_metric(grad.metric, B, T, p.d_vocab,
                                                     "grad.metric")
    if grad is not None and not grad.hooks:
        raise InvalidRequest("grad.hooks: at least one hook", "grad.hooks")
    ctx = torch.enable_grad() if grad is not None else torch.inference_mode()
    with ctx:
        r = _Run(plan, grad is not None, keep)
        x, h_final = _forward(p, r, ids, plan, start, resid_pre)
        if lpos is None:
            logits = _unembed(p, h_final)  # [batch, pos, vocab], HF's lm_head
            logits_at = lambda rows, pos: logits[rows, pos]  # noqa: E731
            out_logits = logits
            positions = list(range(T))
        else:
            out_logits = _unembed(p, h_final[:, lpos])
            positions = lpos.tolist()

            def logits_at(rows, pos):
                return _unembed(p, h_final[rows, pos])
        results = {n: _metric(m, checked[n], logits_at, ids) for n, m in (metrics or {}).items()}
        grads, gval = {}, None
        if grad is not None:
            mv = _metric(grad.metric, gterms, logits_at, ids)
            gval = mv.value.detach()
            names = list(r.grad_inputs)
            gs = torch.autograd.grad(mv.value, [r.grad_inputs[n] for n in names],
                                     allow_unused=True)
            grads = {n: torch.zeros_like(r.grad_inputs[n]) if g is None else g
                     for n, g in zip(names, gs)}
            detach = lambda t: t.detach()  # noqa: E731
            out_logits = detach(out_logits)
            results = {n: MetricValue(v.values.detach(), v.value.detach())
                       for n, v in results.items()}
            r.out = {n: detach(t) if isinstance(t, torch.Tensor) else t
                     for n, t in r.out.items()}
    return RunResult(r.out, out_logits, positions, results, grads, gval)


def record(model, input_ids, into: Mapping[str, Any],
           layers_into: Mapping[str, Sequence] | None = None, final_into=None) -> None:
    """The recorded forward (``Runtime._forward_batch`` of a causal LM): one unedited hooked
    forward of ``input_ids`` ``[batch, pos]`` (equal lengths, no padding: the runtime forwards
    each length group apart) whose values are written into given buffers as they are
    computed; nothing is returned, no logits are computed (the LM head does not run).

    ``into``: TL hook name -> target, a tensor of the hook's shape (``[1, ...]`` for one
    prompt; e.g. ``blocks.{l}.attn.hook_pattern`` ``[1, head, query_pos, key_pos]``, which the
    softmax then writes straight into, and every layer's pre-softmax scores share one
    buffer: :class:`_Run`) or a list of one tensor per prompt (copied row by row).
    ``layers_into``: kind -> per-layer targets (same forms) of values that are no TL hook:
    ``attn_input`` (what the attention module receives: ln1's output ``[batch, pos,
    d_model]``), ``attn_output`` (the output projection's, before Gemma 2's post-attention
    norm), GPT-2 ``qkv`` (``c_attn``'s fused output ``[batch, pos, 3 d_model]``), the rotary
    families ``q`` ``[batch, head, pos, d_head]`` and ``k``, ``v`` ``[batch, kv_head, pos,
    d_head]`` (after RoPE, before ``repeat_kv``: as Hugging Face's attention function receives
    them). ``final_into``: the final norm's output ``[batch, pos, d_model]``. Targets may
    live on another device (copied there). The same operations as :func:`run`, so the
    recorded tensors equal Hugging Face's eager forward bit for bit in float32
    (``tests/test_runtime.py``, ``tests/test_families.py``). Raises :class:`InvalidRequest`
    as :func:`run` for bad ids or hook names."""
    p = _as_parts(model)
    ids = _check_ids(p, input_ids)
    B, T = ids.shape
    plan = _plan(p, B, T, {n: None for n in into}, (), None)
    with torch.inference_mode():
        r = _Run(plan, False, None, into=into)
        r.rec = layers_into or None
        _, h = _forward(p, r, ids, plan)
        if final_into is not None:
            _put(final_into, h)


def _check_start(p: GPT2Parts, plan: _Plan, B: int, T: int, start, resid_pre):
    """``resid_pre`` on the model's device, ``[batch | 1, pos, d_model]`` expanded to the
    batch; None for a forward from the embeddings."""
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= p.n_layers:
        raise InvalidRequest(f"start: a layer 0..{p.n_layers}, got {start!r}", "start")
    if resid_pre is None:
        if start:
            raise InvalidRequest("start: a forward from a later layer needs resid_pre (the "
                                 "residual stream entering it)", "resid_pre")
        return None
    if not isinstance(resid_pre, torch.Tensor) or resid_pre.dtype != p.dtype \
            or resid_pre.dim() != 3 or resid_pre.shape[0] not in (1, B) \
            or tuple(resid_pre.shape[1:]) != (T, p.d_model):
        got = (f"{list(resid_pre.shape)} {resid_pre.dtype}" if isinstance(resid_pre, torch.Tensor)
               else type(resid_pre).__name__)
        raise InvalidRequest(f"resid_pre: [{B} or 1, {T}, {p.d_model}] {p.dtype} needed, got "
                             f"{got}", "resid_pre")
    below = [s.hp.name for (layer, site), s in plan.sites.items()
             if (layer is None and site in ("embed", "pos_embed"))
             or (layer is not None and layer < start)]
    if below:
        raise InvalidRequest(f"{below[0]} is below the start layer {start}: it does not run",
                             "start")
    return resid_pre.to(p.device).expand(B, T, p.d_model)


def _forward(p: GPT2Parts, r: _Run, ids: torch.Tensor, plan: _Plan, start: int = 0,
             resid_pre: torch.Tensor | None = None):
    """Embeddings (or ``resid_pre`` at block ``start``), blocks, ln_f: returns (last residual,
    ln_f output [batch, pos, d_model])."""
    if not isinstance(p, GPT2Parts):
        from . import hooked_families as HF

        return HF.forward(p, r, ids, plan, start, resid_pre)
    B, T = ids.shape
    g = plan.glob
    if resid_pre is None:
        emb = F.embedding(ids, p.wte)
        if (s := g.get("embed")) is not None:
            emb = r.at(s, emb)
        pos = F.embedding(torch.arange(T, device=ids.device).unsqueeze(0), p.wpe)  # [1, pos, d]
        if (s := g.get("pos_embed")) is not None:
            pos = r.at(s, pos.expand(B, T, -1))
        x = emb + pos
    else:
        x = resid_pre
    dt = x.dtype
    masked = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)  # key > query
    mask = torch.zeros(T, T, dtype=dt, device=x.device).masked_fill(masked, torch.finfo(dt).min)
    for i, (blk, sites) in enumerate(zip(p.blocks[start:], plan.layers[start:])):
        r.layer = start + i
        x = _block(p, blk, r, sites, x, mask, masked)
    h = _ln(r, g, "lnf", x, p.lnf_w, p.lnf_b, p.eps)
    return x, h


def reference_means(model, input_ids, hooks: Sequence[str],
                    over: Literal["pos", "batch", "batch_pos"] = "batch_pos"
                    ) -> dict[str, torch.Tensor]:
    """Clean-run means of ``hooks`` over the reference prompts ``input_ids`` ``[n, pos]``, for
    :class:`Mean` ``reference=``: "batch_pos" -> one prompt's shape without pos, "batch" ->
    one prompt's shape (per position; the prompts must then have the experiment's length),
    "pos" is refused here (it is per prompt)."""
    if over not in ("batch", "batch_pos"):
        raise InvalidRequest("over: 'batch' or 'batch_pos' for reference means", "over")
    p = _as_parts(model)
    res = run(p, input_ids, cache={h: None for h in hooks}, logit_positions=[-1])
    cat = _catalogue(p)
    out = {}
    for name, t in res.cache.items():
        dims = (0,) if over == "batch" else (0, cat[name].pos_axis)
        out[name] = t.mean(dim=dims)
    return out


def with_names(parts: GPT2Parts, names: Mapping[str, str]) -> GPT2Parts:
    """``parts`` with another site -> TL name map (tests plant a wrong one)."""
    return replace(parts, names=dict(names))
