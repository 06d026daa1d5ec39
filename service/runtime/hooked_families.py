"""The hooked forward of the rotary families: Llama, Mistral, Qwen2, Gemma, Gemma 2, GPT-NeoX.

The counterpart of :mod:`.hooked`'s GPT-2 blocks for Hugging Face's ``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``GemmaForCausalLM``, ``Gemma2ForCausalLM`` and
``GPTNeoXForCausalLM`` (Pythia). It runs Hugging Face's eager operations in Hugging Face's order
on the model's own parameter tensors (detached views), so that with nothing edited its
residual stream and logits equal ``model(input_ids, use_cache=False)`` with
``attn_implementation="eager"`` bit for bit in float32 (``tests/test_hooked_families.py``):

* RoPE: HF's ``inv_freq`` buffer and ``attention_scaling`` (so the config's theta, linear /
  llama3 / yarn scaling and partial rotary are HF's own numbers), ``cos``/``sin`` as
  ``cat(freqs, freqs)`` of ``position_ids * inv_freq``, ``q * cos + rotate_half(q) * sin`` on
  the first ``rotary_dim`` dimensions (GPT-NeoX ``rotary_pct``; the rest pass through);
  ``rope_type`` "dynamic" / "longrope" (length-dependent frequencies) are refused;
* grouped-query attention: ``repeat_kv`` (kv head ``j`` serves query heads ``j*g .. j*g+g-1``,
  ``g = n_heads / n_kv_heads``), ``matmul(q, k^T) * scaling`` (the attention module's
  ``scaling``: ``d_head^-0.5``, Gemma 2 ``query_pre_attn_scalar^-0.5``), Gemma 2's
  ``tanh(s / cap) * cap`` attention soft-cap, then the additive ``finfo.min`` mask (causal,
  and the sliding window ``query - window < key <= query`` on the layers that have one:
  Mistral every layer, Qwen2 / Gemma 2 those ``layer_types`` names ``sliding_attention``),
  softmax in float32, ``matmul(pattern, v)``;
* RMSNorm in float32 (``x * rsqrt(mean(x^2) + eps)``; Llama-style ``w * h.to(dtype)``, Gemma
  ``(h * (1 + w)).to(dtype)``), GPT-NeoX's LayerNorm (``F.layer_norm``); SwiGLU / GeGLU
  ``down(act(gate(x)) * up(x))``; GPT-NeoX's parallel residual ``mlp + attn + x``; Gemma's
  ``sqrt(d_model)`` embedding scale; Gemma 2's post-attention / post-feed-forward norms and
  final-logit soft-cap.

Measured (``tests/test_hooked_families.py``): logits, hidden states and patterns equal HF's
bit for bit on all six families in float32, bfloat16, float16 and float64 (max |diff| 0; HF's
RMSNorm casts to float32 even in a float64 model, and so do we). Not bit for bit: the split
q/k/v inputs' recomputed heads and ``hook_result``'s per-head sum (einsum, equal to float
rounding, as for GPT-2), TL's own bridge (its float32 rounding, <= 1.7e-5 on residuals ~10).

Hook names and shapes are those of TransformerLens 4.3's bridge with compatibility mode
(``no_processing``, ``use_attn_result``, ``use_split_qkv_input``) for each architecture:

* ``attn.hook_k`` / ``attn.hook_v`` / ``attn.hook_rot_k`` and ``hook_k_input`` /
  ``hook_v_input`` carry the key/value heads, ``[batch, pos, n_kv_heads, ...]``; query head
  ``h`` reads kv head ``h // (n_heads // n_kv_heads)``. ``hook_q``, ``hook_z``,
  ``hook_result``, patterns and scores have the query heads.
* ``attn.hook_q`` / ``hook_k`` before RoPE, ``attn.hook_rot_q`` / ``hook_rot_k`` after it
  (Llama, Mistral, Qwen2, Gemma, Gemma 2; TL's GPT-NeoX bridge has none, so neither do we).
* ``ln*.hook_scale`` = ``sqrt(mean(x^2) + eps)`` (RMSNorm; LayerNorm: of the centred ``x``),
  ``ln*.hook_normalized`` = ``x / scale`` before the weight, float32 as TL computes them (an
  edit rebuilds ``normalized * w`` (Gemma ``1 + w``), TL's reconstruction).
* ``mlp.hook_pre`` = ``gate_proj(x)``, ``mlp.hook_pre_linear`` = ``up_proj(x)``,
  ``mlp.hook_post`` = ``act(pre) * pre_linear`` (gated MLPs); GPT-NeoX ``hook_pre`` /
  ``hook_post`` around its activation.
* Gemma 2: ``ln1_post`` (post-attention norm) and ``ln2_post`` (post-feed-forward norm);
  ``hook_attn_out`` / ``hook_mlp_out`` are their outputs (what enters the residual stream).
* GPT-NeoX with the parallel residual has no ``hook_resid_mid`` (both branches read
  ``hook_resid_pre``); ``hook_resid_post = resid_pre + attn_out + mlp_out``.
* No ``hook_pos_embed`` (rotary). The rotary tables are TL's ``rotary_emb.hook_cos`` /
  ``hook_sin`` (once, before the blocks) and ``blocks.{l}.attn.hook_cos`` / ``hook_sin`` (what
  layer ``l``'s attention rotates q and k with), ``[batch, pos, d_rotary]``: TL caches them
  with a broadcast batch axis of 1 (a function of position alone); here each prompt's row, all
  equal to TL's. An edit of ``rotary_emb.*`` reaches every layer, of ``blocks.{l}.attn.*``
  that layer only (TL's bridge: the rotary module's output feeds each attention's hooks).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.nn.functional as F

from ..errors import UnsupportedModelConfig

#: the model types served here (``config.model_type``)
FAMILIES = ("llama", "mistral", "qwen2", "gemma", "gemma2", "gpt_neox")

_BHD = ("batch", "pos", "head", "d_head")
#: every per-layer site any family has: site -> (TL name suffix, axes)
SITES: dict[str, tuple[str, tuple[str, ...]]] = {
    "resid_pre": ("hook_resid_pre", ("batch", "pos", "d_model")),
    "ln1_scale": ("ln1.hook_scale", ("batch", "pos", "1")),
    "ln1_normalized": ("ln1.hook_normalized", ("batch", "pos", "d_model")),
    "q_input": ("hook_q_input", ("batch", "pos", "head", "d_model")),
    "k_input": ("hook_k_input", ("batch", "pos", "head", "d_model")),
    "v_input": ("hook_v_input", ("batch", "pos", "head", "d_model")),
    "attn_cos": ("attn.hook_cos", ("batch", "pos", "d_rotary")),
    "attn_sin": ("attn.hook_sin", ("batch", "pos", "d_rotary")),
    "q": ("attn.hook_q", _BHD),
    "k": ("attn.hook_k", _BHD),
    "v": ("attn.hook_v", _BHD),
    "rot_q": ("attn.hook_rot_q", _BHD),
    "rot_k": ("attn.hook_rot_k", _BHD),
    "scores": ("attn.hook_attn_scores", ("batch", "head", "query_pos", "key_pos")),
    "pattern": ("attn.hook_pattern", ("batch", "head", "query_pos", "key_pos")),
    "z": ("attn.hook_z", _BHD),
    "result": ("attn.hook_result", ("batch", "pos", "head", "d_model")),
    "lnpa_scale": ("ln1_post.hook_scale", ("batch", "pos", "1")),
    "lnpa_normalized": ("ln1_post.hook_normalized", ("batch", "pos", "d_model")),
    "attn_out": ("hook_attn_out", ("batch", "pos", "d_model")),
    "resid_mid": ("hook_resid_mid", ("batch", "pos", "d_model")),
    "ln2_scale": ("ln2.hook_scale", ("batch", "pos", "1")),
    "ln2_normalized": ("ln2.hook_normalized", ("batch", "pos", "d_model")),
    "mlp_pre": ("mlp.hook_pre", ("batch", "pos", "d_mlp")),
    "mlp_pre_linear": ("mlp.hook_pre_linear", ("batch", "pos", "d_mlp")),
    "mlp_post": ("mlp.hook_post", ("batch", "pos", "d_mlp")),
    "lnpf_scale": ("ln2_post.hook_scale", ("batch", "pos", "1")),
    "lnpf_normalized": ("ln2_post.hook_normalized", ("batch", "pos", "d_model")),
    "mlp_out": ("hook_mlp_out", ("batch", "pos", "d_model")),
    "resid_post": ("hook_resid_post", ("batch", "pos", "d_model")),
}
GLOBAL = {
    "embed": ("hook_embed", ("batch", "pos", "d_model")),
    "rot_cos": ("rotary_emb.hook_cos", ("batch", "pos", "d_rotary")),
    "rot_sin": ("rotary_emb.hook_sin", ("batch", "pos", "d_rotary")),
    "lnf_scale": ("ln_final.hook_scale", ("batch", "pos", "1")),
    "lnf_normalized": ("ln_final.hook_normalized", ("batch", "pos", "d_model")),
}
AXES = {s: v[1] for s, v in {**SITES, **GLOBAL}.items()}
#: sites whose head axis is the key/value heads
KV_SITES = frozenset({"k_input", "v_input", "k", "v", "rot_k"})
_SPLIT = ("q_input", "k_input", "v_input")


def _layer_sites(gated: bool, rotary_hooks: bool, post_norms: bool, parallel: bool):
    # the layer's rotary tables first: they are a function of position alone, hooked as the
    # forward enters the block (forward())
    out = ["attn_cos", "attn_sin", "resid_pre", "ln1_scale", "ln1_normalized", "q_input",
           "k_input", "v_input", "q", "k", "v"]
    if rotary_hooks:
        out += ["rot_q", "rot_k"]
    out += ["scores", "pattern", "z", "result"]
    if post_norms:
        out += ["lnpa_scale", "lnpa_normalized"]
    out += ["attn_out"]
    if not parallel:
        out += ["resid_mid"]
    out += ["ln2_scale", "ln2_normalized", "mlp_pre"]
    if gated:
        out += ["mlp_pre_linear"]
    out += ["mlp_post"]
    if post_norms:
        out += ["lnpf_scale", "lnpf_normalized"]
    return tuple(out + ["mlp_out", "resid_post"])


_LAYER_HOOK = re.compile(r"^blocks\.([^.]+)\.(.+)$")


def absent_hook(p: FamilyParts, name: str) -> str | None:
    """Why TransformerLens hook ``name`` (or pattern) is absent from this family's catalogue,
    where the family itself is the reason (GPT-NeoX's parallel residual has no
    ``hook_resid_mid``; TL's NeoX bridge has no ``attn.hook_rot_q`` / ``hook_rot_k``); None
    otherwise (the caller names the closest hooks)."""
    m = _LAYER_HOOK.match(name)
    if m is None:
        return None
    lyr, suffix = m.group(1), m.group(2)
    if suffix == "hook_resid_mid" and p.parallel:
        return (f"{p.family} has a parallel residual: no blocks.{lyr}.hook_resid_mid (attention "
                f"and MLP both read blocks.{lyr}.hook_resid_pre; hook_resid_post = resid_pre + "
                "attn_out + mlp_out). Use hook_resid_pre, or ln2.hook_normalized / "
                "hook_mlp_out for the MLP's input / output")
    if suffix in ("attn.hook_rot_q", "attn.hook_rot_k") and "rot_q" not in p.layer_sites:
        return (f"{p.family}: TransformerLens 4.3's bridge has no blocks.{lyr}.{suffix} for "
                f"this architecture; the rotary tables are blocks.{lyr}.attn.hook_cos / "
                "hook_sin, q and k before RoPE attn.hook_q / hook_k")
    return None


def _unsupported(what: str, family: str, why: str):
    def get(self):
        raise UnsupportedModelConfig(f"{what} is not defined for {family} checkpoints in this "
                                     f"service ({why})", "model")
    return property(get)


@dataclass(frozen=True)
class FamilyBlock:
    """One decoder layer's tensors (``nn.Linear`` weights ``[out, in]``; None where the family
    has no such tensor). GPT-NeoX keeps its fused ``query_key_value`` (rows per head
    ``[q | k | v]``) in ``qkv_w`` / ``qkv_b``; the others ``q_w`` .. ``v_b``."""

    ln1_w: torch.Tensor
    ln1_b: torch.Tensor | None
    q_w: torch.Tensor | None
    q_b: torch.Tensor | None
    k_w: torch.Tensor | None
    k_b: torch.Tensor | None
    v_w: torch.Tensor | None
    v_b: torch.Tensor | None
    qkv_w: torch.Tensor | None
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor  # [d_model, head d_head]
    o_b: torch.Tensor | None
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor | None
    lnpa_w: torch.Tensor | None  # Gemma 2 post_attention_layernorm
    lnpf_w: torch.Tensor | None  # Gemma 2 post_feedforward_layernorm
    gate_w: torch.Tensor | None
    gate_b: torch.Tensor | None
    up_w: torch.Tensor  # up_proj / dense_h_to_4h
    up_b: torch.Tensor | None
    down_w: torch.Tensor  # down_proj / dense_4h_to_h
    down_b: torch.Tensor | None
    scaling: float
    window: int | None  # sliding window (keys query - window < key <= query), None = causal

    @property
    def proj_b(self) -> torch.Tensor:
        """The attention output bias ``[d_model]`` (zeros where the family has none)."""
        return self.o_b if self.o_b is not None else torch.zeros_like(self.o_w[:, 0])

    attn_w = _unsupported("the fused GPT-2 W_QKV (attn_w)", "rotary",
                          "q/k/v are separate projections with RoPE between them and the dot "
                          "product")


class PartsShape:
    """The sizes every family's parts derive from their tensors (``blocks``, ``wte``
    ``[vocab, d_model]``, ``unembed`` ``[vocab, d_model]``): shared by :class:`FamilyParts`
    and :class:`.hooked.GPT2Parts`."""

    blocks: tuple
    wte: torch.Tensor
    unembed: torch.Tensor

    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    @property
    def d_model(self) -> int:
        return self.wte.shape[1]

    @property
    def d_vocab(self) -> int:
        return self.unembed.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.wte.dtype

    @property
    def device(self) -> torch.device:
        return self.wte.device


@dataclass(frozen=True)
class FamilyParts(PartsShape):
    """A rotary-family causal LM's parameter views and config values for the hooked forward
    (build with :func:`family_parts`). The attributes the GPT-2 code paths read (``n_layers``,
    ``n_heads``, ``d_head``, ``d_model``, ``d_mlp``, ``d_vocab``, ``n_ctx``, ``wte``,
    ``unembed``, ``eps``, ``lnf_w``, ``dtype``, ``device``) mean the same; ``wpe`` (no learned
    positions) and, for RMSNorm families, ``lnf_b`` raise :class:`UnsupportedModelConfig`."""

    family: str
    wte: torch.Tensor  # [vocab, d_model]
    embed_scale: torch.Tensor | None  # Gemma's sqrt(d_model) buffer, else None
    blocks: tuple[FamilyBlock, ...]
    lnf_w: torch.Tensor
    lnf_bias: torch.Tensor | None
    unembed: torch.Tensor  # [vocab, d_model]
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_mlp: int
    eps: float
    norm: str  # "rms" (Llama: w * h.to(dtype)), "rms1p" (Gemma: (h * (1 + w)).to(dtype)), "ln"
    act: object
    inv_freq: torch.Tensor  # [rotary_dim / 2] float32, HF's buffer
    rope_scaling: float  # HF's attention_scaling on cos/sin
    rotary_dim: int
    parallel: bool
    attn_softcap: float | None
    final_softcap: float | None
    n_ctx: int
    layer_sites: tuple[str, ...]
    names: Mapping[str, str] = field(default_factory=dict)

    @property
    def kv_group(self) -> int:
        """Query heads per key/value head: query head ``h`` reads kv head ``h // kv_group``."""
        return self.n_heads // self.n_kv_heads

    @property
    def lnf_b(self) -> torch.Tensor:
        if self.norm == "ln":
            return self.lnf_bias
        raise UnsupportedModelConfig(
            f"{self.family} normalises with RMSNorm (no centring, no bias"
            f"{', weight 1 + w' if self.norm == 'rms1p' else ''}): this analysis is defined with "
            "GPT-2's LayerNorm ln_final", "model")

    wpe = _unsupported("a learned position embedding (wpe)", "rotary",
                       "positions enter through RoPE on q and k, there is no position table")


def family_parts(model) -> FamilyParts:
    """The parts of a Hugging Face ``LlamaForCausalLM`` / ``MistralForCausalLM`` /
    ``Qwen2ForCausalLM`` / ``GemmaForCausalLM`` / ``Gemma2ForCausalLM`` / ``GPTNeoXForCausalLM``.

    Raises :class:`UnsupportedModelConfig` naming the switch for what the forward does not
    implement: another model type, no LM head, ``rope_type`` "dynamic"/"longrope", a
    ``layer_types`` entry other than full/sliding attention, q/k norms, MoE layers."""
    cfg = model.config
    fam = getattr(cfg, "model_type", None)
    if fam not in FAMILIES:
        raise UnsupportedModelConfig(f"the hooked forward supports {('gpt2',) + FAMILIES}; this "
                                     f"model is {fam!r}", "model")
    neox = fam == "gpt_neox"
    base = getattr(model, "gpt_neox" if neox else "model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is None or head is None or not hasattr(base, "layers"):
        raise UnsupportedModelConfig(f"the hooked forward needs a {fam} causal-LM checkpoint "
                                     f"({type(model).__name__} has no LM head)", "model")
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    rtype = rope.get("rope_type", "default")
    if "dynamic" in str(rtype) or rtype == "longrope":
        raise UnsupportedModelConfig(f"the hooked forward does not implement rope_parameters."
                                     f"rope_type={rtype!r} (frequencies that depend on the "
                                     f"sequence length)", "model")
    ltypes = getattr(cfg, "layer_types", None)
    if ltypes is not None:
        bad = sorted(set(ltypes) - {"full_attention", "sliding_attention"})
        if bad:
            raise UnsupportedModelConfig(f"the hooked forward does not implement layer_types "
                                         f"{bad}", "model")
    rot = base.rotary_emb
    inv_freq = rot.inv_freq.detach()
    if not isinstance(getattr(rot, "attention_scaling", 1.0), (int, float)):
        raise UnsupportedModelConfig("the hooked forward does not implement a tensor "
                                     "rotary attention_scaling", "model")

    def d(t):
        return None if t is None else t.detach()

    blocks = []
    for i, layer in enumerate(base.layers):
        attn = layer.attention if neox else layer.self_attn
        for name in ("q_norm", "k_norm"):
            if getattr(attn, name, None) is not None:
                raise UnsupportedModelConfig(f"the hooked forward does not implement {name}",
                                             "model")
        mlp = layer.mlp
        if fam == "mistral":
            window = getattr(cfg, "sliding_window", None)
        elif ltypes is not None and ltypes[i] == "sliding_attention":
            window = cfg.sliding_window
        else:
            window = None
        if neox:
            qkv = dict(q_w=None, q_b=None, k_w=None, k_b=None, v_w=None, v_b=None,
                       qkv_w=d(attn.query_key_value.weight), qkv_b=d(attn.query_key_value.bias))
            o = attn.dense
            mlpw = dict(gate_w=None, gate_b=None, up_w=d(mlp.dense_h_to_4h.weight),
                        up_b=d(mlp.dense_h_to_4h.bias), down_w=d(mlp.dense_4h_to_h.weight),
                        down_b=d(mlp.dense_4h_to_h.bias))
        else:
            qkv = dict(q_w=d(attn.q_proj.weight), q_b=d(attn.q_proj.bias),
                       k_w=d(attn.k_proj.weight), k_b=d(attn.k_proj.bias),
                       v_w=d(attn.v_proj.weight), v_b=d(attn.v_proj.bias), qkv_w=None, qkv_b=None)
            o = attn.o_proj
            if not hasattr(mlp, "gate_proj"):
                raise UnsupportedModelConfig(f"the hooked forward does not implement the MLP "
                                             f"{type(mlp).__name__}", "model")
            mlpw = dict(gate_w=d(mlp.gate_proj.weight), gate_b=d(mlp.gate_proj.bias),
                        up_w=d(mlp.up_proj.weight), up_b=d(mlp.up_proj.bias),
                        down_w=d(mlp.down_proj.weight), down_b=d(mlp.down_proj.bias))
        post = fam == "gemma2"
        blocks.append(FamilyBlock(
            ln1_w=d(layer.input_layernorm.weight), ln1_b=d(getattr(layer.input_layernorm,
                                                                    "bias", None)),
            **qkv, o_w=d(o.weight), o_b=d(o.bias),
            ln2_w=d((layer.pre_feedforward_layernorm if post else
                     layer.post_attention_layernorm).weight),
            ln2_b=d(getattr(layer.post_attention_layernorm, "bias", None)) if neox else None,
            lnpa_w=d(layer.post_attention_layernorm.weight) if post else None,
            lnpf_w=d(layer.post_feedforward_layernorm.weight) if post else None,
            **mlpw, scaling=float(attn.scaling), window=window))
    mlp0 = base.layers[0].mlp
    act = mlp0.act if neox else mlp0.act_fn
    H = cfg.num_attention_heads
    dh = blocks[0].o_w.shape[1] // H
    kv = H if neox else cfg.num_key_value_heads
    norm = "ln" if neox else ("rms1p" if fam.startswith("gemma") else "rms")
    lnf = base.final_layer_norm if neox else base.norm
    eps = cfg.layer_norm_eps if neox else cfg.rms_norm_eps
    emb = base.embed_in if neox else base.embed_tokens
    scale = getattr(emb, "embed_scale", None)
    sites = _layer_sites(gated=not neox, rotary_hooks=not neox, post_norms=fam == "gemma2",
                         parallel=neox and bool(cfg.use_parallel_residual))
    names = {s: v[0] for s, v in {**SITES, **GLOBAL}.items()}
    return FamilyParts(
        family=fam, wte=d(emb.weight), embed_scale=None if scale is None else d(scale),
        blocks=tuple(blocks), lnf_w=d(lnf.weight), lnf_bias=d(getattr(lnf, "bias", None)),
        unembed=d(head.weight), n_heads=H, n_kv_heads=kv, d_head=dh,
        d_mlp=blocks[0].up_w.shape[0], eps=float(eps), norm=norm, act=act,
        inv_freq=inv_freq, rope_scaling=float(getattr(rot, "attention_scaling", 1.0)),
        rotary_dim=2 * inv_freq.shape[0], parallel=neox and bool(cfg.use_parallel_residual),
        attn_softcap=getattr(cfg, "attn_logit_softcapping", None) if fam == "gemma2" else None,
        final_softcap=getattr(cfg, "final_logit_softcapping", None) if fam == "gemma2" else None,
        n_ctx=int(cfg.max_position_embeddings), layer_sites=sites, names=names)


# --------------------------------------------------------------------------------------------
# The forward
# --------------------------------------------------------------------------------------------

def _rms_plain(p: FamilyParts, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Hugging Face's RMSNorm, the same operations (LlamaRMSNorm / GemmaRMSNorm)."""
    if p.norm == "rms1p":
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + p.eps)
        return (out * (1.0 + w.float())).type_as(x)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + p.eps)
    return w * h.to(x.dtype)


def _norm(p: FamilyParts, r, sites: dict, pre: str, x: torch.Tensor, w, b) -> torch.Tensor:
    """The family's norm with TL's ``hook_scale`` / ``hook_normalized`` (TL 4.3 bridge)."""
    if p.norm == "ln":
        from .hooked import _ln
        return _ln(r, sites, pre, x, w, b, p.eps)
    s_scale, s_norm = sites.get(pre + "_scale"), sites.get(pre + "_normalized")
    if s_scale is None and s_norm is None:
        return _rms_plain(p, x, w)
    xf = x.float() if x.dtype not in (torch.float32, torch.float64) else x
    var = xf.pow(2).mean(-1, keepdim=True)
    scale = (var + p.eps).sqrt()
    norm = xf * torch.rsqrt(var + p.eps)
    edited = False
    if s_scale is not None:
        new = r.at(s_scale, scale)
        if new is not scale or s_scale.grad:
            edited = True
            norm = xf / new
    if s_norm is not None:
        new = r.at(s_norm, norm)
        edited |= new is not norm or s_norm.grad
        norm = new
    if not edited:
        return _rms_plain(p, x, w)
    weight = (1.0 + w) if p.norm == "rms1p" else w
    return (norm * weight).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int, dh: int):
    """HF's ``apply_rotary_pos_emb`` on one of q/k ``[batch, head, pos, d_head]`` (cos, sin
    ``[1, 1, pos, rotary_dim]``); partial rotary (GPT-NeoX) rotates the first ``rd`` dims."""
    if rd == dh:
        return (t * cos) + (_rotate_half(t) * sin)
    t_rot, t_pass = t[..., :rd], t[..., rd:]
    return torch.cat([(t_rot * cos) + (_rotate_half(t_rot) * sin), t_pass], dim=-1)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """HF's ``repeat_kv``: ``[batch, kv_head, pos, d]`` -> ``[batch, kv_head * n_rep, pos, d]``."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def _split_weights(p: FamilyParts, blk: FamilyBlock, i: int):
    """(weight ``[n, d_head, d_model]``, bias ``[n, d_head]`` | None) of q (i=0), k, v."""
    D, dh = p.d_model, p.d_head
    if blk.qkv_w is not None:  # GPT-NeoX: rows [head, 3, d_head]
        w = blk.qkv_w.view(p.n_heads, 3, dh, D)[:, i]
        b = None if blk.qkv_b is None else blk.qkv_b.view(p.n_heads, 3, dh)[:, i]
        return w, b
    w = (blk.q_w, blk.k_w, blk.v_w)[i]
    b = (blk.q_b, blk.k_b, blk.v_b)[i]
    n = w.shape[0] // dh
    return w.view(n, dh, D), None if b is None else b.view(n, dh)


def _block(p: FamilyParts, blk: FamilyBlock, r, sites: dict, x: torch.Tensor,
           cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, masked: torch.Tensor):
    B, T, D = x.shape
    H, KV, dh = p.n_heads, p.n_kv_heads, p.d_head
    get = sites.get
    if (s := get("resid_pre")) is not None:
        x = r.at(s, x)
    h = _norm(p, r, sites, "ln1", x, blk.ln1_w, blk.ln1_b)
    if r.rec:
        r.record("attn_input", h)
    # 1. q, k, v [batch, pos, head, d_head] views of the projections (HF's order)
    if blk.qkv_w is not None:
        qkv = F.linear(h, blk.qkv_w, blk.qkv_b).view(B, T, H, 3 * dh)
        qkv4 = list(qkv.chunk(3, dim=-1))
    else:
        qkv4 = [F.linear(h, blk.q_w, blk.q_b).view(B, T, -1, dh),
                F.linear(h, blk.k_w, blk.k_b).view(B, T, -1, dh),
                F.linear(h, blk.v_w, blk.v_b).view(B, T, -1, dh)]
    for i, name in enumerate(_SPLIT):
        s = get(name)
        if s is None:
            continue
        n = H if i == 0 else KV
        rep = x.unsqueeze(2).expand(B, T, n, D)
        rep = r.at(s, rep.contiguous() if s.grad else rep)
        heads = list(range(n)) if s.grad else s.heads_touched(n)
        if heads:  # those heads' q (k, v) from their own copy: ln1 per head, their rows
            hi = torch.tensor(heads, device=x.device)
            hn = _norm(p, r, {}, "ln1", rep.index_select(2, hi), blk.ln1_w, blk.ln1_b)
            w, b = _split_weights(p, blk, i)
            new = torch.einsum("bthd,hed->bthe", hn, w.index_select(0, hi))
            if b is not None:
                new = new + b.index_select(0, hi)
            if len(heads) == n:
                qkv4[i] = new
            else:
                full = qkv4[i].clone()
                full[:, :, hi] = new
                qkv4[i] = full
    for i, name in enumerate(("q", "k", "v")):
        if (s := get(name)) is not None:
            qkv4[i] = r.at(s, qkv4[i])
    q, k, v = (t.transpose(1, 2) for t in qkv4)  # [batch, head, pos, d_head]
    # 2. RoPE on q and k (the first rotary_dim dims)
    q = _rope(q, cos, sin, p.rotary_dim, dh)
    k = _rope(k, cos, sin, p.rotary_dim, dh)
    if (s := get("rot_q")) is not None:
        q = r.at(s, q.transpose(1, 2)).transpose(1, 2)
    if (s := get("rot_k")) is not None:
        k = r.at(s, k.transpose(1, 2)).transpose(1, 2)
    # 3. scores = q.k^T * scaling (soft-capped), + mask, [batch, head, query_pos, key_pos]
    if r.rec:  # as Hugging Face's attention function receives them: after RoPE, kv heads
        r.record("q", q)
        r.record("k", k)
        r.record("v", v)
    k = _repeat_kv(k, p.kv_group)
    v = _repeat_kv(v, p.kv_group)
    scores = r.scores(get("scores"), q, k, blk.scaling, mask, p.attn_softcap)
    if scores is None:
        scores = torch.matmul(q, k.transpose(2, 3)) * blk.scaling
        if p.attn_softcap is not None:
            scores = scores / p.attn_softcap
            scores = torch.tanh(scores)
            scores = scores * p.attn_softcap
        scores = scores + mask
    if (s := get("scores")) is not None:
        new = r.at(s, scores, tl_view=lambda t: t.masked_fill(masked, float("-inf")))
        if s.edits:  # keep the model causal (and windowed) after an edit
            new = new.masked_fill(masked, torch.finfo(new.dtype).min)
        scores = new
    # 4. pattern: softmax in float32; z = pattern @ v, [batch, pos, head, d_head]
    out = r.target(get("pattern"), scores) if scores.dtype == torch.float32 else None
    pattern = torch.softmax(scores, dim=-1, dtype=torch.float32, out=out).to(q.dtype)
    if (s := get("pattern")) is not None:
        pattern = r.at(s, pattern)
    z = torch.matmul(pattern, v).transpose(1, 2).contiguous()
    if (s := get("z")) is not None:
        z = r.at(s, z)
    # 5. output projection; per head (hook_result, without b_O) only when asked
    if (s := get("result")) is not None:
        res = torch.einsum("bthe,dhe->bthd", z, blk.o_w.view(D, H, dh))
        new = r.at(s, res)
        if new is not res or s.grad:
            attn = new.sum(2) if blk.o_b is None else new.sum(2) + blk.o_b
        else:
            attn = F.linear(z.reshape(B, T, -1).contiguous(), blk.o_w, blk.o_b)
    else:
        attn = F.linear(z.reshape(B, T, -1).contiguous(), blk.o_w, blk.o_b)
    if r.rec:  # the output projection's (Gemma 2: before its post-attention norm)
        r.record("attn_output", attn)
    if blk.lnpa_w is not None:
        attn = _norm(p, r, sites, "lnpa", attn, blk.lnpa_w, None)
    if (s := get("attn_out")) is not None:
        attn = r.at(s, attn)
    # 6. MLP (parallel: from resid_pre) and the residual
    if p.parallel:
        mid = x
    else:
        mid = attn + x if blk.qkv_w is not None else x + attn
        if (s := get("resid_mid")) is not None:
            mid = r.at(s, mid)
    h = _norm(p, r, sites, "ln2", mid, blk.ln2_w, blk.ln2_b)
    pre = F.linear(h, blk.gate_w if blk.gate_w is not None else blk.up_w,
                   blk.gate_b if blk.gate_w is not None else blk.up_b)
    if (s := get("mlp_pre")) is not None:
        pre = r.at(s, pre)
    if blk.gate_w is not None:
        act = p.act(pre)
        lin = F.linear(h, blk.up_w, blk.up_b)
        if (s := get("mlp_pre_linear")) is not None:
            lin = r.at(s, lin)
        post = act * lin
    else:
        post = p.act(pre)
    if (s := get("mlp_post")) is not None:
        post = r.at(s, post)
    mlp = F.linear(post, blk.down_w, blk.down_b)
    if blk.lnpf_w is not None:
        mlp = _norm(p, r, sites, "lnpf", mlp, blk.lnpf_w, None)
    if (s := get("mlp_out")) is not None:
        mlp = r.at(s, mlp)
    if p.parallel:
        x = mlp + attn + x
    elif blk.qkv_w is not None:
        x = mlp + mid
    else:
        x = mid + mlp
    if (s := get("resid_post")) is not None:
        x = r.at(s, x)
    return x


def embed(p: FamilyParts, ids: torch.Tensor) -> torch.Tensor:
    """The embedding output ``[batch, pos, d_model]`` (Gemma: times its ``sqrt(d_model)``)."""
    e = F.embedding(ids, p.wte)
    if p.embed_scale is not None:
        e = e * p.embed_scale.to(p.wte.dtype)
    return e


def rotary(p: FamilyParts, T: int, device, dtype):
    """HF's rotary tables for positions ``0..T-1``: ``cos``, ``sin`` ``[1, 1, pos,
    rotary_dim]`` (``cat(freqs, freqs)``, freqs = ``pos * inv_freq``, times attention_scaling)."""
    pos = torch.arange(T, device=device).unsqueeze(0)
    freqs = pos[..., None].float() * p.inv_freq.to(device=device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * p.rope_scaling
    sin = emb.sin() * p.rope_scaling
    return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def _rotary_hook(r, site, table: torch.Tensor, B: int) -> torch.Tensor:
    """``table`` ``[1 | batch, 1, pos, d_rotary]`` through a rotary hook (TL's
    ``hook_cos`` / ``hook_sin``, seen as ``[batch, pos, d_rotary]``); unchanged without one."""
    if site is None:
        return table
    return r.at(site, table[:, 0].expand(B, -1, -1)).unsqueeze(1)


def forward(p: FamilyParts, r, ids: torch.Tensor, plan, start: int = 0,
            resid_pre: torch.Tensor | None = None):
    """Embedding (or ``resid_pre`` at block ``start``), the blocks, the final norm: returns
    (last residual, final-norm output ``[batch, pos, d_model]``)."""
    B, T = ids.shape
    g = plan.glob
    if resid_pre is None:
        x = embed(p, ids)
        if (s := g.get("embed")) is not None:
            x = r.at(s, x)
    else:
        x = resid_pre
    dt = x.dtype
    cos, sin = rotary(p, T, x.device, dt)
    # TL's rotary hooks: [batch, pos, d_rotary] views of the [1, 1, pos, d_rotary] tables
    cos, sin = (_rotary_hook(r, g.get(f"rot_{w}"), t, B) for w, t in (("cos", cos), ("sin", sin)))
    qi = torch.arange(T, device=x.device)
    causal = qi[None, :] > qi[:, None]  # key > query
    masks = {}
    for i, (blk, sites) in enumerate(zip(p.blocks[start:], plan.layers[start:])):
        r.layer = start + i
        if blk.window not in masks:
            m = causal if blk.window is None else causal | (qi[None, :] <= qi[:, None] - blk.window)
            masks[blk.window] = (torch.zeros(T, T, dtype=dt, device=x.device).masked_fill(
                m, torch.finfo(dt).min), m)
        mask, masked = masks[blk.window]
        c_l, s_l = (_rotary_hook(r, sites.get(f"attn_{w}"), t, B)
                    for w, t in (("cos", cos), ("sin", sin)))
        x = _block(p, blk, r, sites, x, c_l, s_l, mask, masked)
    h = _norm(p, r, g, "lnf", x, p.lnf_w, p.lnf_bias)
    return x, h
