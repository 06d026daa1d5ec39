"""POST /v1/verify: the model's attention against a from-scratch recomputation.

Source: the scaled dot-product ``attention(Q, K, V, mask)`` of 000_1c89b6c8c2a32040.txt and
the multi-head attention of 001_92e9928af52718c3.txt, applied to the model's own q/k/v and
output projection (DESIGN.md, "verification").
"""

from __future__ import annotations

from pydantic import Field

from attnscope.schemas.common import LenientModel, ModelRef, TextOrTexts, Token


class VerifyRequest(TextOrTexts):
    """Recompute every layer's attention from scratch from the model's own q/k/v and compare
    with the model's."""

    layers: list[int] | None = Field(
        None, description="Layer indices to check (0-based, each < n_layers, each at most once); "
        "null = all."
    )
    tolerance: float | None = Field(
        None, gt=0, le=1,
        description="Largest absolute difference that passes. null = 1e-5 for float32 models, "
        "1e-2 for float16/bfloat16.",
    )
    projections: bool = Field(
        False, description="Also recompute q, k and v from the recorded attention input with "
        "the model's CURRENT q/k/v weights and compare them with the model's own (per layer "
        "'qkv_max_abs_diff', counts toward 'passed'). The default starts from the model's "
        "recorded q/k/v, so it does not see a q/k/v weight change made after the forward. "
        "Cost: three more d_model x d_model matmuls per layer, about 3x the default's time "
        "(GPT-2 small, 128 tokens, 2 CPU cores: ~20 ms default, ~60 ms with projections).",
    )


class HeadDiff(LenientModel):
    head: int = Field(description="Head index.")
    pattern_max_abs_diff: float | None = Field(
        description="max |recomputed - model| over this head's pattern [query_pos, key_pos]; "
        "probability units, >= 0; null = NaN (fails)."
    )


class LayerDiff(LenientModel):
    layer: int = Field(description="Layer index.")
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
    passed: bool = Field(
        description="True when every checked difference is finite and <= tolerance. A NaN "
        "anywhere fails the check."
    )
    max_abs_diff: float | None = Field(
        description="Largest difference over all checked layers, heads, patterns and outputs "
        "(and q/k/v with 'projections'); null = NaN somewhere."
    )
    tolerance: float = Field(description="The tolerance used.")
    dtype: str = Field(description="The dtype the recomputation ran in (the model's).")
    projections: bool = Field(
        False, description="Whether the q/k/v projections were checked too (the request's "
        "'projections')."
    )
    failed_layers: list[int] = Field(description="Layers that failed, ascending; empty when passed.")
    message: str = Field(description="One line: passed, or which layer/head failed and by how much.")
    layers: list[LayerDiff] = Field(description="Per layer (in the order requested).")


class VerifyResponse(LenientModel):
    model: ModelRef = Field(description="The model that produced this response.")
    verification: VerifyResult | None = Field(None, description="For a 'text' request.")
    results: list[VerifyResult] | None = Field(None, description="For a 'texts' request, in order.")
