"""POST /v1/attention: attention patterns (post-softmax) and scores (pre-softmax)."""

from __future__ import annotations

from pydantic import Field

from attnscope.schemas.common import LenientModel, ModelRef, TensorField, TensorOptions, TextOrTexts, Token


class AttentionRequest(TextOrTexts, TensorOptions):
    """Attention of the resident model for one text or a batch of texts."""

    layers: list[int] | None = Field(
        None, description="Layer indices to return (0-based, each < n_layers), in the order "
        "given; null = all layers."
    )
    heads: list[int] | None = Field(
        None, description="Head indices to return (0-based, each < n_heads); null = all heads."
    )
    head_mean: bool = Field(
        False, description="Return the mean over the selected heads instead of each head: "
        "pattern shape [layer, query_pos, key_pos]."
    )
    include_scores: bool = Field(
        False, description="Also return pre-softmax attention scores (q.k * scaling, before the "
        "mask). Masked entries (future keys in causal models) are null in 'json' and -inf in "
        "'base64'."
    )


class AttentionResult(LenientModel):
    tokens: list[Token] = Field(description="The analysed tokens (query_pos/key_pos index these).")
    layers: list[int] = Field(description="Layer index of each entry along the first axis.")
    heads: list[int] = Field(description="Head indices selected (averaged when head_mean).")
    head_mean: bool = Field(description="Whether heads were averaged.")
    pattern: TensorField = Field(
        description="Attention pattern (post-softmax), float, each row sums to 1 over key_pos; "
        "shape [layer, head, query_pos, key_pos], or [layer, query_pos, key_pos] with head_mean. "
        "Equals Hugging Face's output_attentions for the same weights."
    )
    scores: TensorField | None = Field(
        None,
        description="Pre-softmax scores (q . k * scaling), same shape as pattern; masked entries "
        "null (json) / -inf (base64). With head_mean the mean is over unmasked entries.",
    )


class AttentionResponse(LenientModel):
    model: ModelRef
    attention: AttentionResult | None = Field(None, description="For a 'text' request.")
    results: list[AttentionResult] | None = Field(None, description="For a 'texts' request, in order.")
