"""POST /v1/path-patch: path patching (Wang et al. 2022, IOI; Goldowsky-Dill et al. 2023).

Senders (attention heads ``[layer, head]``, MLPs ``layer``) take their output from the OTHER
run; their change reaches the receivers (heads' query / key / value inputs, MLPs' inputs, or
the final residual stream that the logits read) ONLY along the direct path through the
residual stream: every other component between them keeps its BASE-run output. After the
receivers everything runs normally. Metrics are /v1/run's, read on the base run, the other run
and the patched run; over a dataset of (clean, corrupted) pairs, averaged with their spread.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from .common import (
    INDEX_MARK, LenientModel, ModelRef, StrictModel, Token, _schema_extra, equals, example,
    one_of, present, unset, when,
)
from .run import Metric, TokenId, UniqueIndices, pairs_metric_rules

_DISTINCT = _schema_extra("array", uniqueItems=True)


def _terms(**fields) -> dict:
    return {"properties": {"terms": {"items": {"properties": {
        f: {"enum": values} for f, values in fields.items()}}}}}


#: a declared metric read on one run at a time: a term's ``prompt`` is null or 0; a KL term's
#: ``prompt`` and ``reference_prompt`` are the runs 0 (measured) and 1 (the base run)
_ONE_RUN_TERMS = {"if": {"required": ["kind"], "properties": {"kind": {"const": "kl"}}},
                  "then": _terms(prompt=[0, 1], reference_prompt=[0, 1]),
                  "else": _terms(prompt=[None, 0])}

#: most (clean, corrupted) pairs in one request (the memory estimate usually binds first)
MAX_PAIRS = 4096
MAX_COMPONENTS = 1024
Layer = Annotated[int, Field(ge=0, le=1 << 16, json_schema_extra={INDEX_MARK: "layer"})]
HeadIndex = Annotated[int, Field(ge=0, le=1 << 16, json_schema_extra={INDEX_MARK: "head"})]
SplitInput = Literal["q", "k", "v"]


class HeadSender(StrictModel):
    """An attention head as a sender: its output ``blocks.{layer}.attn.hook_result[:, :, head]``
    (``z_h W_O^h``, without ``b_O``, which is the same in both runs). Gemma 2 (post-attention
    norm ``ln1_post``): the head's ``attn.hook_z`` from the other run, the layer's
    ``hook_attn_out`` recomputed through ``ln1_post`` (not additive: a layer's sender heads
    are patched together)."""

    kind: Literal["head"] = Field(description="'head'.")
    layer: Layer = Field(..., description="The head's layer (0-based).")
    head: HeadIndex = Field(..., description="The head (0-based).")


class MLPSender(StrictModel):
    """An MLP as a sender: its output ``blocks.{layer}.hook_mlp_out``."""

    kind: Literal["mlp"] = Field(description="'mlp'.")
    layer: Layer = Field(..., description="The MLP's layer (0-based).")


Sender = Annotated[Union[HeadSender, MLPSender], Field(discriminator="kind")]


class HeadReceiver(StrictModel):
    """Attention heads' query, key or value input as a receiver: TransformerLens'
    ``blocks.{layer}.hook_{q,k,v}_input`` (``use_split_qkv_input``): each head's own copy of the
    residual stream, before ln1. Under grouped-query attention the k and v inputs are per
    key/value head (``hook_k_input`` / ``hook_v_input`` have ``n_kv_heads`` heads): ``heads``
    then index key/value heads, and patching kv head g's input reaches every query head of its
    group (``h // (n_heads / n_kv_heads) == g``), as /v1/patch counts k/v grids."""

    kind: Literal["head"] = Field(description="'head'.")
    layer: Layer = Field(..., description="The heads' layer (0-based).")
    heads: Annotated[list[HeadIndex], Field(min_length=1, max_length=MAX_COMPONENTS,
                                            json_schema_extra={"uniqueItems": True})] | None = \
        Field(None, description="Heads of that layer; null = every head of the layer. Query "
              "heads for 'q'; for 'k' and 'v' under grouped-query attention key/value heads "
              "(0..n_kv_heads-1; the response's ``head_axis`` says 'kv_head').")
    input: SplitInput = Field(..., description="Which input: 'q' (queries), 'k' (keys), 'v' "
                              "(values).")


class MLPReceiver(StrictModel):
    """An MLP's input as a receiver: the residual stream entering ``blocks.{layer}.ln2``,
    changed for the MLP only (TransformerLens 4.3's bridge: ``blocks.{layer}.mlp.hook_in``, ln2's
    output, is what the MLP alone reads). GPT-NeoX's parallel residual has no
    ``hook_resid_mid``: the MLP reads ``ln2(hook_resid_pre)``, so the receiver input is
    ``blocks.{layer}.ln2.hook_normalized`` of ``hook_resid_pre`` plus the senders' change, and a
    head does not reach its own layer's MLP."""

    kind: Literal["mlp"] = Field(description="'mlp'.")
    layer: Layer = Field(..., description="The MLP's layer (0-based).")


class LogitsReceiver(StrictModel):
    """The final residual stream (the input of ``ln_final``, hence the logits) as the receiver:
    the senders' direct effect on the logits."""

    kind: Literal["logits"] = Field(description="'logits'.")


Receiver = Annotated[Union[HeadReceiver, MLPReceiver, LogitsReceiver],
                     Field(discriminator="kind")]


class PromptPair(StrictModel):
    """One (clean, corrupted) pair: each side as token ids (used exactly as given) or as a text
    (tokenized as plain text, BOS per ``add_bos``). Both sides have the same token count;
    different pairs may differ (they are grouped by length)."""

    clean_tokens: Annotated[list[TokenId], Field(min_length=1, max_length=1 << 16)] | None = \
        Field(None, description="The clean prompt as token ids.")
    clean_text: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="The clean prompt as a text.")
    corrupted_tokens: Annotated[list[TokenId], Field(min_length=1, max_length=1 << 16)] | None \
        = Field(None, description="The corrupted prompt as token ids.")
    corrupted_text: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="The corrupted prompt as a text.")
    metric: Metric | None = Field(
        None, description="This pair's own metric (e.g. its own target and distractor tokens), "
        "of the same kind and reduce as the request's ``metric``; null = the request's.")

    json_rules = (one_of("clean_tokens", "clean_text"),
                  one_of("corrupted_tokens", "corrupted_text"))

    @model_validator(mode="after")
    def _one_each(self):
        for side in ("clean", "corrupted"):
            if (getattr(self, f"{side}_tokens") is None) == (getattr(self, f"{side}_text") is None):
                raise ValueError(f"give exactly one of '{side}_tokens' or '{side}_text'")
        return self


class PathPatchRequest(StrictModel):
    """Path patching on the resident causal LM, over one or many (clean, corrupted) pairs."""

    model_config = example(
        pairs=[{"clean_tokens": [0, 211, 1030, 77, 1499, 211, 1030, 77],
                "corrupted_tokens": [0, 1210, 45, 1600, 1499, 211, 1030, 77]}],
        senders=[{"kind": "head", "layer": 0, "head": 1}],
        receivers=[{"kind": "head", "layer": 1, "input": "k"}],
        metric={"kind": "loss", "terms": [{"position": 5}, {"position": 6}]},
    )
    json_rules = (
        when(equals("grid", True, False), {"allOf": [unset("senders", "receivers"),
                                                     equals("per_pair", False, False)]}),
        when(equals("grid", False, False), present("senders", "receivers")),
        # the logits are a receiver alone
        {"properties": {"receivers": {"anyOf": [
            {"type": "null"}, {"maxItems": 1},
            {"not": {"contains": {"type": "object", "required": ["kind"],
                                  "properties": {"kind": {"const": "logits"}}}}}]}}},
        # each run is read alone: a term's prompt is null or 0 (the request's and each pair's)
        {"properties": {
            "metric": _ONE_RUN_TERMS,
            "pairs": {"items": {"properties": {"metric": _ONE_RUN_TERMS}}}}},
        *pairs_metric_rules(),
    )

    pairs: list[PromptPair] = Field(
        ..., min_length=1, max_length=MAX_PAIRS,
        description="The dataset: (clean, corrupted) prompt pairs. One pair = one experiment; "
        "many = the metric averaged over pairs (mean, sample standard deviation, n).")
    add_bos: bool | None = Field(
        None, description="Texts: prepend BOS. Null = the model's convention (true for GPT-2). "
        "Token ids are used as given.")
    direction: Literal["corrupted_to_clean", "clean_to_corrupted"] = Field(
        "corrupted_to_clean",
        description="'corrupted_to_clean' (default; the IOI paper's): the base run is the clean "
        "prompt, the senders' outputs come from the corrupted prompt (a noising experiment: "
        "how much of the corruption's effect does the path carry). 'clean_to_corrupted': the "
        "base run is the corrupted prompt, the senders' outputs come from the clean one "
        "(denoising).")
    senders: list[Sender] | None = Field(
        None, min_length=1, max_length=MAX_COMPONENTS, json_schema_extra=_DISTINCT,
        description="The senders, patched together (their changes summed); each must come "
        "before every receiver. Null with ``grid``.")
    receivers: list[Receiver] | None = Field(
        None, min_length=1, max_length=MAX_COMPONENTS, json_schema_extra=_DISTINCT,
        description="The receivers, patched together in one run; ``logits`` only alone. Null "
        "with ``grid``.")
    grid: bool = Field(
        False, description="Every sender head x every receiver head input (``grid_inputs``) of "
        "a later layer, each cell its own experiment, batched. ``senders``/``receivers`` are "
        "then null.")
    grid_inputs: list[SplitInput] = Field(
        default_factory=lambda: ["q", "k", "v"], min_length=1, max_length=3,
        json_schema_extra={"uniqueItems": True},
        description="The receiver inputs of the grid, in this order (its last axis).")
    sender_positions: UniqueIndices | None = Field(
        None, description="Positions where the senders' outputs are taken from the other run "
        "(elsewhere they stay the base run's); null = every position. Negative from the end of "
        "each pair.")
    receiver_positions: UniqueIndices | None = Field(
        None, description="Positions where the receivers' inputs are patched; null = every "
        "position. Negative from the end of each pair.")
    metric: Metric = Field(
        ..., description="/v1/run's metric, read on one run at a time: every term's ``prompt`` "
        "is null or 0 (the run measured); a ``kl`` term names two runs, 0 = the run measured "
        "and 1 = the base run (``prompt`` 0, ``reference_prompt`` 1 is KL(P_run || P_base)). "
        "Positions negative from the end of each pair.")
    per_pair: bool = Field(
        False, description="Also return every pair's values (``values`` of each statistic; "
        "not for the grid).")

    @model_validator(mode="after")
    def _shape(self):
        if self.grid:
            if self.senders is not None or self.receivers is not None:
                raise ValueError("grid computes every sender head x receiver input: leave "
                                 "'senders' and 'receivers' null")
            if self.per_pair:
                raise ValueError("per_pair is for a single experiment, not the grid")
        elif self.senders is None or self.receivers is None:
            raise ValueError("give 'senders' and 'receivers' (or grid: true)")
        if len(set(self.grid_inputs)) != len(self.grid_inputs):
            raise ValueError(f"grid_inputs repeats an input: {self.grid_inputs}")
        return self


# ---------------------------------------------------------------------------------- responses
class Statistic(LenientModel):
    mean: float = Field(description="Mean over the pairs of the metric's value.")
    std: float | None = Field(description="Sample standard deviation over the pairs (ddof 1); "
                              "null for one pair.")
    n: int = Field(description="Number of pairs.")
    values: list[float] | None = Field(None, description="Every pair's value, in request order "
                                       "(``per_pair``).")


Grid5 = list[list[list[list[list[Union[float, None]]]]]]


class PathPatchGrid(LenientModel):
    inputs: list[str] = Field(description="The last axis: receiver inputs ('q', 'k', 'v').")
    raw: Grid5 = Field(description="``[sender_layer][sender_head][receiver_layer]"
                       "[receiver_head][input]``: the patched metric's mean over pairs; null "
                       "where the receiver's layer is not after the sender's.")
    std: Grid5 = Field(description="The same cells' sample standard deviations (null for one "
                       "pair).")
    normalized: Grid5 = Field(description="``(raw - base.mean) / (other.mean - base.mean)``; "
                              "null where undefined.")
    receiver_heads: dict[str, int] | None = Field(
        None, description="Receiver heads of each input: n_heads for 'q'; for 'k' and 'v' "
        "n_kv_heads under grouped-query attention, where ``receiver_head`` indexes key/value "
        "heads and the cells past them are null.")
    head_axes: dict[str, str] | None = Field(
        None, description="What ``receiver_head`` indexes for each input: 'head' (query "
        "heads) or 'kv_head' (key/value heads: k and v under grouped-query attention).")


class PairInfo(LenientModel):
    n_tokens: int = Field(description="Tokens of each side of the pair.")
    clean_tokens: list[Token] = Field(description="The clean prompt's tokens as run.")
    corrupted_tokens: list[Token] = Field(description="The corrupted prompt's tokens as run.")


class PathPatchResponse(LenientModel):
    model: ModelRef
    add_bos: bool = Field(description="Whether BOS was prepended to texts.")
    direction: str = Field(description="As requested.")
    base_run: Literal["clean", "corrupted"] = Field(
        description="The run everything but the senders' direct path is frozen at.")
    other_run: Literal["clean", "corrupted"] = Field(
        description="The run the senders' outputs are taken from.")
    metric: str = Field(description="The metric's kind.")
    reduce: str = Field(description="How each run's terms were reduced ('mean' or 'sum').")
    construction: str = Field(description="How the patched run is built (text).")
    senders: list[dict] | None = Field(description="The senders, as run.")
    receivers: list[dict] | None = Field(description="The receivers, as run (heads expanded; a "
                                         "head receiver's ``head_axis``: 'head', or 'kv_head' "
                                         "for k/v under grouped-query attention).")
    pairs: list[PairInfo] = Field(description="The pairs, in request order.")
    base: Statistic = Field(description="The metric on the base run (raw).")
    other: Statistic = Field(description="The metric on the other run (raw).")
    patched: Statistic | None = Field(
        description="The metric on the path-patched run (raw); null for the grid.")
    normalized: float | None = Field(
        description="``(patched.mean - base.mean) / (other.mean - base.mean)``: 0 = the path "
        "carries nothing, 1 = all of the other run's effect; null for the grid or when "
        "``other.mean == base.mean``.")
    grid: PathPatchGrid | None = Field(description="With ``grid``: every cell.")
