"""POST /v1/attention: attention patterns (post-softmax) and scores (pre-softmax)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .common import (
    MAX_INDICES, LenientModel, ModelRef, StrictModel, TensorField, TensorOptions, TextOrTexts,
    Token, index_list, present,
)
from .common import add_bos_echo


class SparseOptions(StrictModel):
    """Send only the largest attention weights of each query row (see SparseTensor).

    Kept: the ``top_k`` largest weights of each row, and/or those ``>= threshold`` (both given:
    the top-k entries that also reach the threshold). Zeros are never kept. Among entries
    exactly equal to a row's k-th largest weight, which ones are kept is torch.topk's choice
    (the kept values and mass are the same either way). The response's ``row_mass`` says how
    much of each row's mass was kept.
    """

    json_rules = ({"anyOf": [present("top_k"), present("threshold")]},)

    top_k: int | None = Field(
        None, ge=1, le=65536, description="Keep at most this many keys per query row."
    )
    threshold: float | None = Field(
        None, gt=0.0, le=1.0, description="Keep only weights >= this value (in (0, 1])."
    )
    format: Literal["flat", "coo"] = Field(
        "flat", description="'flat': row-major flat indices [nnz]; 'coo': coordinates "
        "[nnz, ndim], e.g. [layer, head, query_pos, key_pos] per entry."
    )

    @model_validator(mode="after")
    def _one_rule(self):
        if self.top_k is None and self.threshold is None:
            raise ValueError("sparse needs top_k, threshold or both")
        return self


class AttentionRequest(TextOrTexts, TensorOptions):
    """Attention of the resident model for one text or a batch of texts."""

    layers: list[int] | None = Field(
        None, max_length=MAX_INDICES, fail_fast=True, json_schema_extra=index_list("layer"),
        description="Layer indices to return (0-based, each < n_layers), in the order "
        f"given, each at most once (at most {MAX_INDICES}); null = all layers."
    )
    heads: list[int] | None = Field(
        None, max_length=MAX_INDICES, fail_fast=True, json_schema_extra=index_list("head"),
        description="Head indices to return (0-based, each < n_heads, each at most once; at "
        f"most {MAX_INDICES}); null = all heads."
    )
    head_mean: bool = Field(
        False, description="Return the mean over the selected heads instead of each head: "
        "pattern shape [layer, query_pos, key_pos]."
    )
    layout: Literal["full", "tril"] = Field(
        "full", description="'tril' (causal models only): send only the lower triangle "
        "(key_pos <= query_pos) of pattern and scores, about half the bytes; json gives a "
        "TrilTensor (ragged rows), base64/binary pack the triangle row by row."
    )
    sparse: SparseOptions | None = Field(
        None, description="Send the pattern sparse (top_k per query row and/or a threshold) "
        "as a SparseTensor with the kept mass per row; scores, if asked, stay dense."
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
    add_bos: bool = add_bos_echo()
    attention: AttentionResult | None = Field(None, description="For a 'text' or 'tokens' request.")
    results: list[AttentionResult] | None = Field(None, description="For a 'texts' or 'token_lists' request, in order.")
