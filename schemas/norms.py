"""POST /v1/attention-norms: value-weighted contribution norms (Kobayashi et al. 2020)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .attention import SparseOptions
from .common import (
    MAX_INDICES, LenientModel, ModelRef, TensorField, TensorOptions, TextOrTexts, Token,
    equals, index_list,
)
from .common import add_bos_echo


class NormsRequest(TextOrTexts, TensorOptions):
    """Contribution norms ``||alpha^h_ij f_h(x_j)||`` of the resident model for one text or a
    batch, with ``f_h(x) = (x W_V^h + b_V^h) W_O^h`` (Kobayashi et al. 2020, eq. 5-7)."""

    json_rules = ({"anyOf": [equals(f, True, True)
                             for f in ("per_head", "summed", "value_norms")]},)

    layers: list[int] | None = Field(
        None, max_length=MAX_INDICES, fail_fast=True, json_schema_extra=index_list("layer"),
        description="Layer indices to return (0-based, each < n_layers), in the order "
        f"given, each at most once (at most {MAX_INDICES}); null = all layers."
    )
    heads: list[int] | None = Field(
        None, max_length=MAX_INDICES, fail_fast=True, json_schema_extra=index_list("head"),
        description="Head indices (0-based, each < n_heads, each at most once; at most "
        f"{MAX_INDICES}); null = all heads. 'summed' is the sum over these heads."
    )
    per_head: bool = Field(
        True, description="Return 'norms': ||alpha^h_ij f_h(x_j)|| [layer, head, query_pos, "
        "key_pos]."
    )
    summed: bool = Field(
        True, description="Return 'summed': ||sum_h alpha^h_ij f_h(x_j)|| [layer, query_pos, "
        "key_pos] (the layer's whole attention contribution of key j to query i)."
    )
    value_norms: bool = Field(
        True, description="Return 'value_norms': ||f_h(x_j)|| [layer, head, key_pos]."
    )
    value_bias: Literal["include", "exclude"] = Field(
        "include", description="'include' (default, the paper's f): the value bias b_V is part "
        "of every key's f_h(x_j); 'exclude': f_h(x) = x W_V^h W_O^h."
    )
    output_bias: Literal["exclude", "distribute"] = Field(
        "exclude", description="'exclude' (default, the paper): the output projection's bias "
        "b_O is added once to the layer's output and is in no key's contribution (the "
        "contributions sum, over keys and heads, to the attention output minus b_O); "
        "'distribute': head h's key j also carries alpha^h_ij b_O / n_heads (they then sum to "
        "the attention output). value_norms never include b_O."
    )
    layout: Literal["full", "tril"] = Field(
        "full", description="'tril' (causal models only): send only the lower triangle of "
        "'norms' and 'summed' (value_norms are per key: always full)."
    )
    sparse: SparseOptions | None = Field(
        None, description="Send 'norms' and 'summed' sparse (top_k per query row and/or a "
        "threshold on the norm). row_mass is then the sum of the kept norms of each row (not a "
        "fraction: norms do not sum to 1)."
    )

    @model_validator(mode="after")
    def _something(self):
        if not (self.per_head or self.summed or self.value_norms):
            raise ValueError("per_head, summed and value_norms are all false: nothing to return")
        return self


class NormsResult(LenientModel):
    tokens: list[Token] = Field(description="The analysed tokens (query_pos/key_pos index these).")
    layers: list[int] = Field(description="Layer index of each entry along the first axis.")
    heads: list[int] = Field(description="Head index of each entry along the head axis.")
    norms: TensorField | None = Field(
        None, description="||alpha^h_ij f_h(x_j)|| float32 [layer, head, query_pos, key_pos], "
        ">= 0, in the residual stream's units (0 for masked keys)."
    )
    summed: TensorField | None = Field(
        None, description="||sum_h alpha^h_ij f_h(x_j)|| over the selected heads, float32 "
        "[layer, query_pos, key_pos], >= 0."
    )
    value_norms: TensorField | None = Field(
        None, description="||f_h(x_j)|| float32 [layer, head, key_pos], >= 0 (the transformed "
        "value vector's norm, b_O never included)."
    )


class NormsResponse(LenientModel):
    model: ModelRef
    add_bos: bool = add_bos_echo()
    value_bias: Literal["include", "exclude"] = Field(description="As requested.")
    output_bias: Literal["exclude", "distribute"] = Field(description="As requested.")
    kv_head_of_query_head: list[int] | None = Field(
        None, description="Grouped-query attention (fewer key/value heads than query heads): "
        "for query head h, the key/value head whose value vectors its f_h uses, h // (n_heads "
        "// n_kv_heads); f_h(x) = (x W_V^g + b_V^g) W_O^h with g that head, so the query heads "
        "of one group share ||x W_V^g|| but not W_O^h. Null without grouped-query attention.")
    norms: NormsResult | None = Field(None, description="For a 'text' or 'tokens' request.")
    results: list[NormsResult] | None = Field(None, description="For a 'texts' or 'token_lists' request, in order.")
