"""POST /v1/links: for each query token, its strongest earlier key token(s)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from .common import (
    EXAMPLE_TEXT, MAX_POSITIONS, LenientModel, ModelRef, TextOrTexts, Token, example)
from .common import ENCODER_ONLY_MARK, add_bos_echo, distinct_positions, index_of


class LinksRequest(TextOrTexts):
    """Strongest links of one layer's head mean or of one head (S000, 000_1c89b6c8c2a32040.txt,
    ``strongest_previous_token``)."""

    model_config = example(text=EXAMPLE_TEXT, layer=0)

    layer: int = Field(ge=0, json_schema_extra=index_of("layer"),
                       description="Layer index (0-based, < n_layers).")
    head: int | None = Field(
        None, ge=0, json_schema_extra=index_of("head"),
        description="Head index (< n_heads); null = the mean over the layer's heads."
    )
    top_k: int = Field(1, ge=1, le=4096, description="Links per query, strongest first (default 1).")
    exclude_self: bool = Field(True, description="Never link a token to itself (default true).")
    ignore: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, max_length=MAX_POSITIONS, fail_fast=True,
        json_schema_extra=distinct_positions(),
        description="Key positions never chosen as links, e.g. [0] for the first-token "
        f"sink; each must be < the text's token count, and appear once (at most {MAX_POSITIONS})."
    )
    direction: Literal["earlier", "any"] = Field(
        "earlier", description="'earlier': keys at or before the query only (future keys never "
        "count, the document's rule); 'any': every key (encoders only).",
        json_schema_extra={ENCODER_ONLY_MARK: ["any"]},
    )
    round: int | None = Field(
        None, ge=0, le=10, description="Decimal places for the weights; null = full precision."
    )
    by: Literal["weight", "norm"] = Field(
        "weight", description="Rank keys by attention 'weight', or by contribution 'norm' "
        "(Kobayashi et al. 2020, as /v1/attention-norms computes it with its default biases): "
        "||alpha^h_ij f_h(x_j)|| for one head, ||sum_h alpha^h_ij f_h(x_j)|| over every head "
        "for the layer (head null)."
    )


class LinkTarget(LenientModel):
    key_pos: int = Field(description="Position of the key token.")
    key: str = Field(description="The key token's label.")
    weight: float = Field(description="Attention weight query -> key, in [0, 1].")
    norm: float | None = Field(
        None, description="With by 'norm': the contribution norm the link was ranked by "
        "(residual stream units, >= 0); null otherwise."
    )


class QueryLinks(LenientModel):
    query_pos: int = Field(description="Position of the query token.")
    query: str = Field(description="The query token's label.")
    links: list[LinkTarget] = Field(description="1..top_k links, weight descending (ties: lower key_pos).")


class LinksResult(LenientModel):
    tokens: list[Token] = Field(description="The analysed tokens.")
    links: list[QueryLinks] = Field(
        description="One entry per query with an eligible key, in query order; may be empty."
    )
    skipped: list[int] = Field(
        description="Query positions with no eligible key (e.g. position 0 with exclude_self, "
        "or every key ignored): skipped, not given a fake link."
    )


class LinksResponse(LenientModel):
    model: ModelRef
    add_bos: bool = add_bos_echo()
    layer: int = Field(description="Layer analysed.")
    head: int | None = Field(description="Head analysed; null = the layer's head mean.")
    direction: Literal["earlier", "any"] = Field(description="As requested.")
    by: Literal["weight", "norm"] = Field("weight", description="As requested.")
    links: LinksResult | None = Field(None, description="For a 'text' or 'tokens' request.")
    results: list[LinksResult] | None = Field(None, description="For a 'texts' or 'token_lists' request, in order.")
