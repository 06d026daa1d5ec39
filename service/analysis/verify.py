"""Verification, mode ``from_scratch`` (the default): the whole forward recomputed in float64.

docs/architecture.md ("Verification"), S000 (000_1c89b6c8c2a32040.txt: the scaled dot-product
``attention(Q, K, V, mask)`` and the causal mask), S001 (001_92e9928af52718c3.txt: heads):
the forward is recomputed from the token ids, the model's OWN weight tensors and its config
values -- our own implementation of every block, never the library's modules, in float64 --
and compared, layer by layer, with what the service SERVED for that text (the recorded
forward): the attention pattern of every head, the q/k/v, the attention output and the
residual-stream hidden states. Because nothing recorded is used as an input, the check can
disagree: a wrong weight, position, scale, mask, LayerNorm, activation or residual anywhere
shows up as a difference at the first layer where it acts (named in the result).

Families (the adapter hands over ``ScratchModel``: weights by their Hugging Face base-model
state-dict names, and the config as plain values; this module imports no runtime code):

GPT-2 (``GPT2Model``; per layer l, residual stream ``h``, ``[pos, d_model]``)::

    h_0 = wte[ids] + wpe[positions]                                  # embeddings
    x   = LN(h_l; ln_1, eps=layer_norm_epsilon)                      # LN: (x-mu)/sqrt(var+eps)*g+b
    q|k|v = x @ c_attn.W + c_attn.b      # Conv1D: W stored [d_in, d_out] (transposed vs Linear)
    scores = (q_h @ k_h^T) * s_l         # s_l = (1/sqrt(d_head) if scale_attn_weights else 1)
                                         #       / (l+1 if scale_attn_by_inverse_layer_idx)
    pattern = softmax(scores + causal mask(-inf on key > query))      # [head, query, key]
    a   = concat_h(pattern_h @ v_h) @ c_proj.W + c_proj.b            # attention output
    r   = h_l + a
    h_{l+1} = r + mlp.c_proj(act(mlp.c_fc(LN(r; ln_2))))             # act = activation_function
    final = LN(h_L; ln_f)                                            # HF's last hidden_states

``reorder_and_upcast_attn`` only changes the precision Hugging Face computes the scores in
(float32 under a float16 model); in float64 the formula is the same, and the result says so.

BERT (``BertModel``; ``nn.Linear`` weights stored ``[d_out, d_in]``: ``y = x @ W^T + b``)::

    h_0 = LN(word[ids] + position[positions] + token_type[0]; embeddings.LayerNorm)
    q|k|v = h_l @ W^T + b (query/key/value),  scores = q_h @ k_h^T / sqrt(d_head)
    pattern = softmax(scores)           # bidirectional: every key visible (no padding here)
    a  = LN(concat_h(pattern_h @ v_h) @ dense^T + b + h_l; attention.output.LayerNorm)
    h_{l+1} = LN(output.dense(act(intermediate.dense(a))) + a; output.LayerNorm)  # act = hidden_act
    final = h_L                                                       # no final LayerNorm

Rotary families (``llama``, ``mistral``, ``qwen2``, ``gemma``, ``gemma2``: ``*Model``, weights
``embed_tokens``, ``layers.{l}.self_attn.{q,k,v,o}_proj``, ``layers.{l}.mlp.{gate,up,down}_proj``,
``norm``; ``gpt_neox``: ``embed_in``, ``layers.{l}.attention.query_key_value`` / ``dense``,
``layers.{l}.mlp.dense_h_to_4h`` / ``dense_4h_to_h``, ``final_layer_norm``). ``nn.Linear``;
a bias wherever the state dict holds one (Qwen2's q/k/v, ``attention_bias``, ``mlp_bias``)::

    h_0 = embed[ids]                    (Gemma, Gemma 2: * sqrt(d_model))
    RMS(x; w) = x / sqrt(mean(x^2) + eps) * w      (Zhang & Sennrich 2019; Gemma: * (1 + w))
    q = x W_q^T [H, T, d_head];  k, v = x W_{k,v}^T [H_kv, T, d_head]   (GPT-NeoX: one fused
        query_key_value whose output is [T, H, 3*d_head], q | k | v within each head)
    RoPE (Su et al. 2021), on the first r = int(d_head * partial_rotary_factor) dims of q and k
        (GPT-NeoX rotary_pct, Black et al. 2022), in the half-split ("rotate_half") layout:
        for j < r/2, angle = pos * f_j, f_j = theta^(-2j/r) (rope_parameters.rope_theta):
        (x_j, x_{j+r/2}) -> (x_j cos - x_{j+r/2} sin, x_{j+r/2} cos + x_j sin); dims >= r pass.
        rope_type 'linear': f_j / factor; 'llama3': f_j / factor where its wavelength
        2 pi / f_j > original_max_position_embeddings / low_freq_factor, f_j where it is
        < original_max / high_freq_factor, else (1 - s) f_j / factor + s f_j with
        s = (original_max / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    GQA (Ainslie et al. 2023): query head h reads key/value head h // (H / H_kv) (Hugging Face's
        repeat_kv: each kv head serves a block of consecutive query heads)
    scores_h = q_h k_{kv(h)}^T * s      s = d_head^-0.5 (Gemma 2: query_pre_attn_scalar^-0.5)
    soft-cap (Gemma 2, attn_logit_softcapping c): scores = c * tanh(scores / c), before the mask
    mask: key > query hidden; sliding window w (Beltagy et al. 2020, Jiang et al. 2023): also
        key <= query - w hidden (w keys visible, the query's own included). Per layer: Mistral
        every layer (config.sliding_window); Qwen2 and Gemma 2 the layers whose
        layer_types[l] == 'sliding_attention'
    pattern = softmax(scores);  a = concat_h(pattern_h v_{kv(h)}) W_o^T
    Llama, Mistral, Qwen2, Gemma:  r = h + a(RMS(h; input_layernorm));
                                   h' = r + mlp(RMS(r; post_attention_layernorm))
    Gemma 2:  r = h + RMS(a(RMS(h; input_layernorm)); post_attention_layernorm)
              h' = r + RMS(mlp(RMS(r; pre_feedforward_layernorm)); post_feedforward_layernorm)
    mlp(x) = down(act(gate(x)) * up(x))   (SwiGLU with silu, GeGLU with a GELU; Shazeer 2020)
    GPT-NeoX: LN(x) as GPT-2's; mlp(x) = dense_4h_to_h(act(dense_h_to_4h(x)));
              use_parallel_residual: h' = h + a(LN(h; input_layernorm)) + mlp(LN(h; post_attention_layernorm))
              else r = h + a(LN(h; input_layernorm)); h' = r + mlp(LN(r; post_attention_layernorm))
    final = RMS(h_L; norm) (GPT-NeoX: LN(h_L; final_layer_norm));  logits = final W_U^T,
        Gemma 2 final_logit_softcapping c: c * tanh(logits / c)

Rotary angles. Hugging Face's rotary embedding computes ``f_j`` and ``pos * f_j`` in float32
whatever the model's dtype, so its angles carry an error that GROWS WITH THE POSITION (~pos *
2^-24 rad): against exact float64 angles a float32 random Llama drifts by 6.9e-6 (pattern) at
T = 256, 3.4e-5 at T = 1024 and 1.4e-4 at T = 4096, past the float32 tolerance. So
:func:`verify_from_scratch` takes the served frequencies (``served_inv_freq``, the buffer the
served and hooked forwards rotate with), checks them against the config's formula here
(relative, :data:`ROPE_FREQ_TOLERANCE`: a wrong theta, scaling or rotary dim fails there) and
rounds the angle ``pos * f_j`` to float32 as that forward does (one IEEE product, the same on
every device); the cos/sin and everything after stay float64. The drift is then 4.1e-6 at
T = 4096. :func:`recompute` without it uses exact float64 angles (the tests' comparison with
Hugging Face run in float64). Checked in tests/test_verify_families.py: with exact angles the
recomputation equals Hugging Face's own modules run in true float64 to <= 3e-14 (patterns, q/k/v,
states, logits) on every family and on the linear / llama3 / MQA / biased / sliding-Qwen2 /
sequential-NeoX variants.

A config switch this recomputation does not implement (an activation without a formula here,
``add_cross_attention``, ``position_embedding_type`` other than ``absolute``, a decoder BERT, a
rope_type other than default/linear/llama3, rope parameters per layer type, partial rotary
outside GPT-NeoX, a layer type other than full/sliding attention, bidirectional Gemma
attention, kv heads that do not divide the query heads)
raises :class:`UnsupportedModelConfig` naming the key (HTTP 422): never a pass.

Comparison and tolerances. Differences are ``max |served - recomputed|``, computed in float64:
the pattern per layer and head (probability units, absolute); q, k, v (rotary families: q and
k after RoPE, k and v on the key/value heads, as the runtime records them), the attention output
and each hidden state per layer (model units), which pass when ``diff <= tol * max(1, scale)``
with ``scale = max |recomputed|`` of that tensor (their magnitude grows with depth, so an
absolute bound would be meaningless across models); for a causal LM the served logits (the
hooked forward's, ``service/runtime/hooked.py``: the path every intervention endpoint and
``/v1/run`` compute with) against ``W_U`` applied to the recomputed ln_f output, relative to
``max(1, max |logit|)``. :data:`TOLERANCES` per served dtype:

========  ==================  ============================  ===============================
dtype     pattern (absolute)  states (relative to scale)    logits (relative to max |logit|)
========  ==================  ============================  ===============================
float32   1e-4                1e-4                          1e-4
float16   2.5e-2              1e-2                          1e-2
bfloat16  1.2e-1              5e-2                          5e-2
float64   1e-9                1e-9                          1e-9
========  ==================  ============================  ===============================

From measured drift (``bench/precision_faults.py``, README "Numerical precision"; the seed
sentences cut to T = 248 on the bundled GPT-2 and a random GPT-2-small, T = 506 on MiniLM): the
largest honest difference of the three models / the smallest 1.10x attention-scale fault
(planted in the recorded forward's attention; for the logits, in the hooked forward's):

* float32: pattern 4.1e-6 / 3.0e-2, states 1.4e-6 / 2.1e-2, logits 1.7e-6 / 1.6e-2;
* float16: pattern 1.1e-2 (MiniLM) / 3.0e-2, states 3.7e-3 / 2.1e-2, logits 4.7e-3 / 1.6e-2:
  the bounds sit 2.1-2.7x above the noise and 1.2-2.1x below the faults (each fault fails
  at least one check by 1.6x or more);
* bfloat16: pattern 8.0e-2 (MiniLM) / 3.0e-2, states 3.3e-2 / 2.2e-2, logits 3.2e-2 / 1.9e-2.
  The noise is the trained models', the smallest faults the random model's (diffuse attention
  barely moves under a 1.1x scale): no bound separates them for every model. The bounds sit
  1.5x above the noise and catch the trained models' 1.10x faults (bundled: states 7.6e-2,
  logits 8.6e-2; on the test sentence states 6.4e-2; MiniLM: pattern 0.23, states 0.29), not
  the random model's: verify in float32 what must be exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Protocol, Sequence

import torch

from ..errors import UnsupportedModelConfig

#: Per served dtype: (pattern tolerance, absolute; state tolerance, relative to max(1, scale);
#: logits tolerance, relative to max(1, max |logit|)).
TOLERANCES: dict[str, tuple[float, float, float]] = {
    "float32": (1e-4, 1e-4, 1e-4),
    "float16": (2.5e-2, 1e-2, 1e-2),
    "bfloat16": (1.2e-1, 5e-2, 5e-2),
    "float64": (1e-9, 1e-9, 1e-9),
}

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_erf(x):  # "gelu": the exact GELU, x * Phi(x)
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _gelu_tanh(x):  # "gelu_new" (GPT-2), "gelu_pytorch_tanh", "gelu_fast": the tanh approximation
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x.pow(3))))


#: Activations with a formula here (Hugging Face ACT2FN names -> float64 function).
ACTIVATIONS = {
    "gelu": _gelu_erf,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": torch.relu,
    "silu": lambda x: x * torch.sigmoid(x),
    "swish": lambda x: x * torch.sigmoid(x),
    "tanh": torch.tanh,
}


@dataclass(frozen=True)
class ScratchModel:
    """What the recomputation reads: plain data, extracted by the runtime's adapter.

    ``family``: ``"gpt2"``, ``"bert"`` or a rotary family (:data:`ROTARY_FAMILIES`; where the
    adapter names the family otherwise, ``config["model_type"]`` decides). ``config``: the model
    config as plain values
    (``PretrainedConfig.to_dict()``). ``weights``: the base model's parameters by their
    Hugging Face state-dict names without the head prefix (``"wte.weight"``,
    ``"h.0.attn.c_attn.weight"``, ``"encoder.layer.0.attention.self.query.weight"``,
    ``"layers.0.self_attn.q_proj.weight"``, ...) and a causal LM's ``"lm_head.weight"``
    ``[vocab, d_model]``, any dtype and device; read, never written (each is cast to float64
    when used).
    """

    family: str
    config: Mapping[str, object]
    weights: Mapping[str, torch.Tensor]
    n_layers: int
    n_heads: int

    @classmethod
    def of(cls, adapter) -> "ScratchModel":
        """From a runtime adapter's ``scratch_weights()`` (plain values; duck-typed, so the
        analysis imports nothing of the runtime)."""
        return cls(**adapter.scratch_weights())


class ServedForward(Protocol):
    """What :func:`verify_from_scratch` compares with (``ForwardResult.tensors``)."""

    pattern: torch.Tensor  # [layer, head, query_pos, key_pos]
    hidden_states: torch.Tensor  # [layer+1, pos, d_model]: embeddings, each block's output
    q: torch.Tensor  # [layer, head, pos, d_head]
    k: torch.Tensor
    v: torch.Tensor
    attn_output: torch.Tensor  # [layer, pos, d_model]
    final_state: torch.Tensor | None  # [pos, d_model] after ln_f (None: no final LayerNorm)


# ------------------------------------------------------------------ support check
#: Rotary-position families recomputed here (config ``model_type`` values).
ROTARY_FAMILIES = ("llama", "mistral", "qwen2", "gemma", "gemma2", "gpt_neox")
#: rope_type values with a formula here (Hugging Face ``rope_parameters["rope_type"]``).
ROPE_TYPES = ("default", "linear", "llama3")
_LAYER_TYPES = ("full_attention", "sliding_attention")


def family_of(m: ScratchModel) -> str:
    """The architecture the recomputation follows: ``m.family`` for GPT-2 and BERT, else the
    config's ``model_type`` where it is a rotary family (an adapter may call Mistral
    ``llama``), else ``m.family``."""
    if m.family in ("gpt2", "bert"):
        return m.family
    mt = m.config.get("model_type")
    return mt if mt in ROTARY_FAMILIES else m.family


def _refuse(key, value, what):
    raise UnsupportedModelConfig(
        f"the from-scratch verification does not implement config.{key} = {value!r} "
        f"({what}); mode 'recorded_qkv' still checks the attention step", "mode")


def rope_parameters(c: Mapping[str, object]) -> dict:
    """The config's rotary parameters as one flat dict (``rope_type``, ``rope_theta``,
    ``partial_rotary_factor`` and the scaling keys): transformers 5's ``rope_parameters``, else
    the older ``rope_scaling`` / ``rope_theta`` / ``rotary_emb_base`` / ``rotary_pct`` keys.
    Raises :class:`UnsupportedModelConfig` for rope parameters per layer type."""
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if not isinstance(rp, Mapping) or any(isinstance(v, Mapping) for v in rp.values()):
        _refuse("rope_parameters", rp, "rotary parameters per layer type")
    out = dict(rp)
    out["rope_type"] = rp.get("rope_type", rp.get("type", "default")) or "default"
    theta = rp.get("rope_theta", c.get("rope_theta", c.get("rotary_emb_base", 10000.0)))
    out["rope_theta"] = float(theta)
    prf = rp.get("partial_rotary_factor",
                 c.get("partial_rotary_factor", c.get("rotary_pct", 1.0)))
    out["partial_rotary_factor"] = float(1.0 if prf is None else prf)
    return out


def head_dim(m: ScratchModel) -> int:
    """d_head: the config's ``head_dim`` (Gemma: not d_model / H), else d_model / H
    (GPT-NeoX always d_model / H, as Hugging Face's ``head_size``)."""
    c = m.config
    d_model = int(c.get("n_embd") or c.get("hidden_size"))
    if family_of(m) in ROTARY_FAMILIES and family_of(m) != "gpt_neox" and c.get("head_dim"):
        return int(c["head_dim"])
    return d_model // m.n_heads


def n_kv_heads(m: ScratchModel) -> int:
    """Key/value heads (grouped-query attention): ``num_key_value_heads``, default H."""
    if family_of(m) not in ROTARY_FAMILIES or family_of(m) == "gpt_neox":
        return m.n_heads
    return int(m.config.get("num_key_value_heads") or m.n_heads)


def kv_head_map(m: ScratchModel) -> list[int]:
    """For each query head h the key/value head it reads: ``h // (H / H_kv)`` (Hugging Face's
    ``repeat_kv``, = ``repeat_interleave`` over the kv heads; Ainslie et al. 2023)."""
    rep = m.n_heads // n_kv_heads(m)
    return [h // rep for h in range(m.n_heads)]


def rotary_dim(m: ScratchModel) -> int:
    """Rotated dims per head: ``int(d_head * partial_rotary_factor)`` (GPT-NeoX ``rotary_pct``;
    the other families rotate every dim)."""
    return int(head_dim(m) * rope_parameters(m.config)["partial_rotary_factor"])


def rope_inv_freq(m: ScratchModel, device=None) -> torch.Tensor:
    """The rotary inverse frequencies ``f_j`` ``[rotary_dim / 2]`` float64 (formula: module
    docstring; rope_type default / linear / llama3; Su et al. 2021)."""
    rp = rope_parameters(m.config)
    r = rotary_dim(m)
    f = 1.0 / rp["rope_theta"] ** (torch.arange(0, r, 2, dtype=torch.float64, device=device) / r)
    kind = rp["rope_type"]
    if kind == "linear":
        f = f / float(rp["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(rp["factor"]), float(rp["low_freq_factor"]), float(rp["high_freq_factor"])
        old = float(rp.get("original_max_position_embeddings")
                    or m.config.get("max_position_embeddings"))
        wavelen = 2 * math.pi / f
        smooth = (old / wavelen - lo) / (hi - lo)
        f = torch.where(wavelen > old / lo, f / factor,
                        torch.where(wavelen < old / hi, f, (1 - smooth) * f / factor + smooth * f))
    return f


#: Relative tolerance of the served rotary frequencies against the config's formula: about
#: 8 float32 ulps (Hugging Face computes them in float32: measured <= 1.2e-7 for default,
#: linear and llama3 at theta 1e4-1e6, d_head 16-256); theta off by 1e-5 relative moves the
#: top frequencies by ~1e-5.
ROPE_FREQ_TOLERANCE = 1e-6


def rope_frequency_diff(m: ScratchModel, served_inv_freq: torch.Tensor) -> tuple[float, float]:
    """``(max_j |served f_j - f_j| / f_j, max_j f_j)``: the served model's rotary inverse
    frequencies (Hugging Face's float32 buffer ``[rotary_dim / 2]``) against
    :func:`rope_inv_freq`'s float64 formula; NaN when their counts differ (never a pass)."""
    ref = rope_inv_freq(m)
    got = served_inv_freq.detach().to("cpu", torch.float64).reshape(-1)
    if got.shape != ref.shape:
        return math.nan, float(ref.max()) if ref.numel() else 0.0
    return float(((got - ref).abs() / ref).max()), float(ref.max())


def layer_windows(m: ScratchModel) -> list[int | None]:
    """Per layer the sliding window w (``key > query - w`` visible) or None (full causal):
    Mistral ``sliding_window`` on every layer; Qwen2, Gemma 2 where ``layer_types[l] ==
    'sliding_attention'``; the other families none."""
    c, fam, L = m.config, family_of(m), m.n_layers
    w = c.get("sliding_window")
    if fam == "mistral":
        return [int(w) if w else None] * L
    if fam in ("qwen2", "gemma2"):
        types = c.get("layer_types") or ["full_attention"] * L
        return [int(w) if t == "sliding_attention" and w else None for t in types[:L]]
    return [None] * L


def check_supported(m: ScratchModel) -> None:
    """Raise :class:`UnsupportedModelConfig` (422) naming the first config switch the
    recomputation does not implement; return None when every switch is implemented."""
    c = m.config
    refuse = _refuse
    fam = family_of(m)
    if fam == "gpt2":
        act = c.get("activation_function", "gelu_new")
        if act not in ACTIVATIONS:
            refuse("activation_function", act, f"implemented: {sorted(ACTIVATIONS)}")
        if c.get("add_cross_attention"):
            refuse("add_cross_attention", True, "cross-attention blocks")
    elif fam == "bert":
        act = c.get("hidden_act", "gelu")
        if not isinstance(act, str) or act not in ACTIVATIONS:
            refuse("hidden_act", act, f"implemented: {sorted(ACTIVATIONS)}")
        pet = c.get("position_embedding_type", "absolute") or "absolute"
        if pet != "absolute":
            refuse("position_embedding_type", pet, "only absolute position embeddings")
        if c.get("is_decoder"):
            refuse("is_decoder", True, "a causal BERT decoder")
        if c.get("add_cross_attention"):
            refuse("add_cross_attention", True, "cross-attention blocks")
    elif fam in ROTARY_FAMILIES:
        key = "hidden_activation" if fam == "gemma2" else "hidden_act"
        act = c.get(key) or (c.get("hidden_act") if fam == "gemma2" else None)
        if not isinstance(act, str) or act not in ACTIVATIONS:
            refuse(key, act, f"implemented: {sorted(ACTIVATIONS)}")
        rp = rope_parameters(c)
        if rp["rope_type"] not in ROPE_TYPES:
            refuse("rope_parameters.rope_type", rp["rope_type"], f"implemented: {list(ROPE_TYPES)}")
        for k in {"linear": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor")}.get(rp["rope_type"], ()):
            if not isinstance(rp.get(k), (int, float)):
                refuse(f"rope_parameters.{k}", rp.get(k), f"rope_type {rp['rope_type']!r} needs a number")
        if fam != "gpt_neox" and rp["partial_rotary_factor"] != 1.0:
            refuse("rope_parameters.partial_rotary_factor", rp["partial_rotary_factor"],
                   f"partial rotary is GPT-NeoX's only; {fam} rotates every dim")
        r = rotary_dim(m)
        if r % 2 or not 0 < r <= head_dim(m):
            refuse("rope_parameters.partial_rotary_factor", rp["partial_rotary_factor"],
                   f"rotary dim {r} of d_head {head_dim(m)} must be even and positive")
        H_kv = n_kv_heads(m)
        if H_kv <= 0 or m.n_heads % H_kv:
            refuse("num_key_value_heads", H_kv, f"must divide num_attention_heads = {m.n_heads}")
        if fam in ("qwen2", "gemma2"):
            bad = [t for t in (c.get("layer_types") or []) if t not in _LAYER_TYPES]
            if bad:
                refuse("layer_types", bad[0], f"implemented: {list(_LAYER_TYPES)}")
        if fam in ("gemma", "gemma2") and c.get("use_bidirectional_attention"):
            refuse("use_bidirectional_attention", True, "bidirectional Gemma attention")
        if c.get("add_cross_attention"):
            refuse("add_cross_attention", True, "cross-attention blocks")
    else:
        refuse("model_type", m.family, f"implemented: gpt2, bert, {', '.join(ROTARY_FAMILIES)}")


def layer_scale(m: ScratchModel, layer: int) -> float:
    """The q.k multiplier of ``layer`` the config implies (GPT-2: 1/sqrt(d_head) when
    ``scale_attn_weights``, else 1, divided by layer+1 when ``scale_attn_by_inverse_layer_idx``;
    BERT and the rotary families: 1/sqrt(d_head); Gemma 2: ``query_pre_attn_scalar^-0.5``)."""
    fam = family_of(m)
    if fam == "gemma2":
        return float(m.config.get("query_pre_attn_scalar") or head_dim(m)) ** -0.5
    if fam == "bert" or fam in ROTARY_FAMILIES:
        return head_dim(m) ** -0.5
    d_head = head_dim(m)
    s = d_head ** -0.5 if m.config.get("scale_attn_weights", True) else 1.0
    if m.config.get("scale_attn_by_inverse_layer_idx", False):
        s /= float(layer + 1)
    return s


# ------------------------------------------------------------------ the recomputation
@dataclass
class LayerState:
    """One layer of the float64 recomputation (all float64, on the compute device)."""

    layer: int
    scale: float
    q: torch.Tensor  # [head, pos, d_head], the projection's output (before RoPE)
    k: torch.Tensor  # [kv_head, pos, d_head] (kv_head = head without GQA), before RoPE
    v: torch.Tensor  # [kv_head, pos, d_head]
    pattern: torch.Tensor  # [head, query_pos, key_pos]
    attn_output: torch.Tensor  # [pos, d_model], after the output projection, pre-residual
    output: torch.Tensor  # [pos, d_model], the block's output (hidden state layer+1)
    q_rot: torch.Tensor | None = None  # [head, pos, d_head] after RoPE (None: absolute positions)
    k_rot: torch.Tensor | None = None  # [kv_head, pos, d_head] after RoPE
    window: int | None = None  # the sliding window of this layer (None: full causal / bidirectional)
    softcap: float | None = None  # the attention-logit soft-cap of this layer (Gemma 2)


@dataclass
class Recomputation:
    """Output of :func:`recompute`: the embeddings, then one :class:`LayerState` per layer
    (lazily, one layer in memory at a time), then ``final`` (read after the layers)."""

    embeddings: torch.Tensor  # [pos, d_model] float64, hidden state 0
    layers: Iterator[LayerState]
    mask: str  # "causal" or "bidirectional"
    final: list = field(default_factory=list)  # [final_state [pos, d_model]] once layers are done
    final_logit_softcap: float | None = None  # Gemma 2: logits = c * tanh(final W_U^T / c)
    kv_map: list[int] | None = None  # query head -> key/value head (None: one kv head per head)


def compute_device(weights: Mapping[str, torch.Tensor]) -> torch.device:
    """The weights' device, or the CPU where it has no float64 (MPS)."""
    dev = next(iter(weights.values())).device
    return torch.device("cpu") if dev.type == "mps" else dev


def _layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)  # biased variance, as torch's LayerNorm
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _rms_norm(x, w, eps, one_plus=False):
    """RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * w`` (Gemma: ``* (1 + w)``)."""
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * (1.0 + w) if one_plus else y * w


def _rope(x, cos, sin, r):
    """RoPE on the first ``r`` dims of ``x`` ``[head, pos, d_head]`` in the half-split layout:
    dim j pairs with dim j + r/2, rotated by angle ``pos * f_j`` (``cos``, ``sin``
    ``[pos, r/2]``); dims >= r unchanged (partial rotary)."""
    half = r // 2
    a, b, rest = x[..., :half], x[..., half:r], x[..., r:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


def _attend(q, k, v, scale, causal, *, kv_map=None, window=None, softcap=None):
    """q ``[head, pos, d_head]``, k, v ``[kv_head, pos, d_head]`` -> (pattern ``[head, q, k]``,
    z ``[pos, head*d_head]``); query head h reads kv head ``kv_map[h]`` (default h)."""
    H, T, dh = q.shape
    if kv_map is not None:  # GQA: each query head's key/value head
        idx = torch.as_tensor(kv_map, device=q.device)
        k, v = k[idx], v[idx]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # 1. compare queries and keys
    if softcap is not None:  # 1b. Gemma 2: scores squashed into (-c, c)
        scores = softcap * torch.tanh(scores / softcap)
    if causal:  # 2. a query never sees a later key (nor, in a window w, one w or more back)
        qi = torch.arange(T, device=q.device)
        hidden = qi[None, :] > qi[:, None]
        if window is not None:
            hidden |= qi[None, :] <= qi[:, None] - window
        scores = scores.masked_fill(hidden, float("-inf"))
    pattern = torch.softmax(scores, dim=-1)  # 3. post-softmax pattern, rows sum to 1
    z = torch.matmul(pattern, v).transpose(0, 1).reshape(T, H * dh)  # 4. heads concatenated
    return pattern, z


def recompute(
    m: ScratchModel,
    input_ids: Sequence[int],
    position_ids: Sequence[int] | None = None,
    *,
    scales: Sequence[float] | None = None,
    kv_map: Sequence[int] | None = None,
    rope_angles_from: torch.Tensor | None = None,
) -> Recomputation:
    """The forward of ``input_ids`` from scratch in float64 (formulas: module docstring).

    Args:
        m: weights and config (see :class:`ScratchModel`); :func:`check_supported` first.
        input_ids: the T token ids as served (framing included).
        position_ids: default ``0..T-1`` (the served forward's, unpadded; RoPE's positions).
        scales: override the per-layer q.k multiplier (tests: a recomputation that ignores a
            config switch); default :func:`layer_scale`.
        kv_map: override the key/value head of each query head (tests: a wrong GQA mapping);
            default :func:`kv_head_map`.
        rope_angles_from: the served model's float32 rotary inverse frequencies
            ``[rotary_dim / 2]`` (rotary families): the angles are then ``pos * f`` rounded as
            Hugging Face's rotary embedding computes them, in float32 (cos/sin still float64),
            instead of exactly (module docstring, "Rotary angles"); check the frequencies
            themselves with :func:`rope_frequency_diff`. None: exact float64 angles.

    Returns a :class:`Recomputation` whose ``layers`` iterator computes one layer per step.

    Raises:
        UnsupportedModelConfig: a config switch not implemented (:func:`check_supported`).
    """
    check_supported(m)
    if family_of(m) in ROTARY_FAMILIES:
        return _recompute_rotary(m, input_ids, position_ids, scales, kv_map, rope_angles_from)
    W = m.weights
    dev = compute_device(W)
    f64 = torch.float64

    def w(name):
        return W[name].detach().to(dev, f64)

    ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=dev)
    T = len(ids)
    pos = (torch.arange(T, device=dev) if position_ids is None
           else torch.as_tensor(list(position_ids), dtype=torch.long, device=dev))
    c = m.config
    H = m.n_heads
    scales = [layer_scale(m, i) for i in range(m.n_layers)] if scales is None else list(scales)
    out = Recomputation(embeddings=None, layers=iter(()), mask="")  # filled below

    if family_of(m) == "gpt2":
        eps = float(c.get("layer_norm_epsilon", 1e-5))
        act = ACTIVATIONS[c.get("activation_function", "gelu_new")]
        # gather the rows first: the [vocab, d_model] matrix is never cast whole
        h = W["wte.weight"].detach()[ids.to(W["wte.weight"].device)].to(dev, f64)
        h = h + W["wpe.weight"].detach()[pos.to(W["wpe.weight"].device)].to(dev, f64)
        out.embeddings, out.mask = h, "causal"

        def layers():
            x_res = h
            for i in range(m.n_layers):
                p = f"h.{i}."
                x = _layer_norm(x_res, w(p + "ln_1.weight"), w(p + "ln_1.bias"), eps)
                qkv = x @ w(p + "attn.c_attn.weight") + w(p + "attn.c_attn.bias")  # Conv1D
                D = x.shape[-1]
                q, k, v = (t.reshape(T, H, D // H).transpose(0, 1) for t in qkv.split(D, dim=-1))
                pattern, z = _attend(q, k, v, scales[i], causal=True)
                a = z @ w(p + "attn.c_proj.weight") + w(p + "attn.c_proj.bias")
                r = x_res + a
                y = _layer_norm(r, w(p + "ln_2.weight"), w(p + "ln_2.bias"), eps)
                y = act(y @ w(p + "mlp.c_fc.weight") + w(p + "mlp.c_fc.bias"))
                x_res = r + (y @ w(p + "mlp.c_proj.weight") + w(p + "mlp.c_proj.bias"))
                yield LayerState(i, scales[i], q, k, v, pattern, a, x_res)
            out.final.append(_layer_norm(x_res, w("ln_f.weight"), w("ln_f.bias"), eps))

    else:  # bert
        eps = float(c.get("layer_norm_eps", 1e-12))
        act = ACTIVATIONS[c.get("hidden_act", "gelu")]
        pre = "embeddings."
        e = W[pre + "word_embeddings.weight"].detach()
        h = e[ids.to(e.device)].to(dev, f64)
        pe = W[pre + "position_embeddings.weight"].detach()
        h = h + pe[pos.to(pe.device)].to(dev, f64)
        h = h + W[pre + "token_type_embeddings.weight"].detach()[0].to(dev, f64)  # type 0
        h = _layer_norm(h, w(pre + "LayerNorm.weight"), w(pre + "LayerNorm.bias"), eps)
        out.embeddings, out.mask = h, "bidirectional"

        def lin(x, name):  # nn.Linear: y = x @ W^T + b
            return x @ w(name + ".weight").t() + w(name + ".bias")

        def layers():
            x_res = h
            for i in range(m.n_layers):
                p = f"encoder.layer.{i}."
                D = x_res.shape[-1]
                q, k, v = (lin(x_res, p + "attention.self." + n).reshape(T, H, D // H).transpose(0, 1)
                           for n in ("query", "key", "value"))
                pattern, z = _attend(q, k, v, scales[i], causal=False)
                a_proj = lin(z, p + "attention.output.dense")
                a = _layer_norm(a_proj + x_res, w(p + "attention.output.LayerNorm.weight"),
                                w(p + "attention.output.LayerNorm.bias"), eps)
                y = act(lin(a, p + "intermediate.dense"))
                x_res = _layer_norm(lin(y, p + "output.dense") + a, w(p + "output.LayerNorm.weight"),
                                    w(p + "output.LayerNorm.bias"), eps)
                yield LayerState(i, scales[i], q, k, v, pattern, a_proj, x_res)
            out.final.append(x_res)

    out.layers = layers()
    return out


def _recompute_rotary(m, input_ids, position_ids, scales, kv_map, rope_angles_from=None) -> Recomputation:
    """:func:`recompute` for :data:`ROTARY_FAMILIES` (formulas: module docstring)."""
    W, c, fam = m.weights, m.config, family_of(m)
    dev = compute_device(W)
    f64 = torch.float64
    pre = "model." if "embed_tokens.weight" not in W and "model.embed_tokens.weight" in W else ""
    if fam == "gpt_neox" and "embed_in.weight" not in W and "gpt_neox.embed_in.weight" in W:
        pre = "gpt_neox."

    def w(name):
        return W[pre + name].detach().to(dev, f64)

    def lin(x, name):  # nn.Linear: y = x @ W^T (+ b where the state dict has one)
        y = x @ w(name + ".weight").t()
        return y + w(name + ".bias") if pre + name + ".bias" in W else y

    ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=dev)
    T = len(ids)
    pos = (torch.arange(T, device=dev) if position_ids is None
           else torch.as_tensor(list(position_ids), dtype=torch.long, device=dev)).to(f64)
    H, H_kv, dh, r = m.n_heads, n_kv_heads(m), head_dim(m), rotary_dim(m)
    kv = list(kv_head_map(m) if kv_map is None else kv_map)
    scales = [layer_scale(m, i) for i in range(m.n_layers)] if scales is None else list(scales)
    windows = layer_windows(m)
    gemma = fam in ("gemma", "gemma2")
    softcap = c.get("attn_logit_softcapping") if fam == "gemma2" else None
    softcap = float(softcap) if softcap else None
    act = ACTIVATIONS[c.get("hidden_activation") if fam == "gemma2" and c.get("hidden_activation")
                      else c.get("hidden_act")]
    if rope_angles_from is None:  # exact: pos * f_j in float64
        angle = pos[:, None] * rope_inv_freq(m, dev)[None, :]  # [pos, r/2]
    else:  # as Hugging Face rounds it: float32 pos times its float32 f_j, one float32 product
        f32 = rope_angles_from.detach().to(dev, torch.float32).reshape(-1)
        if f32.numel() != r // 2:
            raise ValueError(f"rope_angles_from has {f32.numel()} frequencies; rotary_dim {r} needs {r // 2}")
        angle = (pos.to(torch.float32)[:, None] * f32[None, :]).to(f64)
    cos, sin = angle.cos(), angle.sin()

    emb_name = "embed_in.weight" if fam == "gpt_neox" else "embed_tokens.weight"
    E = W[pre + emb_name].detach()
    h = E[ids.to(E.device)].to(dev, f64)  # the rows first: [vocab, d_model] is never cast whole
    if gemma:
        h = h * math.sqrt(float(c["hidden_size"]))
    if fam == "gpt_neox":
        eps = float(c.get("layer_norm_eps", 1e-5))

        def norm(x, name):
            return _layer_norm(x, w(name + ".weight"), w(name + ".bias"), eps)
    else:
        eps = float(c.get("rms_norm_eps", 1e-6))

        def norm(x, name):
            return _rms_norm(x, w(name + ".weight"), eps, one_plus=gemma)

    out = Recomputation(embeddings=h, layers=iter(()), mask="causal", kv_map=kv)
    if fam == "gemma2" and c.get("final_logit_softcapping"):
        out.final_logit_softcap = float(c["final_logit_softcapping"])

    def heads(x, n):  # [pos, n * d_head] -> [n, pos, d_head]
        return x.reshape(T, n, dh).transpose(0, 1)

    def layers():
        x_res = h
        for i in range(m.n_layers):
            p = f"layers.{i}."
            x = norm(x_res, p + "input_layernorm")
            if fam == "gpt_neox":  # fused: [pos, head, 3 * d_head], q | k | v within each head
                qkv = lin(x, p + "attention.query_key_value").reshape(T, H, 3 * dh).transpose(0, 1)
                q, k, v = qkv.split(dh, dim=-1)
                o_name = p + "attention.dense"
            else:
                q = heads(lin(x, p + "self_attn.q_proj"), H)
                k = heads(lin(x, p + "self_attn.k_proj"), H_kv)
                v = heads(lin(x, p + "self_attn.v_proj"), H_kv)
                o_name = p + "self_attn.o_proj"
            q_rot, k_rot = _rope(q, cos, sin, r), _rope(k, cos, sin, r)
            pattern, z = _attend(q_rot, k_rot, v, scales[i], True,
                                 kv_map=None if kv == list(range(H)) else kv,
                                 window=windows[i], softcap=softcap)
            a = lin(z, o_name)
            if fam == "gpt_neox":
                if c.get("use_parallel_residual", True):
                    y = norm(x_res, p + "post_attention_layernorm")
                    x_new = x_res + a + lin(act(lin(y, p + "mlp.dense_h_to_4h")), p + "mlp.dense_4h_to_h")
                else:
                    r_ = x_res + a
                    y = norm(r_, p + "post_attention_layernorm")
                    x_new = r_ + lin(act(lin(y, p + "mlp.dense_h_to_4h")), p + "mlp.dense_4h_to_h")
            else:
                if fam == "gemma2":
                    r_ = x_res + norm(a, p + "post_attention_layernorm")
                    y = norm(r_, p + "pre_feedforward_layernorm")
                else:
                    r_ = x_res + a
                    y = norm(r_, p + "post_attention_layernorm")
                y = lin(act(lin(y, p + "mlp.gate_proj")) * lin(y, p + "mlp.up_proj"), p + "mlp.down_proj")
                if fam == "gemma2":
                    y = norm(y, p + "post_feedforward_layernorm")
                x_new = r_ + y
            x_res = x_new
            yield LayerState(i, scales[i], q, k, v, pattern, a, x_res, q_rot=q_rot, k_rot=k_rot,
                             window=windows[i], softcap=softcap)
        out.final.append(norm(x_res, "final_layer_norm" if fam == "gpt_neox" else "norm"))

    out.layers = layers()
    return out


# ------------------------------------------------------------------ the comparison
def _maxdiff(served: torch.Tensor, ref: torch.Tensor, dims=None) -> torch.Tensor:
    """max |served - ref| in float64 (NaN if either holds a NaN), over all or over ``dims``."""
    d = (served.to(ref.device, torch.float64) - ref).abs()
    if dims is None:
        return d.max() if d.numel() else torch.zeros((), dtype=torch.float64, device=ref.device)
    return d.amax(dim=dims)


def _scale(ref: torch.Tensor) -> torch.Tensor:
    return ref.abs().max() if ref.numel() else torch.zeros((), dtype=ref.dtype, device=ref.device)


def _num(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def _fmt(x: float | None) -> str:
    return "NaN" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"


def _ok(d: float, limit: float) -> bool:
    return math.isfinite(d) and d <= limit


def verify_from_scratch(
    served: ServedForward,
    m: ScratchModel,
    input_ids: Sequence[int],
    dtype: str,
    layers: Sequence[int] | None = None,
    tolerance: float | None = None,
    *,
    position_ids: Sequence[int] | None = None,
    scales: Sequence[float] | None = None,
    kv_map: Sequence[int] | None = None,
    logits: torch.Tensor | None = None,
    served_inv_freq: torch.Tensor | None = None,
) -> dict:
    """Compare a served forward with the float64 recomputation, layer by layer, then the
    served logits with the LM head applied to the recomputed final state.

    Args:
        served: the recorded forward of ``input_ids`` (``ForwardResult.tensors``).
        m: the model's weights and config (:class:`ScratchModel`).
        input_ids: the T token ids the served forward ran on.
        dtype: the served (model) dtype name, picks :data:`TOLERANCES`.
        layers: layers to report (default all); every layer is recomputed regardless (each
            needs the one before), the embeddings and the final state are always checked.
        tolerance: overrides BOTH tolerances of the dtype (pattern absolute, states relative).
        position_ids, scales, kv_map: see :func:`recompute` (tests plant faults with them).
        served_inv_freq: rotary families, the served model's rotary inverse frequencies
            (Hugging Face's float32 ``inv_freq`` buffer ``[rotary_dim / 2]``, what its forward
            and the hooked forward rotate with): checked against the config's formula
            (``rotary``, relative, :data:`ROPE_FREQ_TOLERANCE`), then the recomputation's
            angles are ``pos * f`` rounded as Hugging Face computes them (one float32 product;
            module docstring, "Rotary angles"). None: not checked, exact float64 angles.
        logits: the served next-token logits ``[pos, vocab]`` of ``input_ids`` (the hooked
            forward's, what /v1/predictions, /v1/ablate, /v1/patch and /v1/run read), compared
            with ``final @ W_U^T`` in float64 (``W_U`` = the weights' ``lm_head.weight``
            ``[vocab, d_model]``), relative to ``max(1, max |recomputed logit|)`` against the
            dtype's logits tolerance; None (or no ``lm_head.weight``): not checked.

    Returns a dict (schemas/verify.py ``VerifyResult``): ``mode`` "from_scratch", ``passed``,
    ``max_abs_diff`` (largest pattern difference, probability units; None = NaN),
    ``max_rel_diff`` (largest state difference / max(1, scale)), ``tolerance`` (pattern),
    ``state_tolerance`` (relative), ``dtype``, ``compute_dtype`` "float64", ``mask``,
    ``failed_layers``, ``failing_layer`` (first, or None; -1 never: the embeddings fail as
    ``"embeddings"`` in the message and layer 0), ``message``, ``embeddings`` and ``final``
    state diffs, ``rotary`` (``{max_rel_diff, max_frequency, tolerance, passed}`` of the
    served frequencies, or None), ``architecture`` (:func:`architecture`), and per layer ``{layer, scale,
    window, softcap, pattern_max_abs_diff, heads: [{head, pattern_max_abs_diff}],
    q/k/v/output/hidden _max_abs_diff, hidden_scale, passed}`` (q, k compared after RoPE for
    the rotary families, k and v on their key/value heads ``[kv_head, pos, d_head]``; a served
    tensor of another shape is a NaN difference, a failure).
    Differences are the true maxima (0 only where they are exactly 0).

    Raises:
        UnsupportedModelConfig: a config switch the recomputation does not implement.
    """
    tol_p, tol_s, tol_l = TOLERANCES.get(dtype, TOLERANCES["float32"])
    if tolerance is not None:
        tol_p = tol_s = tol_l = float(tolerance)
    want = set(range(m.n_layers) if layers is None else layers)
    T = len(input_ids)
    with torch.inference_mode():
        rotary_out = None
        if served_inv_freq is not None and family_of(m) in ROTARY_FAMILIES:
            d, top = rope_frequency_diff(m, served_inv_freq)
            rotary_out = {"max_rel_diff": _num(d), "max_frequency": top,
                          "tolerance": ROPE_FREQ_TOLERANCE, "passed": _ok(d, ROPE_FREQ_TOLERANCE)}
            if math.isnan(d):  # another count of frequencies: exact angles, reported failed
                served_inv_freq = None
        rc = recompute(m, input_ids, position_ids, scales=scales, kv_map=kv_map,
                       rope_angles_from=served_inv_freq if family_of(m) in ROTARY_FAMILIES else None)
        checks: list[tuple[int, str, torch.Tensor, torch.Tensor | None]] = []  # layer, what, diff, scale
        extras: dict[int, dict] = {}  # layer -> its window and soft-cap
        checks.append((-1, "embeddings", _maxdiff(served.hidden_states[0], rc.embeddings),
                       _scale(rc.embeddings)))
        per_layer: list[tuple[LayerState, torch.Tensor]] = []
        for st in rc.layers:
            i = st.layer
            if i in want:
                head_d = _maxdiff(served.pattern[i], st.pattern, dims=(-2, -1))  # [head]
                per_layer.append((st.layer, st.scale, head_d))
                extras[i] = {"window": st.window, "softcap": st.softcap}
                # rotary families record q and k AFTER RoPE, k and v on the key/value heads
                # (service/runtime/adapters.py); GPT-2/BERT the projections' outputs
                q_ref = st.q if st.q_rot is None else st.q_rot
                k_ref = st.k if st.k_rot is None else st.k_rot
                for name, ref in (("q", q_ref), ("k", k_ref), ("v", st.v),
                                  ("attention output", st.attn_output)):
                    got = getattr(served, _FIELD[name])[i]
                    if name in ("k", "v") and rc.kv_map is not None and got.shape[0] != ref.shape[0]:
                        ref = ref[torch.as_tensor(rc.kv_map, device=ref.device)]  # served per query head
                    checks.append((i, name, _maxdiff(got, ref) if got.shape == ref.shape
                                   else _nan(ref), _scale(ref)))
            # every block output is checked (a fault upstream of a reported layer is named)
            checks.append((i, "hidden state", _maxdiff(served.hidden_states[i + 1], st.output),
                           _scale(st.output)))
        final = rc.final[0]
        fs = served.final_state if getattr(served, "final_state", None) is not None else None
        if fs is not None:
            checks.append((m.n_layers, "final state", _maxdiff(fs, final), _scale(final)))
        unembed = m.weights.get("lm_head.weight")
        if logits is not None and unembed is not None:
            checks.append((m.n_layers + 1, "logits",
                           *_logits_diff(logits, final, unembed, softcap=rc.final_logit_softcap)))
        # one transfer of every number (no device sync per layer)
        flat = torch.cat([torch.cat([d.reshape(-1), s.reshape(-1)]) for _, _, d, s in checks]
                         + [hd.reshape(-1) for _, _, hd in per_layer]).cpu().tolist()

    n = 2 * len(checks)
    state = {}  # (layer, what) -> (diff, scale)
    for j, (layer, what, _, _) in enumerate(checks):
        state[(layer, what)] = (flat[2 * j], flat[2 * j + 1])
    heads_of = {}
    for layer, scale, hd in per_layer:
        heads_of[layer] = flat[n: n + hd.numel()]
        n += hd.numel()

    def rel(d, s):
        return d / max(1.0, s)

    failures: list[tuple[int, str]] = []  # (layer, description), in forward order
    d_emb, s_emb = state[(-1, "embeddings")]
    emb_ok = _ok(rel(d_emb, s_emb), tol_s)
    if not emb_ok:
        failures.append((0, f"embeddings (hidden state 0) differ by {_fmt(d_emb)} "
                            f"(scale {s_emb:.3g})"))
    if rotary_out is not None and not rotary_out["passed"]:
        failures.append((0, f"rotary frequencies (inv_freq) differ from the config's by "
                            f"{_fmt(rotary_out['max_rel_diff'])} relative (tolerance "
                            f"{ROPE_FREQ_TOLERANCE:g})"))
    layers_out = []
    all_pat, all_rel = [], [rel(d_emb, s_emb)]
    failed = set() if emb_ok and (rotary_out is None or rotary_out["passed"]) else {0}
    for layer, scale, _ in per_layer:
        heads = heads_of[layer]
        all_pat.extend(heads)
        bad_heads = [h for h, d in enumerate(heads) if not _ok(d, tol_p)]
        what = []
        if bad_heads:
            h = bad_heads[0]
            what.append(f"pattern of head {h} differs by {_fmt(heads[h])} (heads failing: {bad_heads})")
        row = {"layer": layer, "scale": scale, **extras.get(layer, {}),
               "pattern_max_abs_diff": _num(max(heads) if not any(map(math.isnan, heads)) else math.nan),
               "heads": [{"head": h, "pattern_max_abs_diff": _num(d)} for h, d in enumerate(heads)]}
        for name in ("q", "k", "v", "attention output", "hidden state"):
            d, s = state[(layer, name)]
            all_rel.append(rel(d, s))
            if not _ok(rel(d, s), tol_s):
                what.append(f"{name} differs by {_fmt(d)} (scale {s:.3g})")
            row[_KEY[name]] = _num(d)
        row["hidden_scale"] = state[(layer, "hidden state")][1]
        row["passed"] = not what
        if what:
            failed.add(layer)
            failures.append((layer, "; ".join(what)))
        layers_out.append(row)
    # hidden states of layers not reported still count (a fault upstream of a reported layer)
    for layer in range(m.n_layers):
        if layer in want:
            continue
        d, s = state[(layer, "hidden state")]
        all_rel.append(rel(d, s))
        if not _ok(rel(d, s), tol_s):
            failed.add(layer)
            failures.append((layer, f"hidden state differs by {_fmt(d)} (scale {s:.3g})"))
    final_out = None
    if (m.n_layers, "final state") in state:
        d, s = state[(m.n_layers, "final state")]
        all_rel.append(rel(d, s))
        final_out = {"max_abs_diff": _num(d), "scale": s, "passed": _ok(rel(d, s), tol_s)}
        if not final_out["passed"]:
            failures.append((m.n_layers, f"final LayerNorm output differs by {_fmt(d)} (scale {s:.3g})"))
    logits_out = None
    if (m.n_layers + 1, "logits") in state:
        d, s = state[(m.n_layers + 1, "logits")]
        all_rel.append(rel(d, s))
        logits_out = {"max_abs_diff": _num(d), "scale": _num(s), "passed": _ok(rel(d, s), tol_l),
                      "tolerance": tol_l}
        if not logits_out["passed"]:
            failures.append((m.n_layers + 1, f"LM head logits differ by {_fmt(d)} (scale {s:.3g}, "
                                             f"tolerance {tol_l:g} relative)"))
    failures.sort(key=lambda f: f[0])
    if layers is not None:  # reported in the order requested
        order = {layer: i for i, layer in enumerate(layers)}
        layers_out.sort(key=lambda row: order[row["layer"]])
    passed = not failures
    max_p = math.nan if any(map(math.isnan, all_pat)) else (max(all_pat) if all_pat else 0.0)
    max_r = math.nan if any(map(math.isnan, all_rel)) else max(all_rel)
    if passed:
        message = (f"passed: embeddings, {len(layers_out)} layer(s)"
                   f"{', the final LayerNorm' if final_out else ''}"
                   f"{' and the LM head logits' if logits_out else ''} match the float64 "
                   f"recomputation (pattern max diff {_fmt(max_p)}, tolerance {tol_p:g}; states "
                   f"max relative diff {_fmt(max_r)}, tolerance {tol_s:g})")
    else:
        layer, what = failures[0]
        where = ("LM head" if layer == m.n_layers + 1 else
                 "final LayerNorm" if layer == m.n_layers else f"layer {layer}")
        message = (f"failed: first at {where}: {what}; pattern tolerance {tol_p:g}, state "
                   f"tolerance {tol_s:g} (relative to max(1, scale))")
    return {
        "mode": "from_scratch",
        "projections": False,
        "passed": passed,
        "max_abs_diff": _num(max_p),
        "max_rel_diff": _num(max_r),
        "tolerance": tol_p,
        "state_tolerance": tol_s,
        "dtype": dtype,
        "compute_dtype": "float64",
        "mask": rc.mask,
        "n_tokens": T,
        "failed_layers": sorted(x for x in failed if x < m.n_layers),
        "failing_layer": None if passed else (failures[0][0] if failures[0][0] < m.n_layers else None),
        "message": message,
        "embeddings": {"max_abs_diff": _num(d_emb), "scale": s_emb, "passed": emb_ok},
        "rotary": rotary_out,
        "final": final_out,
        "logits": logits_out,
        "layers": layers_out,
        "architecture": architecture(m, rc.final_logit_softcap),
    }


def architecture(m: ScratchModel, final_logit_softcap: float | None = None) -> dict:
    """What the recomputation implemented for this model (schemas/verify.py
    ``RecomputedArchitecture``): family, positions, rotary facts, kv heads and the query ->
    key/value head map, the norm, the MLP, the residual form, soft-caps and windows."""
    fam = family_of(m)
    rotary = fam in ROTARY_FAMILIES
    rp = rope_parameters(m.config) if rotary else {}
    c = m.config
    return {
        "family": fam,
        "positions": "rotary" if rotary else "learned_absolute",
        "rope_theta": rp.get("rope_theta"),
        "rope_type": rp.get("rope_type"),
        "rotary_dim": rotary_dim(m) if rotary else None,
        "d_head": head_dim(m),
        "n_kv_heads": n_kv_heads(m),
        "kv_head_of_query_head": kv_head_map(m),
        "norm": ("layernorm" if fam in ("gpt2", "bert", "gpt_neox") else
                 "rmsnorm_1p" if fam in ("gemma", "gemma2") else "rmsnorm"),
        "embed_scale": math.sqrt(float(c["hidden_size"])) if fam in ("gemma", "gemma2") else None,
        "mlp": "gated" if rotary and fam != "gpt_neox" else "plain",
        "parallel_residual": bool(fam == "gpt_neox" and c.get("use_parallel_residual", True)),
        "sliding_window_layers": layer_windows(m) if rotary else [None] * m.n_layers,
        "attn_logit_softcap": (float(c["attn_logit_softcapping"]) if fam == "gemma2"
                               and c.get("attn_logit_softcapping") else None),
        "final_logit_softcap": final_logit_softcap,
    }


def _nan(ref: torch.Tensor) -> torch.Tensor:  # a served tensor of another shape: never a pass
    return torch.tensor(math.nan, dtype=torch.float64, device=ref.device)


def _logits_diff(served: torch.Tensor, final: torch.Tensor, unembed: torch.Tensor,
                 chunk: int = 8192, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max |served - final @ W_U^T|, max |final @ W_U^T|)`` in float64 (0-d tensors):
    ``served`` ``[pos, vocab]`` logits, ``final`` ``[pos, d_model]`` float64 (the recomputed
    ln_f output), ``unembed`` ``W_U`` ``[vocab, d_model]``, cast to float64 ``chunk`` vocabulary
    rows at a time (never the whole matrix: 309 MB for GPT-2's); ``softcap`` c (Gemma 2's
    final_logit_softcapping): the recomputed logits are ``c * tanh(logits / c)``."""
    nan = torch.tensor(math.nan, dtype=torch.float64, device=final.device)
    if tuple(served.shape) != (final.shape[0], unembed.shape[0]):  # never a pass
        return nan, nan
    diffs, scales = [], []
    for a in range(0, unembed.shape[0], chunk):
        ref = final @ unembed[a:a + chunk].detach().to(final.device, torch.float64).t()
        if softcap is not None:
            ref = softcap * torch.tanh(ref / softcap)
        diffs.append(_maxdiff(served[:, a:a + chunk], ref))
        scales.append(_scale(ref))
    return torch.stack(diffs).max(), torch.stack(scales).max()


_FIELD = {"q": "q", "k": "k", "v": "v", "attention output": "attn_output"}
_KEY = {"q": "q_max_abs_diff", "k": "k_max_abs_diff", "v": "v_max_abs_diff",
        "attention output": "output_max_abs_diff", "hidden state": "hidden_max_abs_diff"}
