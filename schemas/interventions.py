"""POST /v1/predictions, /v1/ablate and /v1/patch: next-token predictions and interventions.

S004 (004_e7341cee07d297e4.txt, docs/sources.md): attention is a map of where the model looks,
not of what decides; "verify with an intervention — ablate the head or patch its activation and
see whether the behaviour changes". Units: log-probabilities, losses, entropies and KL
divergences in nats; logits are the LM head's raw scores. A head's output ``z`` is its
attention-weighted values before the output projection (TransformerLens ``hook_z``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, model_validator

from .common import (
    EXAMPLE_TEXT, MAX_HEAD_PAIRS, MAX_POSITIONS, MAX_TEXTS, LenientModel, ModelRef, NonBlankText,
    StrictModel, TensorField, TensorOptions, TextOrTexts, Token, example,
)
from .common import (
    TOKEN_LISTS_DOC, TOKENS_DOC, TokenIds, add_bos_echo, add_bos_field, one_input,
)
from .common import BATCH, BYTES_DOC, LABEL_DOC, PARTIAL_DOC, NestedNumbers, field_error
from .common import (
    INDEX_MARK, _schema_extra, cases, equals, ids_as_given, index_list, index_of, one_of, present, unset, when,
)

_RESAMPLE = ("resample_text", "resample_tokens")
_REFERENCE = ("reference_texts", "reference_token_lists")
NOT_ADD_BOS = {"properties": {"add_bos": {"not": {"const": True}}}}
"""Token ids are used as given: add_bos is not true (resolve in service/serving/core/inputs.py)."""
NOT_RESAMPLE = {"properties": {"method": {"not": {"const": "resample"}}}}

#: most components ablated together in one /v1/ablate request
MAX_COMPONENTS = 4096
#: most (clean, corrupted) pairs of one /v1/patch request, texts of one /v1/ablate request (the
#: device budget usually binds first)
MAX_PATCH_PAIRS = 4096
#: most entries of a direction vector (d_model, d_mlp or d_head of any served model)
MAX_VECTOR = 1 << 16

Index = Annotated[int, Field(ge=0)]
Layer = Annotated[int, Field(ge=0, json_schema_extra={INDEX_MARK: "layer"})]
HeadIndex = Annotated[int, Field(ge=0, json_schema_extra={INDEX_MARK: "head"})]
HeadRef = Annotated[list[Index], Field(min_length=2, max_length=2, json_schema_extra={
    "prefixItems": [{"type": "integer", "minimum": 0, INDEX_MARK: "layer"},
                    {"type": "integer", "minimum": 0, INDEX_MARK: "head"}]})]
"""A [layer, head] pair."""


class TokenRef(LenientModel):
    id: int = Field(description="Vocabulary id.")
    label: str = Field(description=LABEL_DOC)
    bytes: str = Field(description=BYTES_DOC)
    partial: bool = Field(description=PARTIAL_DOC)


class TopToken(LenientModel):
    id: int = Field(description="Vocabulary id.")
    label: str = Field(description=LABEL_DOC)
    bytes: str = Field(description=BYTES_DOC)
    partial: bool = Field(description=PARTIAL_DOC)
    prob: float = Field(description="Probability in [0, 1] (softmax of the logits).")
    logit: float = Field(description="Raw LM-head logit.")


# run.py imports TopToken from here: its Metric is imported once TopToken exists (the package's
# __init__ imports this module first, so the order holds for every import path)
from .run import Metric, pairs_metric_rules  # noqa: E402

# ------------------------------------------------------------------------ predictions
class PredictionsRequest(TextOrTexts):
    """Next-token predictions of a causal LM at every position (or chosen ``positions``)."""

    top_k: int = Field(5, ge=1, le=100, description="Most probable next tokens per position.")
    positions: list[Index] | None = Field(
        None, max_length=MAX_POSITIONS, fail_fast=True, json_schema_extra=index_list(),
        description="Positions to report (each < the text's token count, each once; at most "
        f"{MAX_POSITIONS}); null = all. Position p predicts token p + 1."
    )


class PositionPrediction(LenientModel):
    position: int = Field(description="Position p (its logits predict token p + 1).")
    token: str = Field(description="Label of the token at p.")
    next_token: TokenRef | None = Field(description="The token that actually follows (null at the last position).")
    next_logprob: float | None = Field(description="log p(actual next token), nats (<= 0).")
    next_rank: int | None = Field(description="Rank of the actual next token: 1 = top choice.")
    loss: float | None = Field(description="Per-token loss -log p(next token), nats.")
    entropy: float = Field(description="Entropy of the next-token distribution, nats.")
    top: list[TopToken] = Field(description="The top_k next tokens, most probable first.")


class PredictionResult(LenientModel):
    tokens: list[Token] = Field(description="The analysed tokens.")
    positions: list[PositionPrediction] = Field(description="One entry per reported position.")
    mean_loss: float | None = Field(
        description="Mean per-token loss over the reported positions that have a next token "
        "(nats; Hugging Face's GPT2LMHeadModel loss when all positions are reported); null "
        "when none has."
    )
    n_loss_tokens: int = Field(description="Positions the mean loss averages over.")


class PredictionsResponse(LenientModel):
    model: ModelRef
    add_bos: bool = add_bos_echo()
    predictions: PredictionResult | None = Field(None, description="For a 'text' or 'tokens' request.")
    results: list[PredictionResult] | None = Field(None, description="For 'texts' or 'token_lists', in order.")


# ------------------------------------------------------------------------ ablation
AblationMethod = Literal["zero", "mean", "resample"]
ScanMetric = Literal["loss", "kl", "logit_diff", "metric"]


class LogitDiffOptions(StrictModel):
    """``target`` and ``distractor`` must each be exactly one token of the model's tokenizer
    (GPT-2: mind the leading space, ``" Mary"``); else 422."""

    target: str = Field(min_length=1, description="The token the model should predict.")
    distractor: str = Field(min_length=1, description="The competing token.")
    position: Index | None = Field(
        None, description="Position whose logits are read (predicting the next token); null = "
        "the last position."
    )


class HeadComponent(StrictModel):
    """An attention head: its output z (``blocks.{layer}.attn.hook_z[:, :, head]``)."""

    kind: Literal["head"] = Field(description="'head'.")
    layer: Layer = Field(..., description="The head's layer (0-based).")
    head: HeadIndex = Field(..., description="The head (0-based).")


class MLPComponent(StrictModel):
    """A whole MLP layer: its output ``blocks.{layer}.hook_mlp_out`` ``[pos, d_model]``."""

    kind: Literal["mlp"] = Field(description="'mlp'.")
    layer: Layer = Field(..., description="The MLP's layer (0-based).")


class AttnComponent(StrictModel):
    """A whole attention layer: its output ``blocks.{layer}.hook_attn_out`` ``[pos, d_model]``
    (every head and b_O)."""

    kind: Literal["attn"] = Field(description="'attn'.")
    layer: Layer = Field(..., description="The attention layer (0-based).")


class NeuronComponent(StrictModel):
    """MLP neurons: ``blocks.{layer}.mlp.hook_post[..., neuron]`` (after the activation
    function), each set to 0, to its mean or to the resample text's value."""

    kind: Literal["neuron"] = Field(description="'neuron'.")
    layer: Layer = Field(..., description="The MLP's layer (0-based).")
    neurons: Annotated[list[Index], Field(min_length=1, max_length=MAX_VECTOR,
                                          json_schema_extra=index_list("neuron"))] = Field(
        ..., description="Neuron indices (each < d_mlp, each once).")


class DirectionComponent(StrictModel):
    """A direction at a hook: the component of each vector of the hook's last axis along the
    unit vector ``u = vector / |vector|`` is removed (zero: ``x - (x . u) u``, projection out),
    or set to its mean ``x - (x . u) u + mean(x . u) u`` (mean over the text's or the
    reference texts' positions) or to the resample text's ``(x_r . u) u``."""

    kind: Literal["direction"] = Field(description="'direction'.")
    hook: str = Field(..., min_length=1, max_length=200,
                      description="A per-layer TransformerLens hook name (``blocks.3.hook_resid_"
                      "post``, ``blocks.0.attn.hook_z``, ``blocks.1.mlp.hook_post``, ...), not "
                      "the pattern or scores.")
    vector: Annotated[list[float], Field(min_length=1, max_length=MAX_VECTOR)] = Field(
        ..., description="The direction: as many entries as the hook's last axis (d_model, "
        "d_mlp, d_head); normalised to unit length (a zero vector is 422).")
    positions: list[Index] | None = Field(
        None, max_length=MAX_POSITIONS, fail_fast=True, json_schema_extra=index_list(),
        description="Positions where the direction is ablated (each once); null = all.")


Component = Annotated[
    Union[HeadComponent, MLPComponent, AttnComponent, NeuronComponent, DirectionComponent],
    Field(discriminator="kind"),
]

DECLARED_METRIC_DOC = (
    "A declared metric (/v1/run's: logit_diff / prob / logprob / loss / kl with their terms, "
    "reduce 'mean' or 'sum'), read on each run alone: every term's ``prompt`` is null or 0 (the "
    "run measured); a 'kl' term names two runs, 0 = the run measured and 1 = the reference "
    "run ({reference}): ``prompt`` 1, ``reference_prompt`` 0 is KL(P_reference ‖ P_run). A "
    "'loss' term's target is the {loss_text} token at position + 1. Positions negative from "
    "the end.")


class AblateRequest(TensorOptions):
    """Ablate chosen attention heads (or, with ``scan``, every head alone) of a causal LM on
    one text and report what changes in the next-token predictions."""

    model_config = example(text=EXAMPLE_TEXT, heads=[[0, 0]])
    # three groups of exclusive cases (fewer cases for a generator to intersect than one rule
    # per check): the input, the method's own inputs, the scan
    json_rules = (
        cases(  # one text, or a dataset (not resampled, no patterns); token ids as given
            [present("text"), unset("tokens", "texts", "token_lists"),
             equals("per_text", False, False)],
            [present("tokens"), unset("text", "texts", "token_lists"),
             equals("per_text", False, False), NOT_ADD_BOS],
            [present("texts"), unset("text", "tokens", "token_lists"), NOT_RESAMPLE,
             equals("include_patterns", False, False)],
            [present("token_lists"), unset("text", "tokens", "texts"), NOT_RESAMPLE,
             equals("include_patterns", False, False), NOT_ADD_BOS]),
        cases(  # resample_text / _tokens for 'resample' only, reference_* for 'mean' only
            [equals("method", "zero", "zero"), unset(*_RESAMPLE, *_REFERENCE)],
            # (not both reference_texts and reference_token_lists: unstated, one more case
            # than schemathesis' canonical form takes)
            [equals("method", "mean", "zero"), unset(*_RESAMPLE)],
            [equals("method", "resample", "zero"), unset(*_REFERENCE), one_of(*_RESAMPLE)]),
        cases(  # a scan (no heads, no components, no patterns) or heads / components
            [equals("scan", True, False), unset("heads", "components"),
             equals("include_patterns", False, False),
             {"properties": {"scan_metric": {"enum": ["loss", "kl"]}}}],
            [equals("scan", True, False), unset("heads", "components"),
             equals("include_patterns", False, False), equals("scan_metric", "metric", "loss"),
             present("metric")],
            [equals("scan", True, False), unset("heads", "components"),
             equals("include_patterns", False, False),
             equals("scan_metric", "logit_diff", "loss"), present("logit_diff")],
            [equals("scan", False, False), present("heads")],
            [equals("scan", False, False), unset("heads"), present("components")]),
    )

    text: NonBlankText | None = Field(None, description="The text to run (or tokens).")
    tokens: list[int] | None = Field(
        None, min_length=1, max_length=MAX_POSITIONS, fail_fast=True,
        json_schema_extra=index_of("token"),
        description=TOKENS_DOC.format(text="text"))
    add_bos: bool | None = add_bos_field()
    heads: list[HeadRef] | None = Field(
        None, max_length=MAX_HEAD_PAIRS, fail_fast=True,
        json_schema_extra=_schema_extra("array", minItems=1, uniqueItems=True),
        description="Heads to ablate together, as [layer, head] pairs (0-based, each "
        f"once; at most {MAX_HEAD_PAIRS}); required unless scan or components."
    )
    components: list[Component] | None = Field(
        None, min_length=1, max_length=MAX_COMPONENTS,
        json_schema_extra=_schema_extra("array", uniqueItems=True),
        description="Components ablated together (with ``heads``, if given): heads, whole "
        "MLPs (``hook_mlp_out``), whole attention layers (``hook_attn_out``), MLP neurons "
        "(``mlp.hook_post[..., n]``) and directions at a hook (projection out of a unit "
        "vector), each by ``method``. Not with scan.")
    metric: Metric | None = Field(
        None, description=DECLARED_METRIC_DOC.format(
            reference="the clean, unablated run", loss_text="text's own") + " Reported "
        "clean and ablated (``metric``); with scan and scan_metric 'metric', the scan's.")
    method: AblationMethod = Field(
        "zero", description="'zero': z set to 0 (TransformerLens hook_z); 'mean': z replaced by "
        "its mean over the text's positions, or over reference_texts' positions; 'resample': z "
        "taken from resample_text (same token count) at each position."
    )
    reference_texts: list[NonBlankText] | None = Field(
        None, max_length=MAX_TEXTS, fail_fast=True, json_schema_extra=BATCH,
        description="method 'mean': texts whose z, pooled over all their positions, give "
        "the mean (default: the text itself). At most max_batch (a setting, default 32; never "
        f"more than {MAX_TEXTS})."
    )
    reference_token_lists: list[TokenIds] | None = Field(
        None, max_length=MAX_TEXTS, fail_fast=True, json_schema_extra=BATCH,
        description=TOKEN_LISTS_DOC.format(texts="reference_texts"))
    resample_text: NonBlankText | None = Field(
        None, description="method 'resample': the text whose z replaces the ablated heads' (same "
        "token count as text)."
    )
    resample_tokens: list[int] | None = Field(
        None, min_length=1, max_length=MAX_POSITIONS, fail_fast=True,
        json_schema_extra=index_of("token"),
        description=TOKENS_DOC.format(text="resample_text"))
    positions: list[Index] | None = Field(
        None, max_length=MAX_POSITIONS, fail_fast=True, json_schema_extra=index_list(),
        description=f"Positions to report / score (each < token count, once; at most "
        f"{MAX_POSITIONS}); null = all."
    )
    top_k: int = Field(5, ge=1, le=100, description="Top next tokens before/after per position.")
    logit_diff: LogitDiffOptions | None = Field(
        None, description="Also report logit[target] - logit[distractor] before and after."
    )
    include_patterns: bool = Field(
        False, description="Return the attention patterns after the ablation [layer, head, "
        "query_pos, key_pos] (later layers change), in /v1/attention's encodings."
    )
    layout: Literal["full", "tril"] = Field("full", description="Patterns: 'tril' sends the lower triangle.")
    scan: bool = Field(
        False, description="Ablate every head alone instead (heads must be null): an effect grid "
        "[layer, head] on scan_metric."
    )
    scan_metric: ScanMetric = Field(
        "loss", description="scan: 'loss' = mean loss at positions; 'kl' = mean KL(clean ‖ "
        "ablated) over positions; 'logit_diff' (needs logit_diff); 'metric' (the declared "
        "``metric``)."
    )

    texts: list[NonBlankText] | None = Field(
        None, min_length=1, max_length=MAX_PATCH_PAIRS,
        description="A dataset of texts instead of text: the same ablation on each text (as a "
        "request of its own), the metrics per text and averaged (``dataset``; the top-level "
        "mean_loss_* / mean_kl / logit_diff / metric / scan are the means over texts). Method "
        "'mean': the means over every position of the whole dataset (or of reference_texts). "
        f"Not with resample. At most {MAX_PATCH_PAIRS}.")
    token_lists: list[TokenIds] | None = Field(
        None, min_length=1, max_length=MAX_PATCH_PAIRS,
        description=TOKEN_LISTS_DOC.format(texts="texts"))
    per_text: bool = Field(False, description="texts: also every text's values "
                           "(``dataset.stats.*.values``).")

    @model_validator(mode="after")
    def _consistent(self):
        if self.texts is not None or self.token_lists is not None:
            one_input(self, "texts")
            for f in ("text", "tokens"):
                if getattr(self, f) is not None:
                    raise ValueError(f"{f}: give either one text or a dataset (texts / "
                                     "token_lists), not both")
            if self.method == "resample":
                raise ValueError("method 'resample' takes one resample_text for one text: with a "
                                 "dataset use 'zero' or 'mean'")
            if self.include_patterns:
                raise ValueError("include_patterns applies to one text, not a dataset")
        else:
            one_input(self, "text")
            if self.per_text:
                raise ValueError("per_text applies to a dataset (texts / token_lists)")
        one_input(self, "reference_texts", required=False)
        one_input(self, "resample_text", required=False)
        if self.scan and (self.heads is not None or self.components is not None):
            raise ValueError("scan ablates every head alone: leave heads and components null")
        if not self.scan and self.heads is None and self.components is None:
            raise ValueError("heads is required (a list of [layer, head] pairs) unless scan is "
                             "true or components are given")
        if self.scan_metric == "metric" and self.scan and self.metric is None:
            raise ValueError("scan_metric 'metric' needs metric (a declared metric)")
        if self.heads is not None and len(self.heads) == 0:
            raise ValueError("heads must hold at least one [layer, head] pair")
        resample = "resample_text" if self.resample_text is not None else "resample_tokens"
        if self.method != "resample" and getattr(self, resample) is not None:
            raise ValueError(f"{resample} applies to method 'resample' only")
        if self.method == "resample" and getattr(self, resample) is None:
            raise ValueError("method 'resample' needs resample_text (or resample_tokens)")
        reference = ("reference_texts" if self.reference_texts is not None
                     else "reference_token_lists")
        if self.method != "mean" and getattr(self, reference) is not None:
            raise ValueError(f"{reference} applies to method 'mean' only")
        if getattr(self, reference) is not None and len(getattr(self, reference)) == 0:
            raise ValueError(f"{reference} must hold at least one "
                             f"{'text' if reference == 'reference_texts' else 'sequence'} "
                             "(or be null)")
        if self.scan_metric == "logit_diff" and self.scan and self.logit_diff is None:
            raise field_error(type(self), ("logit_diff",), "scan_metric 'logit_diff' needs "
                              "logit_diff {target, distractor}", missing=True)
        if self.include_patterns and self.scan:
            raise ValueError("include_patterns applies to a single ablation, not a scan")
        return self


class AblatedPosition(LenientModel):
    position: int = Field(description="Position p (its logits predict token p + 1).")
    token: str = Field(description="Label of the token at the position.")
    next_token: TokenRef | None = Field(description="The actual next token (null at the end).")
    loss_clean: float | None = Field(description="-log p(next token), clean run, nats.")
    loss_ablated: float | None = Field(description="The same with the heads ablated.")
    delta_loss: float | None = Field(description="loss_ablated - loss_clean, nats.")
    kl: float | None = Field(description="KL(clean ‖ ablated) of the next-token distributions, nats (>= 0); null if not finite.")
    top_clean: list[TopToken] = Field(description="The top_k next tokens of the clean run.")
    top_ablated: list[TopToken] = Field(description="The top_k next tokens with the heads ablated.")


class LogitDiff(LenientModel):
    target: TokenRef
    distractor: TokenRef
    position: int = Field(description="Position whose logits were read.")
    clean: float = Field(description="logit[target] - logit[distractor], clean run.")
    ablated: float | None = Field(None, description="The same after the ablation (not in a scan).")


class AblateScan(LenientModel):
    metric: ScanMetric = Field(description="The scan metric, as requested.")
    clean: float | None = Field(description="The metric on the clean run (KL: 0).")
    grid: list[list[float | None]] = Field(description="[layer][head]: the metric with that head ablated alone.")
    effect: list[list[float | None]] = Field(
        description="[layer][head]: grid - clean (loss/logit_diff change; KL itself)."
    )


class AblateResponse(LenientModel):
    model: ModelRef
    add_bos: bool = add_bos_echo()
    tokens: list[Token] = Field(description="The analysed tokens of text.")
    method: AblationMethod = Field(description="The ablation method, as requested.")
    heads: list[list[int]] | None = Field(description="The heads ablated together (null in a scan).")
    positions: list[AblatedPosition] | None = Field(None, description="Single ablation: per reported position.")
    mean_loss_clean: float | None = Field(None, description="Mean loss over the reported positions with a next token.")
    mean_loss_ablated: float | None = Field(None, description="The same with the heads ablated.")
    mean_kl: float | None = Field(None, description="Mean KL over the reported positions.")
    logit_diff: LogitDiff | None = Field(None, description="The logit difference before/after (if asked).")
    patterns: TensorField | None = Field(
        None, description="include_patterns: patterns after the ablation [layer, head, query_pos, key_pos]."
    )
    scan: AblateScan | None = Field(None, description="scan: the effect grid.")
    components: list[dict[str, Any]] | None = Field(
        None, description="The components ablated (``heads`` as head components first), as "
        "resolved: kind, layer, head / neurons / hook, and for directions the unit vector's "
        "norm before normalising.")
    metric: "DeclaredMetricValues | None" = Field(
        None, description="The declared metric (if asked) on the clean and the ablated run.")
    dataset: "AblateDataset | None" = Field(
        None, description="texts / token_lists: per-text metrics and their spread (the fields "
        "above are then means over texts; tokens is empty, positions null).")


class AblateDataset(LenientModel):
    n_texts: int = Field(description="Texts in the dataset.")
    n_tokens: list[int] = Field(description="Each text's token count, in request order.")
    mean_over: str = Field(description="method 'mean': what the means were taken over "
                           "('dataset' = every position of every text, or 'reference_texts'); "
                           "'' otherwise.")
    stats: dict[str, "PatchStatistic"] = Field(
        description="Per metric (mean_loss_clean, mean_loss_ablated, delta_loss, mean_kl, "
        "logit_diff_clean, logit_diff_ablated, metric_clean, metric_ablated, scan_clean, where "
        "they apply): mean over texts (float64), std (ddof 1), sem = std / sqrt(n), n, values "
        "(per_text).")
    scan_std: list[list[float | None]] | None = Field(
        None, description="scan: [layer][head] sample std (ddof 1) over texts of the grid.")
    scan_sem: list[list[float | None]] | None = Field(
        None, description="scan: scan_std / sqrt(n).")
    per_text_scan: NestedNumbers | None = Field(None, description="scan and per_text: [text][layer]"
                                            "[head].")


class DeclaredMetricValues(LenientModel):
    kind: str = Field(description="The declared metric's kind.")
    reduce: str = Field(description="'mean' or 'sum' of its terms.")
    clean: float = Field(description="On the clean (unablated) run.")
    ablated: float | None = Field(None, description="On the ablated run (not in a scan).")
    resample: float | None = Field(
        None, description="method 'resample': on the resample text's own run.")
    normalized: float | None = Field(
        None, description="method 'resample': (ablated - resample) / (clean - resample), the "
        "share of the clean behaviour kept (1 = ablating changed nothing, 0 = as far as the "
        "resample text's run; Wang et al. 2022); null otherwise or when clean == resample.")



# ------------------------------------------------------------------------ patching
PatchHook = Literal["z", "q", "k", "v", "pattern", "resid_pre", "resid_mid", "resid_post",
                    "attn_out", "mlp_out"]


class PatchPair(StrictModel):
    """One (clean, corrupted) pair of a /v1/patch dataset (/v1/path-patch's ``pairs``
    convention): each side as token ids (used exactly as given) or as a text (tokenized with
    ``add_bos``). Both sides have the same token count; pairs may differ from each other
    (grids without a position axis only)."""

    json_rules = (one_of("clean_tokens", "clean_text"),
                  one_of("corrupted_tokens", "corrupted_text"))

    clean_tokens: Annotated[list[Index], Field(min_length=1, max_length=MAX_POSITIONS,
                                               json_schema_extra=index_of("token"))] | None \
        = Field(None, description="The clean prompt as token ids.")
    clean_text: NonBlankText | None = Field(None, description="The clean prompt as a text.")
    corrupted_tokens: Annotated[list[Index], Field(min_length=1, max_length=MAX_POSITIONS,
                                                   json_schema_extra=index_of("token"))] \
        | None = Field(None, description="The corrupted prompt as token ids.")
    corrupted_text: NonBlankText | None = Field(None, description="The corrupted prompt as a "
                                                "text.")
    metric: Metric | None = Field(
        None, description="This pair's own declared metric (e.g. its own target and distractor), "
        "of the request's declared metric's kind and reduce; null = the request's.")

    @model_validator(mode="after")
    def _one_each(self):
        for side in ("clean", "corrupted"):
            if (getattr(self, f"{side}_tokens") is None) == (getattr(self, f"{side}_text") is None):
                raise ValueError(f"give exactly one of '{side}_tokens' or '{side}_text'")
        return self


class PatchRequest(StrictModel):
    """Activation patching clean -> corrupted (TransformerLens ``patching``): the clean run's
    head outputs (and residual stream) patched into the corrupted run one at a time."""

    model_config = example(
        clean_text="When Mary and John went to the store, she gave a drink to",
        corrupted_text="When Mary and John went to the store, he gave a drink to",
        logit_diff={"target": " him", "distractor": " her"})
    json_rules = (
        {"anyOf": [  # a dataset of pairs, or one clean and one corrupted prompt
            {"allOf": [present("pairs"),
                       unset("clean_text", "clean_tokens", "corrupted_text", "corrupted_tokens"),
                       equals("per_position", False, False), equals("residual", False, False)]},
            {"allOf": [unset("pairs"), one_of("clean_text", "clean_tokens"),
                       one_of("corrupted_text", "corrupted_tokens"),
                       equals("per_pair", False, False)]}]},
        ids_as_given("clean_tokens", "corrupted_tokens"),
        when({"allOf": [present("pairs"), {"properties": {"pairs": {
            "contains": present("metric")}}}]},
            {"required": ["metric"], "properties": {"metric": {"type": "object"}}}),
        *pairs_metric_rules(kinds=False),
        cases(  # logit_diff for 'logit_diff' (the default), positions for 'loss' only
            [equals("metric", "logit_diff", "logit_diff"), present("logit_diff"),
             unset("positions")],
            [equals("metric", "loss", "logit_diff")],
            [{"required": ["metric"], "properties": {"metric": {"type": "object"}}},
             unset("logit_diff", "positions")]),
        cases(  # a hook's grid, or the head grid (per_position, residual)
            [present("hook"), equals("per_position", False, False),
             equals("residual", False, False)],
            [unset("hook", "patch_layers", "patch_heads", "patch_positions"),
             equals("by_position", False, False)]),
        when(equals("residual", True, False), equals("method", "exact", "exact")),
    )

    clean_text: NonBlankText | None = Field(
        None, description="The clean prompt (the behaviour to restore); or clean_tokens.")
    clean_tokens: list[int] | None = Field(
        None, min_length=1, max_length=MAX_POSITIONS, fail_fast=True,
        json_schema_extra=index_of("token"),
        description=TOKENS_DOC.format(text="clean_text"))
    corrupted_text: NonBlankText | None = Field(
        None, description="The corrupted prompt, same token count; or corrupted_tokens.")
    corrupted_tokens: list[int] | None = Field(
        None, min_length=1, max_length=MAX_POSITIONS, fail_fast=True,
        json_schema_extra=index_of("token"),
        description=TOKENS_DOC.format(text="corrupted_text"))
    add_bos: bool | None = add_bos_field()
    metric: Union[Literal["logit_diff", "loss"], Metric] = Field(
        "logit_diff", description="'logit_diff': logit[target] - logit[distractor] at "
        "logit_diff.position; 'loss': mean loss of the clean text's next tokens at positions; "
        "or " + DECLARED_METRIC_DOC.format(reference="the clean run", loss_text="clean "
                                           "text's")
    )
    logit_diff: LogitDiffOptions | None = Field(None, description="Metric 'logit_diff': the tokens.")
    positions: list[Index] | None = Field(
        None, max_length=MAX_POSITIONS, fail_fast=True, json_schema_extra=index_list(),
        description=f"Metric 'loss': the positions scored (each once; at most {MAX_POSITIONS}); "
        "null = all with a next token."
    )
    method: Literal["exact", "attribution"] = Field(
        "exact", description="'exact': one patched forward per cell (batched); 'attribution': "
        "the linear approximation grad . (z_clean - z_corrupted) from one clean forward, one "
        "corrupted forward and one backward (Nanda 2023; Kramár et al. 2024)."
    )
    per_position: bool = Field(False, description="Also the [layer, head, pos] grid (one position patched at a time).")
    residual: bool = Field(False, description="Also residual-stream patching [layer, pos] (resid_pre; exact only).")
    hook: PatchHook | None = Field(
        None, description="Patch at this hook of every layer instead -> ``grid`` shaped as "
        "TransformerLens 4.3's ``get_act_patch_*`` returns it: 'resid_pre' / 'resid_mid' / "
        "'resid_post' / 'attn_out' / 'mlp_out' ``[layer, pos]`` (one position patched at a "
        "time); 'z' / 'q' / 'k' / 'v' ``[layer, head]`` (one head at every position) or, "
        "``by_position``, ``[layer, pos, head]``; 'pattern' ``[layer, head]`` or ``[layer, "
        "head, dest_pos]``. Null: the head grid ``heads`` (z) as before.")
    by_position: bool = Field(
        False, description="hook 'z'/'q'/'k'/'v'/'pattern': one (position, head) cell at a time "
        "(TL ``..._by_pos``). Position hooks are always by position.")
    patch_layers: list[Index] | None = Field(
        None, max_length=MAX_POSITIONS, fail_fast=True, json_schema_extra=index_list("layer"),
        description="hook: the layers computed (each once); the others' cells are null. Null = "
        "all.")
    patch_heads: list[Index] | None = Field(
        None, max_length=MAX_POSITIONS, fail_fast=True, json_schema_extra=index_list("head"),
        description="hook with a head axis: the heads computed; the others' cells are null.")
    patch_positions: list[Index] | None = Field(
        None, max_length=MAX_POSITIONS, fail_fast=True, json_schema_extra=index_list(),
        description="hook: by position (and position hooks), the positions computed (others "
        "null); for a head's all-position patch, the positions patched together. Null = all.")
    pairs: list[PatchPair] | None = Field(
        None, min_length=1, max_length=MAX_PATCH_PAIRS,
        description="A dataset of (clean, corrupted) pairs instead of clean_*/corrupted_* (as "
        "/v1/path-patch's ``pairs``): every pair patched as a request of its own, the grids' "
        "mean over pairs in ``grid`` / ``heads_raw`` / ``clean_value`` / ``corrupted_value``, "
        "``grid.normalized`` / ``heads`` normalised of those means, and the spread and the mean "
        "of per-pair normalised values in ``dataset``. Grids with a position axis need every "
        f"pair of one length. At most {MAX_PATCH_PAIRS}.")
    per_pair: bool = Field(
        False, description="pairs: also every pair's values (``dataset.per_pair``).")

    @model_validator(mode="after")
    def _consistent(self):
        if self.pairs is not None:
            for f in ("clean_text", "clean_tokens", "corrupted_text", "corrupted_tokens"):
                if getattr(self, f) is not None:
                    raise ValueError(f"{f}: give the prompts either as pairs or as clean_*/"
                                     "corrupted_*, not both")
            if self.per_position or self.residual:
                raise ValueError("per_position / residual with pairs: use hook 'z' with "
                                 "by_position, or hook 'resid_pre'")
        else:
            one_input(self, "clean_text")
            one_input(self, "corrupted_text")
            if self.per_pair:
                raise ValueError("per_pair applies to a dataset (pairs)")
        if self.pairs is not None and any(p.metric is not None for p in self.pairs) \
                and isinstance(self.metric, str):
            raise ValueError("a pair's own metric needs a declared metric on the request (its "
                             "kind and reduce)")
        if self.metric == "logit_diff" and self.logit_diff is None:
            raise field_error(type(self), ("logit_diff",), "metric 'logit_diff' (the default) "
                              "needs logit_diff {target, distractor}, or a declared metric",
                              missing=True)
        if self.metric != "loss" and self.positions is not None:
            raise ValueError("positions applies to metric 'loss' only")
        if not isinstance(self.metric, str) and self.logit_diff is not None:
            raise ValueError("logit_diff applies to metric 'logit_diff' only (a declared metric "
                             "names its tokens in its terms)")
        if self.hook is not None and (self.per_position or self.residual):
            raise ValueError("per_position and residual belong to the head grid: with hook, use "
                             "by_position (or hook 'resid_pre')")
        if self.hook is None:
            for f in ("patch_layers", "patch_heads", "patch_positions"):
                if getattr(self, f) is not None:
                    raise ValueError(f"{f} selects cells of a hook's grid: give hook")
            if self.by_position:
                raise ValueError("by_position applies to a hook's grid: give hook (or use "
                                 "per_position for the head grid)")
        if self.residual and self.method == "attribution":
            raise ValueError("residual patching is exact only (method 'exact')")
        return self


class PatchResponse(LenientModel):
    model: ModelRef
    add_bos: bool = add_bos_echo()
    clean_tokens: list[Token] = Field(description="The clean text's tokens.")
    corrupted_tokens: list[Token] = Field(description="The corrupted text's tokens (same count).")
    metric: str = Field(description="The metric's kind, as requested ('logit_diff', 'loss', "
                        "or a declared metric's kind).")
    method: Literal["exact", "attribution"] = Field(description="The method, as requested.")
    logit_diff: LogitDiff | None = Field(None, description="The metric's tokens and position.")
    clean_value: float = Field(description="The metric on the clean run.")
    corrupted_value: float = Field(description="The metric on the corrupted run.")
    heads: list[list[float | None]] | None = Field(
        None, description="[layer][head]: normalised metric (patched - corrupted) / (clean - "
        "corrupted) with that head's z patched at every position; null when clean == corrupted. "
        "Null when hook is given (see grid).")
    heads_raw: list[list[float | None]] | None = Field(
        None, description="[layer][head]: the patched metric itself.")
    grid: "PatchGrid | None" = Field(None, description="hook: the grid at that hook.")
    heads_per_position: list[list[list[float | None]]] | None = Field(
        None, description="per_position: [layer][head][pos] normalised."
    )
    residual: list[list[float | None]] | None = Field(
        None, description="residual: [layer][pos] normalised, the residual stream entering the layer patched at pos."
    )
    approximation: str | None = Field(
        None, description="method 'attribution': what the numbers are (a linear approximation)."
    )
    dataset: "PatchDataset | None" = Field(
        None, description="pairs: the dataset's statistics (the fields above are then means "
        "over pairs; clean_tokens / corrupted_tokens are empty, see dataset.pairs).")


class PatchStatistic(LenientModel):
    mean: float = Field(description="Mean over the pairs (float64 of the per-pair values).")
    std: float | None = Field(description="Sample standard deviation over the pairs (ddof 1, "
                              "numpy's ``std(ddof=1)``); null for one pair.")
    sem: float | None = Field(description="Standard error of the mean, std / sqrt(n); null "
                              "for one pair.")
    n: int = Field(description="Pairs averaged.")
    values: list[float] | None = Field(None, description="per_pair: every pair's value, in "
                                       "request order.")


class PatchGridStats(LenientModel):
    """Grid statistics over the pairs, cell by cell, nested lists in the grid's ``axes`` order
    (null where a cell was not computed or is undefined)."""

    raw_std: NestedNumbers = Field(description="Sample std (ddof 1) of the raw metric; null for one "
                               "pair.")
    raw_sem: NestedNumbers = Field(description="raw_std / sqrt(n).")
    normalized_mean: NestedNumbers = Field(
        description="Mean over pairs of each pair's own normalised value (patched_i - "
        "corrupted_i) / (clean_i - corrupted_i) (Heimersheim & Nanda 2024's per-prompt "
        "normalisation), over the ``n_normalized`` pairs where it is defined. Differs from "
        "``normalized_of_means`` (the response's ``grid.normalized`` / ``heads``: (mean patched "
        "- mean corrupted) / (mean clean - mean corrupted), Wang et al. 2022's normalisation of "
        "the dataset means) when pairs' clean - corrupted gaps differ.")
    normalized_std: NestedNumbers = Field(description="Sample std (ddof 1) of the per-pair "
                                      "normalised values.")
    normalized_sem: NestedNumbers = Field(description="normalized_std / sqrt(n_normalized).")
    n_normalized: int = Field(description="Pairs whose normalised value is defined (clean != "
                              "corrupted).")
    per_pair_raw: NestedNumbers | None = Field(None, description="per_pair: ``[pair, *axes]`` raw.")
    per_pair_normalized: NestedNumbers | None = Field(None, description="per_pair: ``[pair, *axes]"
                                                  "`` normalised per pair.")


class PatchDataset(LenientModel):
    n_pairs: int = Field(description="Pairs in the dataset.")
    pairs: list[dict[str, Any]] = Field(description="Per pair, in request order: n_tokens, "
                                        "clean_tokens, corrupted_tokens (as run).")
    clean: PatchStatistic = Field(description="The metric on the clean runs (raw).")
    corrupted: PatchStatistic = Field(description="The metric on the corrupted runs (raw).")
    grid: PatchGridStats = Field(description="The grid's (hook) or the head grid's (no hook) "
                                 "spread and per-pair normalisation.")
    n_forwards: int = Field(description="Patched forwards run over all pairs (hook grids).")
    note: str = Field(description="What the averaged fields are.")


class PatchGrid(LenientModel):
    hook: str = Field(description="The hook, as requested ('z', 'q', ..., 'resid_pre').")
    hook_name: str = Field(description="Its TransformerLens name, ``blocks.{layer}.<suffix>``.")
    function: str = Field(description="The TransformerLens 4.3 ``patching`` function whose "
                          "result this grid equals (same metric, same axes).")
    axes: list[str] = Field(description="The grid's axes, TL's order, e.g. ['layer', 'pos', "
                            "'head'].")
    shape: list[int] = Field(description="Their sizes.")
    raw: NestedNumbers = Field(description="Nested lists in ``axes`` order: the patched run's metric "
                           "(exact) or corrupted + sum grad * (clean - corrupted) (attribution); "
                           "null for cells not computed (patch_layers / heads / positions).")
    normalized: NestedNumbers = Field(description="(raw - corrupted) / (clean - corrupted) per cell "
                                  "(0 = no change, 1 = the clean value restored; Wang et al. "
                                  "2022; Heimersheim & Nanda 2024); null where undefined.")
    n_forwards: int = Field(description="Batched patched forwards run for the grid (0 for "
                            "attribution).")
    cells_skipped: int = Field(0, description="Cells not run because they cannot change the "
                               "metric (their value is the corrupted run's, as a run would "
                               "give): the clean activation equals the corrupted one at every "
                               "patched entry (e.g. positions before the prompts' first "
                               "difference), or every patched position comes after the last "
                               "position the metric reads (causal model).")


class ProgressReport(LenientModel):
    done: int = Field(description="Units of the job done so far (0 at the start; == total at "
                      "the end).")
    total: int = Field(description="Units of the whole job.")
    unit: str = Field(description="What is counted: 'cells' (/v1/patch of one pair: the cells "
                      "of the grids asked), 'pairs' (/v1/patch over pairs, /v1/path-patch: "
                      "pairs done).")


class ProgressLine(LenientModel):
    """One progress line of a streamed answer (``Accept: application/x-ndjson``, docs/api.md
    "Streamed progress"): every line but the last is one of these; the last line is the
    endpoint's normal response body, or the error envelope when the job failed after the
    stream began (the status is 200 by then)."""

    progress: ProgressReport = Field(description="The job's progress at the time of the line.")


AblateResponse.model_rebuild()
AblateDataset.model_rebuild()
PatchResponse.model_rebuild()
