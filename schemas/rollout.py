"""POST /v1/rollout: attention rollout and attention flow (Abnar & Zuidema 2020)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .attention import SparseOptions
from .common import (
    MAX_INDICES, LenientModel, ModelRef, TensorField, TensorOptions, TextOrTexts, Token,
    index_list,
)
from .common import add_bos_echo, equals, present, when


class RolloutRequest(TextOrTexts, TensorOptions):
    """Rollout ``R_l = Â_l ... Â_1`` with ``Â_l = rownorm((1 - residual) F_l + residual I)``,
    ``F_l`` the fused heads of layer l (after the sink and discard steps), and optionally the
    attention flow (max-flow over the layered graph with capacities Â)."""

    json_rules = (when(present("flow_layers"), equals("flow", True, False)),)

    fusion: Literal["mean", "max", "min"] = Field(
        "mean", description="Head fusion per layer: 'mean' (the paper), or the elementwise "
        "'max' / 'min' over heads."
    )
    residual: float = Field(
        0.5, ge=0.0, le=1.0, description="Weight of the identity (residual connection) in Â, "
        "in [0, 1]; default 0.5 as in the paper."
    )
    discard: float = Field(
        0.0, ge=0.0, lt=1.0, description="Fraction of each layer's fused weights to zero, the "
        "smallest first (among the visible entries), in [0, 1); default 0."
    )
    sink: Literal["keep", "drop"] = Field(
        "keep", description="'keep' the first token (BOS / [CLS] / first token) as a key, or "
        "'drop' its weight from every query after it before the residual is added."
    )
    layers: list[int] | None = Field(
        None, max_length=MAX_INDICES, fail_fast=True, json_schema_extra=index_list("layer"),
        description="Layers l whose rollout R_l to return (0-based: R at layer l's "
        f"output), each at most once (at most {MAX_INDICES}); null = all. R_l always "
        "multiplies every layer <= l."
    )
    flow: bool = Field(
        False, description="Also compute attention flow (networkx maximum flow); inputs of at "
        "most 16 tokens (the response's flow_max_tokens); longer inputs get a 422."
    )
    flow_layers: list[int] | None = Field(
        None, max_length=MAX_INDICES, fail_fast=True, json_schema_extra=index_list("layer"),
        description="Layers whose flow to compute (0-based, each at most once; at most "
        f"{MAX_INDICES}); null = the last layer. The cost grows with each layer's depth."
    )
    layout: Literal["full", "tril"] = Field(
        "full", description="'tril' (causal models only): the lower triangle of rollout and flow."
    )
    sparse: SparseOptions | None = Field(
        None, description="Send rollout (and flow) sparse: top_k per query row and/or a "
        "threshold, with the kept mass per row (rows sum to 1)."
    )


class RolloutResult(LenientModel):
    tokens: list[Token] = Field(description="The analysed tokens (query_pos/key_pos index these).")
    layers: list[int] = Field(description="Layer of each rollout matrix along the first axis.")
    rollout: TensorField = Field(
        description="R_l float32 [layer, query_pos, key_pos]: share of token query_pos's "
        "representation after layer l that traces back to input token key_pos; rows sum to 1; "
        "causal models never put weight on a later token."
    )
    flow_layers: list[int] | None = Field(None, description="Layer of each flow matrix.")
    flow: TensorField | None = Field(
        None, description="Attention flow float32 [flow_layer, query_pos, key_pos]: maximum "
        "flow from (layer output, query) to each input token, each row divided by its sum."
    )


class RolloutResponse(LenientModel):
    model: ModelRef
    add_bos: bool = add_bos_echo()
    fusion: Literal["mean", "max", "min"] = Field(description="As requested.")
    residual: float = Field(description="As requested.")
    discard: float = Field(description="As requested.")
    sink: Literal["keep", "drop"] = Field(description="As requested.")
    flow_max_tokens: int = Field(description="Longest input attention flow is computed for.")
    sliding_windows: list[int | None] | None = Field(
        None, description="Per layer, the sliding key window of a model that has one (Mistral; "
        "Gemma 2 on alternate layers; null entries: full attention), else null. A windowed "
        "layer's pattern is 0 outside its window, so its discard candidates are only the keys "
        "inside it (query_pos - window < key_pos <= query_pos); rollout still reaches earlier "
        "tokens through the layers below (R_l is a product), as the model does.")
    rollout: RolloutResult | None = Field(None, description="For a 'text' or 'tokens' request.")
    results: list[RolloutResult] | None = Field(None, description="For a 'texts' or 'token_lists' request, in order.")
