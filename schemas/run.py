"""POST /v1/run and GET /v1/hooks: remote execution of one hooked forward with TransformerLens
4.x hook names: prompts (token ids or texts) in, a cache selection, an ordered list of
declarative interventions, declared metrics and optionally a gradient; activations out under
TransformerLens' names and shapes (``blocks.{l}.attn.hook_z`` ``[batch, pos, head, d_head]``)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, field_validator, model_validator

from .interventions import TopToken
from .common import (
    MAX_TEXTS, LenientModel, ModelRef, StrictModel, TensorField, Token,
    TensorOptions, example, field_error,
)
from .common import BATCH, INDEX_MARK, NON_BLANK_PATTERN, ids_as_given, index_of, one_of

#: at most this many prompts in one run (max_batch, a setting, may be lower)
MAX_PROMPTS = MAX_TEXTS
#: at most this many cache entries, interventions, metrics or metric terms in one request
MAX_ITEMS = 256
MAX_INDEX = 1 << 20

Index = Annotated[int, Field(ge=-MAX_INDEX, le=MAX_INDEX)]
Indices = Annotated[list[Index], Field(min_length=1, max_length=4096)]
#: a selection the server refuses with a repeat (cache selections, path-patch positions)
UniqueIndices = Annotated[list[Index], Field(min_length=1, max_length=4096,
                                             json_schema_extra={"uniqueItems": True})]
TokenId = Annotated[int, Field(ge=0, le=1 << 31, json_schema_extra={INDEX_MARK: "token"})]
#: a tensor given in a request: nested JSON lists of numbers, or the base64 form
#: ``{"encoding": "base64", "dtype": "float32"|"float16", "shape", "data"}``
_F = Annotated[float, Field(allow_inf_nan=False)]
#: at most this many entries along any axis of a JSON request tensor (GPT-2's d_vocab fits)
MAX_AXIS = 1 << 17
_N1 = Annotated[list[_F], Field(max_length=MAX_AXIS)]
_N2 = Annotated[list[_N1], Field(max_length=MAX_AXIS)]
_N3 = Annotated[list[_N2], Field(max_length=MAX_AXIS)]
_N4 = Annotated[list[_N3], Field(max_length=MAX_AXIS)]
_N5 = Annotated[list[_N4], Field(max_length=MAX_AXIS)]


class Base64Input(StrictModel):
    """A request tensor as little-endian bytes in base64 (the response's ``Base64Tensor``
    form, ``layout`` full): decoded to float32. Request tensors are activations: float16 or
    float32 only (integer bytes are refused, never reinterpreted)."""

    encoding: Literal["base64"] = Field(description="'base64'.")
    dtype: Literal["float16", "float32"] = Field(
        description="Element type, little-endian: 'float32' (exact) or 'float16' (widened to "
        "float32). Integer dtypes are refused (422 naming ``dtype``).")
    shape: list[Annotated[int, Field(ge=0, le=1 << 26)]] = Field(
        ..., max_length=8, description="Tensor shape, row-major (C order).")
    data: str = Field(..., max_length=1 << 29,
                      description="Standard base64 of the little-endian element bytes.")
    layout: Literal["full"] = Field("full", description="Only 'full' in requests.")


InputTensor = Union[Base64Input, _N1, _N2, _N3, _N4, _N5]
TokenRef = Union[TokenId, Annotated[str, Field(min_length=1)]]
HOOK_DESCRIPTION = ("A TransformerLens 4.x hook name ('blocks.0.attn.hook_z', 'hook_embed', "
                    "'ln_final.hook_scale') or an fnmatch pattern over them "
                    "('blocks.*.hook_resid_post'); GET /v1/hooks lists them with shapes.")


class Selection(StrictModel):
    """Which part of a hook (every field optional; null = all). Axes are kept: one head gives
    a head axis of size 1. ``positions`` index the ``pos`` axis (``query_pos`` for
    ``hook_pattern``/``hook_attn_scores``); negative positions count from the end."""

    prompts: Indices | None = Field(None, description="Batch rows (prompt indices).")
    heads: Indices | None = Field(None, description="Heads (hooks with a head axis).")
    positions: Indices | None = Field(
        None, description="Positions (the pos axis; query_pos for patterns and scores).")


class CacheItem(Selection):
    """One cache entry: a hook name or pattern, with an optional selection."""

    hook: str = Field(..., min_length=1, max_length=200, description=HOOK_DESCRIPTION)
    prompts: UniqueIndices | None = Field(None, description="Batch rows (prompt indices), each "
                                          "once.")
    heads: UniqueIndices | None = Field(None, description="Heads (hooks with a head axis), "
                                        "each once.")
    positions: UniqueIndices | None = Field(
        None, description="Positions (the pos axis; query_pos for patterns and scores), each "
        "once.")
    layers: UniqueIndices | None = Field(
        None, description="Keep only these layers' hooks of a pattern (model-level hooks such "
        "as hook_embed always pass).")


class _Intervention(Selection):
    hook: str = Field(..., min_length=1, max_length=200, description=HOOK_DESCRIPTION +
                      " Applied at every hook the pattern matches, in forward order.")


class ZeroIntervention(_Intervention):
    """Set the selection to 0 (zero ablation)."""

    kind: Literal["zero"] = Field(description="'zero'.")


class ScaleIntervention(_Intervention):
    """Multiply the selection by ``factor``."""

    kind: Literal["scale"] = Field(description="'scale'.")
    factor: float = Field(..., allow_inf_nan=False, description="The multiplier.")


class AddIntervention(_Intervention):
    """Add ``scale * vector`` to every selected vector (activation steering, e.g. a direction
    in the residual stream): ``vector`` ``[d]``, d the hook's last axis."""

    kind: Literal["add"] = Field(description="'add'.")
    vector: InputTensor = Field(..., description="``[d]``: d = the hook's last axis (d_model, "
                                "d_head, d_mlp, key_pos or 1).")
    scale: float = Field(1.0, allow_inf_nan=False, description="The vector's multiplier.")


class MeanIntervention(_Intervention):
    """Mean ablation: the selection replaced by a mean of the hook's values. ``over``: 'pos'
    (each prompt's own mean over its positions), 'batch' (per position, over every prompt of
    the request), 'batch_pos' (over both); or the mean over ``reference`` prompts (their
    forward is run first, unedited, in the same device turn; per position when they have the
    request's length, else over their positions too)."""

    kind: Literal["mean"] = Field(description="'mean'.")
    over: Literal["pos", "batch", "batch_pos"] = Field(
        "batch_pos", description="What the mean is over (ignored with ``reference``).")
    reference: list[Annotated[list[TokenId], Field(min_length=1, max_length=1 << 16)]] | None = Field(
        None, min_length=1, max_length=MAX_PROMPTS,
        description="Reference prompts as token ids (used exactly as given).")
    reference_texts: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, max_length=MAX_PROMPTS,
        description="Reference prompts as texts (tokenized as ``texts`` are).")

    json_rules = (one_of((), "reference", "reference_texts"),)

    @model_validator(mode="after")
    def _one_reference(self):
        if self.reference is not None and self.reference_texts is not None:
            raise ValueError("give at most one of 'reference' or 'reference_texts'")
        return self


class SetIntervention(_Intervention):
    """Replace the selection with the same hook's value in another prompt of the batch
    (``source_prompt``: activation patching in one call; path patching when the hook is a
    per-head ``hook_q_input``/``hook_k_input``/``hook_v_input``, Wang et al. 2022) or with a
    given ``value`` (shaped as one prompt's selection, or with a leading axis of the selected
    prompts). Exactly one of the two."""

    kind: Literal["set"] = Field(description="'set'.")
    source_prompt: Index | None = Field(
        None, description="The prompt (batch row) whose value at this hook is copied; it must "
        "have the same length (every prompt of a run does).")
    value: InputTensor | None = Field(None, description="The replacement tensor.")

    json_rules = (one_of("source_prompt", "value"),)

    @model_validator(mode="after")
    def _one_source(self):
        if (self.source_prompt is None) == (self.value is None):
            raise ValueError("give exactly one of 'source_prompt' or 'value'")
        return self


Intervention = Annotated[
    Union[ZeroIntervention, ScaleIntervention, AddIntervention, MeanIntervention,
          SetIntervention],
    Field(discriminator="kind"),
]


class LogitDiffTerm(StrictModel):
    prompt: Index | None = Field(None, description="Batch row; null = every prompt.")
    position: Index = Field(..., description="Position whose next-token logits are read.")
    target: TokenRef = Field(..., description="Token id, or a text that is one token.")
    distractor: TokenRef = Field(..., description="Token id, or a text that is one token.")


class TokenTerm(StrictModel):
    prompt: Index | None = Field(None, description="Batch row; null = every prompt.")
    position: Index = Field(..., description="Position whose next-token distribution is read.")
    target: TokenRef = Field(..., description="Token id, or a text that is one token.")


class PositionTerm(StrictModel):
    prompt: Index | None = Field(None, description="Batch row; null = every prompt.")
    position: Index = Field(..., description="Position p: the target is the prompt's own "
                            "token at p + 1 (p < n_tokens - 1).")


class KLTerm(StrictModel):
    prompt: Index = Field(..., description="Prompt a: KL(P_a || P_b).")
    reference_prompt: Index = Field(..., description="Prompt b.")
    position: Index = Field(..., description="Position of both next-token distributions.")


class _Metric(StrictModel):
    reduce: Literal["mean", "sum"] = Field(
        "mean", description="``value`` = the mean (TransformerLens / IOI convention) or the sum "
        "of the terms' values.")


class LogitDiffMetric(_Metric):
    """``logit[target] - logit[distractor]`` at each term's position (logits, unnormalised)."""

    kind: Literal["logit_diff"] = Field(description="'logit_diff'.")
    terms: list[LogitDiffTerm] = Field(..., min_length=1, max_length=MAX_ITEMS,
                                       description="(prompt, position, target, distractor) "
                                       "terms; one value each, reduced to ``value``.")


class ProbMetric(_Metric):
    """Next-token probability of the target (softmax of the logits; in [0, 1])."""

    kind: Literal["prob"] = Field(description="'prob'.")
    terms: list[TokenTerm] = Field(..., min_length=1, max_length=MAX_ITEMS,
                                   description="(prompt, position, target) terms; one value "
                                   "each, reduced to ``value``.")


class LogProbMetric(_Metric):
    """Next-token log-probability of the target (log-softmax; nats, <= 0)."""

    kind: Literal["logprob"] = Field(description="'logprob'.")
    terms: list[TokenTerm] = Field(..., min_length=1, max_length=MAX_ITEMS,
                                   description="(prompt, position, target) terms; one value "
                                   "each, reduced to ``value``.")


class LossMetric(_Metric):
    """Next-token cross entropy ``-log p(token[p+1])`` at each position (nats, >= 0)."""

    kind: Literal["loss"] = Field(description="'loss'.")
    terms: list[PositionTerm] = Field(..., min_length=1, max_length=MAX_ITEMS,
                                      description="(prompt, position) terms; one value each, "
                                      "reduced to ``value``.")


class KLMetric(_Metric):
    """``KL(P_a || P_b) = sum_v P_a(v) (log P_a(v) - log P_b(v))`` of two prompts' next-token
    distributions at one position (nats, >= 0)."""

    kind: Literal["kl"] = Field(description="'kl'.")
    terms: list[KLTerm] = Field(..., min_length=1, max_length=MAX_ITEMS,
                                description="(prompt, reference_prompt, position) terms; one "
                                "value each, reduced to ``value``.")


Metric = Annotated[
    Union[LogitDiffMetric, ProbMetric, LogProbMetric, LossMetric, KLMetric],
    Field(discriminator="kind"),
]
METRIC_KINDS = ("logit_diff", "prob", "logprob", "loss", "kl")


def pairs_metric_rules(kinds: bool = True) -> tuple[dict, ...]:
    """JSON-Schema rules of a dataset request (``pairs``, each with an optional own
    ``metric``): a pair's metric has the request's ``metric`` kind and reduce, so that the
    pairs' values average (the server refuses others). Stated as ``anyOf`` branches, not
    ``if``/``then``: generators (schemathesis, hypothesis-jsonschema) could not build
    ``/v1/patch`` bodies from the ``if`` form next to its string-or-object ``metric``.
    ``kinds``: False leaves the kind rule out (the reduce rule stays): with /v1/patch's other
    rules its six branches make schemathesis' generator give up (UnsupportedSchema), so there
    the server alone checks the kind."""
    def both(**props) -> dict:  # the request's metric and every pair's have ``props``
        return {"properties": {"metric": {"properties": props},
                               "pairs": {"items": {"properties": {"metric": {
                                   "properties": props}}}}}}

    no_pair_metric = {"properties": {"pairs": {"items": {"properties": {"metric": {
        "type": "null"}}}}}}
    kind = {"anyOf": [no_pair_metric, *(both(kind={"const": k}) for k in METRIC_KINDS)]}
    summed = both(reduce={"const": "sum"})
    summed["properties"]["metric"]["required"] = ["reduce"]
    summed["properties"]["pairs"]["items"]["properties"]["metric"]["required"] = ["reduce"]
    reduces = {"anyOf": [no_pair_metric, summed, both(reduce={"const": "mean"})]}
    return (kind, reduces) if kinds else (reduces,)


class LogitsOptions(StrictModel):
    """Which logits come back: at ``positions`` (null = all), either the ``top_k`` tokens per
    (prompt, position) or the ``full`` ``[batch, position, vocab]`` tensor."""

    positions: Indices | None = Field(None, description="Positions; null = every position.")
    top_k: int | None = Field(5, ge=1, le=1000, description="Top-k next tokens (logit, prob).")
    full: bool = Field(False, description="The whole logits tensor (``[batch, len(positions), "
                       "vocab]``, encoded as the request asks).")


class GradOptions(StrictModel):
    """The gradient of one declared metric's ``value`` with respect to hooks, from one
    backward (attribution patching's ingredient: Nanda 2023; Kramár et al. 2024)."""

    metric: str = Field(..., min_length=1, max_length=100,
                        description="Name of a metric declared in ``metrics``.")
    hooks: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        ..., min_length=1, max_length=MAX_ITEMS, description="Hook names or patterns.")


class RunRequest(TensorOptions):
    """One hooked forward of the resident causal LM on a batch of prompts of equal length."""

    model_config = example(
        texts=["The cat sat on the mat and the dog", "The dog sat on the mat and the cat"],
        cache=["blocks.0.attn.hook_pattern", {"hook": "blocks.*.hook_resid_post",
                                              "positions": [-1]}],
        interventions=[{"kind": "set", "hook": "blocks.1.attn.hook_z", "heads": [0],
                        "prompts": [1], "source_prompt": 0}],
        metrics={"ld": {"kind": "logit_diff", "terms": [
            {"position": -1, "target": " the", "distractor": " a"}]}},
        logits={"positions": [-1], "top_k": 3},
    )

    json_rules = (one_of("token_lists", "texts"), ids_as_given("token_lists"))

    token_lists: list[Annotated[list[TokenId], Field(
        min_length=1, max_length=1 << 16, json_schema_extra={"x-attnscope-index": "token"})]] \
            | None = Field(
        None, min_length=1, max_length=MAX_PROMPTS, json_schema_extra=BATCH,
        description="The prompts as token ids, one list per prompt (``[batch, pos]``, as "
        "TransformerLens' ``run_with_cache(tokens)``), used exactly as given (no BOS added). All "
        "prompts of a run have the same number of tokens.")
    texts: list[Annotated[str, Field(min_length=1, json_schema_extra={
            "pattern": NON_BLANK_PATTERN})]] | None = Field(
        None, min_length=1, max_length=MAX_PROMPTS, json_schema_extra=BATCH,
        description="The prompts as texts (tokenized as plain text; BOS per ``add_bos``).")
    add_bos: bool | None = Field(
        None, description="Texts: prepend BOS. Null = the model's convention (true for GPT-2, "
        "as TransformerLens' to_tokens). Token ids are used as given: with ``token_lists`` "
        "only null or false.")
    cache: list[Union[Annotated[str, Field(min_length=1, max_length=200)], CacheItem]] = Field(
        default_factory=list, max_length=MAX_ITEMS,
        description="Hooks to return: names or patterns (strings) or entries with a selection. "
        "Returned under TransformerLens' names and shapes (batch axis first), after the "
        "interventions at that hook.")
    interventions: list[Intervention] = Field(
        default_factory=list, max_length=MAX_ITEMS,
        description="Applied in order, each at its hook inside the forward.")
    metrics: dict[Annotated[str, Field(min_length=1, max_length=100)], Metric] = Field(
        default_factory=dict, max_length=MAX_ITEMS, description="Declared metrics by name.")
    logits: LogitsOptions | None = Field(
        None, description="Logits to return (null: none; the metrics still read them).")
    loss: bool = Field(False, description="Per-token next-token loss ``[batch, pos - 1]`` "
                       "(nats) and its mean.")
    grad: GradOptions | None = Field(None, description="A gradient to return.")

    @model_validator(mode="after")
    def _prompts(self):
        if (self.token_lists is None) == (self.texts is None):
            raise ValueError("give exactly one of 'token_lists' or 'texts'")
        if self.token_lists is not None:
            for i, t in enumerate(self.token_lists):
                if not t:
                    raise ValueError(f"token_lists[{i}] holds no token ids")
            if self.add_bos:
                raise ValueError("add_bos applies to texts; token ids are used as given (put "
                                 "the BOS id first)")
        if self.grad is not None and self.grad.metric not in self.metrics:
            raise field_error(type(self), ("grad", "metric"),
                              f"{self.grad.metric!r} is not declared in 'metrics' (declared: "
                              f"{sorted(self.metrics)})", self.grad.metric)
        return self

    @field_validator("texts")
    @classmethod
    def _texts_not_blank(cls, v):
        for i, t in enumerate(v or []):
            if not t.strip():
                raise ValueError(f"texts[{i}] must contain a non-whitespace character")
        return v


# ---------------------------------------------------------------------------------- responses
#: a tensor in a /v1/run response: the JSON, base64 or binary forms of ``schemas.common``
WireTensor = TensorField


class Prompt(LenientModel):
    tokens: list[Token] = Field(description="The prompt's tokens (ids, labels).")
    n_tokens: int = Field(description="Number of tokens.")


class LogitsResult(LenientModel):
    positions: list[int] = Field(description="The positions read (negative ones resolved).")
    top: list[list[list[TopToken]]] | None = Field(
        None, description="``[prompt][position][k]`` top-k next tokens, most probable first.")
    logits: WireTensor | None = Field(None, description="``[batch, position, vocab]``.")


class MetricResult(LenientModel):
    value: float = Field(description="The reduced value (mean or sum of ``values``).")
    values: list[float] = Field(description="One value per term (terms with prompt null "
                                "expanded prompt-major).")
    reduce: str = Field(description="'mean' or 'sum'.")


class LossResult(LenientModel):
    per_token: WireTensor = Field(description="``[batch, pos - 1]``: loss of token p + 1 (nats).")
    mean: float = Field(description="Mean over every prompt and position (nats).")


class RunResponse(LenientModel):
    model: ModelRef
    add_bos: bool = Field(description="Whether BOS was prepended to the texts (false for tokens).")
    prompts: list[Prompt] = Field(description="The prompts as run, in order (the batch axis).")
    cache: dict[str, WireTensor] = Field(
        description="TransformerLens hook name -> tensor, TL shapes with the batch axis first, "
        "cut to the selection.")
    selections: dict[str, dict] = Field(
        description="Per cached hook the indices kept along each cut axis (prompts, heads, "
        "positions), so a selected tensor's axes can be read back.")
    logits: LogitsResult | None = Field(
        None, description="The logits the request's ``logits`` asked for (null: not asked).")
    loss: LossResult | None = Field(
        None, description="Per-token next-token loss and its mean (null: ``loss`` false).")
    metrics: dict[str, MetricResult] = Field(description="Declared metrics by name.")
    grads: dict[str, WireTensor] = Field(
        description="Hook name -> d(grad.metric value)/d(hook), the hook's full shape.")
    grad_value: float | None = Field(None, description="The differentiated metric's value.")


class HookInfo(LenientModel):
    name: str = Field(description="TransformerLens 4.x hook name.")
    axes: list[str] = Field(description="Axis names, e.g. ['batch', 'pos', 'head', 'd_head'].")
    shape: list[int | None] = Field(description="Axis sizes; null where the size is the "
                                    "request's (batch, pos, query_pos, key_pos).")
    layer: int | None = Field(description="The block, or null for model-level hooks.")


class HooksResponse(LenientModel):
    model: ModelRef
    hooks: list[HookInfo] = Field(description="Every hook point, in forward order.")
