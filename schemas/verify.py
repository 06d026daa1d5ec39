"""POST /v1/verify: the served forward against a from-scratch recomputation.

Mode ``from_scratch`` (default): the whole forward recomputed in float64 from the token ids,
the model's weight tensors and its config, with the project's own blocks (embeddings and
positions, LayerNorm, q/k/v, the scale the config implies, the mask, softmax, the output
projection, MLP, residuals), compared layer by layer with the served attention patterns,
q/k/v, attention outputs and hidden states (docs/architecture.md, "Verification"; S000's
``attention(Q, K, V, mask)``, S001's multi-head split). Mode ``recorded_qkv``: the cheaper
consistency check of the attention step alone, from the q/k/v the forward recorded.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from .common import MAX_INDICES, LenientModel, ModelRef, TextOrTexts, Token, equals, index_list, when
from .common import add_bos_echo

VerifyMode = Literal["from_scratch", "recorded_qkv"]

class VerifyRequest(TextOrTexts):
    """Recompute the forward from scratch (float64, from the weights) and compare it, layer by
    layer, with what the service serves for the text."""

    json_rules = (when(equals("projections", True, False),
                       equals("mode", "recorded_qkv", "from_scratch")),)

    mode: VerifyMode = Field(
        "from_scratch",
        description="'from_scratch' (default): the whole forward recomputed in float64 from "
        "the token ids, the model's weight tensors and its config, compared with the served "
        "patterns, q/k/v, attention outputs and hidden states; it can disagree with the model "
        "(a wrong weight, position, scale, mask, LayerNorm or MLP shows at its layer). "
        "Implements GPT-2, BERT, Llama, Mistral, Qwen2, Gemma, Gemma 2 and GPT-NeoX (RoPE with "
        "theta, rope_type default/linear/llama3 and partial rotary, grouped-query attention, "
        "RMSNorm, gated MLPs, parallel residual, sliding windows, soft-caps); a config switch "
        "it does not implement is a 422 "
        "unsupported_model_config naming the switch. Cost: a few forwards (README). "
        "'recorded_qkv': only the attention step re-run from the q/k/v the forward recorded, "
        "in the model's dtype with the same torch operations (differences are usually exactly 0; "
        "it cannot see anything upstream of q/k/v).",
    )

    layers: list[int] | None = Field(
        None, max_length=MAX_INDICES, fail_fast=True, json_schema_extra=index_list("layer"),
        description="Layer indices to report (0-based, each < n_layers, each at most "
        f"once; at most {MAX_INDICES}); null = all. from_scratch recomputes every layer regardless and always checks "
        "every hidden state (a fault upstream of a reported layer is still named)."
    )
    tolerance: float | None = Field(
        None, gt=0, le=1,
        description="Override of the tolerance. from_scratch: null = per the served dtype, "
        "pattern (absolute, probability units) / states (q, k, v, attention output, hidden "
        "states: max |diff| <= tol * max(1, max |recomputed|)) / logits (relative to max(1, "
        "max |logit|)): float32 1e-4 / 1e-4 / 1e-4, float16 2.5e-2 / 1e-2 / 1e-2, bfloat16 "
        "1.2e-1 / 5e-2 / 5e-2 (measured drift: README 'Numerical precision'); a value given "
        "here sets all three. recorded_qkv: null = 1e-5 for float32 models, 1e-2 for "
        "float16/bfloat16 (absolute).",
    )
    projections: bool = Field(
        False, description="Mode 'recorded_qkv' only (422 with from_scratch, which always "
        "recomputes q/k/v from the weights). Also recompute q, k and v from the recorded attention input with "
        "the model's CURRENT q/k/v weights and compare them with the model's own (per layer "
        "'qkv_max_abs_diff', counts toward 'passed'). The default starts from the model's "
        "recorded q/k/v, so it does not see a q/k/v weight change made after the forward. "
        "Cost: three more d_model x d_model matmuls per layer, about 3x the default's time "
        "(GPT-2 small, 128 tokens, 2 CPU cores: ~20 ms default, ~60 ms with projections).",
    )

    @field_validator("projections")
    @classmethod
    def _projections_need_recorded_qkv(cls, v, info):
        if v and info.data.get("mode", "from_scratch") != "recorded_qkv":
            raise ValueError("projections applies to mode 'recorded_qkv' only; mode "
                             "'from_scratch' recomputes q, k and v from the weights anyway")
        return v


class HeadDiff(LenientModel):
    head: int = Field(description="Head index.")
    pattern_max_abs_diff: float | None = Field(
        description="max |recomputed - model| over this head's pattern [query_pos, key_pos]; "
        "probability units, >= 0; null = NaN (fails)."
    )


class StateDiff(LenientModel):
    max_abs_diff: float | None = Field(
        description="max |served - recomputed| over [pos, d_model], model units; null = NaN.")
    scale: float = Field(description="max |recomputed| of the state (model units); the state "
                         "passes when max_abs_diff <= state_tolerance * max(1, scale).")
    passed: bool = Field(description="Within the state tolerance.")


class LogitsDiff(LenientModel):
    max_abs_diff: float | None = Field(
        description="max |served logit - recomputed logit| over [pos, vocab], logit units; "
        "null = NaN (or a logits tensor of another shape).")
    scale: float | None = Field(
        description="max |recomputed logit|: the logits pass when max_abs_diff <= tolerance * "
        "max(1, scale); null = NaN.")
    tolerance: float = Field(description="The relative tolerance of the logits used (the "
                             "served dtype's, or the request's tolerance).")
    passed: bool = Field(description="Within the logits tolerance (a NaN fails).")


class RotaryDiff(LenientModel):
    max_rel_diff: float | None = Field(
        description="max_j |served f_j - f_j| / f_j: the served model's rotary inverse "
        "frequencies (its float32 buffer, what its forward rotates q and k with) against the "
        "config's formula in float64 (theta, rope_type, rotary dim); null = NaN (another "
        "number of frequencies).")
    max_frequency: float = Field(description="The largest frequency f_0 (radians per position).")
    tolerance: float = Field(description="The relative tolerance (about 8 float32 ulps; fixed, "
                             "the request's tolerance does not change it).")
    passed: bool = Field(description="Within the tolerance (a wrong theta, scaling or rotary dim "
                         "fails here, named as at layer 0).")


class RecomputedArchitecture(LenientModel):
    """What the from-scratch recomputation implemented for the resident model (from its config)."""

    family: str = Field(description="The architecture followed: gpt2, bert, llama, mistral, "
                        "qwen2, gemma, gemma2 or gpt_neox.")
    positions: Literal["learned_absolute", "rotary"] = Field(
        description="learned_absolute: a position-embedding table added to the token "
        "embeddings (GPT-2, BERT); rotary: RoPE on q and k (Su et al. 2021).")
    rope_theta: float | None = Field(None, description="RoPE base theta: frequency f_j = "
                                     "theta^(-2j/rotary_dim); null without rotary.")
    rope_type: str | None = Field(None, description="'default', 'linear' (f_j / factor) or "
                                  "'llama3' (Llama 3.1's per-wavelength scaling); null without rotary.")
    rotary_dim: int | None = Field(None, description="Rotated dimensions per head (the first "
                                   "rotary_dim of d_head, half-split layout; GPT-NeoX: "
                                   "d_head * rotary_pct); null without rotary.")
    d_head: int = Field(description="Dimensions per head.")
    n_kv_heads: int = Field(description="Key/value heads per layer (fewer than the query heads "
                            "under grouped-query attention, Ainslie et al. 2023).")
    kv_head_of_query_head: list[int] = Field(
        description="Per query head h, the key/value head it reads: h // (n_heads / "
        "n_kv_heads) (Hugging Face's repeat_kv).")
    norm: Literal["layernorm", "rmsnorm", "rmsnorm_1p"] = Field(
        description="layernorm: (x - mean) / sqrt(var + eps) * w + b; rmsnorm: x / sqrt(mean(x^2) "
        "+ eps) * w (Zhang & Sennrich 2019); rmsnorm_1p: Gemma's, * (1 + w).")
    embed_scale: float | None = Field(None, description="The token embeddings' multiplier "
                                      "(Gemma: sqrt(d_model)); null = 1.")
    mlp: Literal["plain", "gated"] = Field(
        description="plain: out(act(in(x))); gated: down(act(gate(x)) * up(x)) (SwiGLU / GeGLU, "
        "Shazeer 2020).")
    parallel_residual: bool = Field(description="GPT-NeoX use_parallel_residual: h + attn(LN1(h)) "
                                    "+ mlp(LN2(h)) instead of two residual steps.")
    sliding_window_layers: list[int | None] = Field(
        description="Per layer the sliding window w (a query sees the w latest keys, itself "
        "included; Beltagy et al. 2020, Jiang et al. 2023) or null (every earlier key).")
    attn_logit_softcap: float | None = Field(
        None, description="Gemma 2's attention soft-cap c: scores -> c * tanh(scores / c) before "
        "the mask; null = none.")
    final_logit_softcap: float | None = Field(
        None, description="Gemma 2's final-logit soft-cap c: logits -> c * tanh(logits / c); "
        "null = none.")


class LayerDiff(LenientModel):
    layer: int = Field(description="Layer index.")
    scale: float | None = Field(
        None, description="from_scratch: the q.k multiplier used for this layer, derived from "
        "the config (GPT-2: 1/sqrt(d_head) if scale_attn_weights else 1, divided by layer+1 "
        "if scale_attn_by_inverse_layer_idx; BERT and the rotary families: 1/sqrt(d_head); "
        "Gemma 2: query_pre_attn_scalar^-0.5).")
    window: int | None = Field(
        None, description="from_scratch: this layer's sliding window w (keys query_pos - w < "
        "key_pos <= query_pos visible), from the config; null = full attention.")
    softcap: float | None = Field(
        None, description="from_scratch: this layer's attention-logit soft-cap c (Gemma 2); "
        "null = none.")
    q_max_abs_diff: float | None = Field(
        None, description="from_scratch: max |served - recomputed| of the layer's queries "
        "[head, pos, d_head] (rotary families: after RoPE, as recorded), model units; null = "
        "NaN or recorded_qkv.")
    k_max_abs_diff: float | None = Field(
        None, description="As q_max_abs_diff, for the keys (rotary families: after RoPE, on the "
        "key/value heads [kv_head, pos, d_head]).")
    v_max_abs_diff: float | None = Field(
        None, description="As q_max_abs_diff, for the values (on the key/value heads).")
    hidden_max_abs_diff: float | None = Field(
        None, description="from_scratch: max |served - recomputed| of this block's output, the "
        "residual-stream hidden state layer+1 [pos, d_model] (pre-ln_f for the last block); "
        "model units; null = NaN or recorded_qkv.")
    hidden_scale: float | None = Field(
        None, description="from_scratch: max |recomputed| of that hidden state (the state "
        "tolerance is relative to max(1, hidden_scale)).")
    pattern_max_abs_diff: float | None = Field(
        description="Max over the layer's heads of the pattern difference; null = NaN."
    )
    output_max_abs_diff: float | None = Field(
        description="max |recomputed - model| of the attention output after the output "
        "projection [pos, d_model] (before dropout and the residual add); model units; null = NaN."
    )
    qkv_max_abs_diff: float | None = Field(
        None, description="Only with 'projections': max |recomputed - model| over the layer's "
        "q, k and v [head, pos, d_head], recomputed from the attention input with the current "
        "weights; model units; null = not requested, or NaN (fails) when 'projections' is true."
    )
    heads: list[HeadDiff] = Field(description="Per head pattern differences.")
    passed: bool = Field(description="Every difference of this layer is finite and <= tolerance.")


class VerifyResult(LenientModel):
    tokens: list[Token] = Field(description="The analysed tokens.")
    add_bos: bool = Field(False, description="Whether BOS was prepended (the request's add_bos).")
    mode: VerifyMode = Field("recorded_qkv", description="The mode that produced this result.")
    mask: Literal["causal", "bidirectional"] | None = Field(
        None, description="The attention mask of the recomputation: causal (GPT-2 and the "
        "rotary families: -inf on keys after the query; a layer's sliding window, if any, "
        "is its 'window') or bidirectional (BERT: every key visible).")
    compute_dtype: str | None = Field(
        None, description="The dtype the recomputation ran in: float64 for from_scratch; the "
        "model's for recorded_qkv.")
    max_rel_diff: float | None = Field(
        None, description="from_scratch: the largest state difference divided by max(1, scale) "
        "over the embeddings, q/k/v, attention outputs, hidden states, final state and "
        "logits; null = NaN somewhere or recorded_qkv.")
    state_tolerance: float | None = Field(
        None, description="from_scratch: the relative tolerance of the states used.")
    failing_layer: int | None = Field(
        None, description="The first layer (in forward order) where a difference exceeds its "
        "tolerance (0 when the embeddings differ); null when passed, or when only the final "
        "LayerNorm's output or the logits differ.")
    embeddings: StateDiff | None = Field(
        None, description="from_scratch: hidden state 0 (the embeddings, with positions; BERT: "
        "after the embedding LayerNorm).")
    final: StateDiff | None = Field(
        None, description="from_scratch: the final norm's output (GPT-2 ln_f, Llama-style norm, "
        "GPT-NeoX final_layer_norm; = Hugging Face's last hidden_states entry); null for "
        "models without one (BERT).")
    logits: LogitsDiff | None = Field(
        None, description="from_scratch, causal LMs: the served next-token logits [pos, vocab] "
        "(the hooked forward's, from the token ids through every block, ln_f and the LM head: "
        "the path /v1/predictions, /v1/ablate, /v1/patch and /v1/run compute with) against "
        "W_U (lm_head.weight) applied to the recomputed ln_f output, in float64, relative to "
        "max(1, max |logit|); in 'passed'. null for encoders and in mode recorded_qkv.")
    passed: bool = Field(
        description="True when every checked difference is finite and <= tolerance. A NaN "
        "anywhere fails the check."
    )
    max_abs_diff: float | None = Field(
        description="from_scratch: the largest pattern difference over the reported layers and "
        "heads (probability units). recorded_qkv: the largest difference over all checked "
        "layers, heads, patterns and outputs (and q/k/v with 'projections'). null = NaN."
    )
    tolerance: float = Field(description="The tolerance used (from_scratch: of the patterns).")
    dtype: str = Field(description="The dtype the model served its numbers in (recorded_qkv "
                       "also recomputes in it).")
    projections: bool = Field(
        False, description="Whether the q/k/v projections were checked too (the request's "
        "'projections')."
    )
    failed_layers: list[int] = Field(description="Layers that failed, ascending; empty when passed.")
    message: str = Field(description="One line: passed, or which layer/head failed and by how much.")
    layers: list[LayerDiff] = Field(description="Per layer (in the order requested).")
    rotary: RotaryDiff | None = Field(
        None, description="from_scratch, rotary families: the served rotary frequencies "
        "against the config's formula; the recomputation then rounds its angles pos * f_j to "
        "float32 as the served forward computes them (Hugging Face's rotary embedding, in "
        "float32 whatever the dtype; exact float64 angles drift by ~pos * 2^-24 rad); null "
        "otherwise.")
    architecture: RecomputedArchitecture | None = Field(
        None, description="from_scratch: what the recomputation implemented for this model "
        "(positions, rotary, kv heads, norm, MLP, residual form, windows, soft-caps); null in "
        "mode recorded_qkv.")


class VerifyResponse(LenientModel):
    model: ModelRef = Field(description="The model that produced this response.")
    add_bos: bool = add_bos_echo()
    verification: VerifyResult | None = Field(None, description="For a 'text' or 'tokens' request.")
    results: list[VerifyResult] | None = Field(None, description="For a 'texts' or 'token_lists' request, in order.")
