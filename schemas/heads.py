"""POST /v1/heads: classify every attention head from its scores."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from .common import (
    INDEX_MARK, MAX_HEAD_PAIRS, LenientModel, ModelRef, StrictModel, TextOrTexts, Token,
    _schema_extra, add_bos_echo,
)

ErrorMeasure = Literal["mul", "abs"]
#: one head as [layer, head] (0-based), as TransformerLens' detect_head(heads=[(layer, head)])
HeadPair = Annotated[list[Annotated[int, Field(ge=0)]], Field(
    min_length=2, max_length=2, json_schema_extra={
        "prefixItems": [{"type": "integer", "minimum": 0, INDEX_MARK: "layer"},
                        {"type": "integer", "minimum": 0, INDEX_MARK: "head"}]})]
#: a list of heads, each once (the service refuses a repeat)
DISTINCT = _schema_extra("array", uniqueItems=True)

HeadLabel = Literal[
    "induction", "previous_token", "duplicate_token", "next_token", "self", "sink", "broad", "none"
]


def _th(default: float, what: str) -> object:
    return Field(default, ge=0.0, le=1.0, description=what + f" Default {default}.")


class HeadThresholds(StrictModel):
    """Thresholds of the labels: a label needs its score strictly above its threshold. Labels
    are tried in the order induction, previous_token, duplicate_token, next_token, self, sink,
    broad; the first that passes wins, else 'none'. Give only the ones to change."""

    # The one place these values are written: the serving layer passes them to the analysis
    # (service/analysis/heads.py), which has none of its own. previous_token and sink are
    # S004's (004_e7341cee07d297e4.txt); the others are ours.

    induction: float = _th(
        0.3, "Compared with scores.induction_probe when the probe ran, else scores.induction."
    )
    previous_token: float = _th(0.5, "Compared with scores.previous_s004 (S004's own formula "
                                "and threshold: mean of M[i, i-1] over rows i >= 1, > 0.5).")
    duplicate_token: float = _th(0.3, "Compared with scores.duplicate_token.")
    next_token: float = _th(0.5, "Compared with scores.next_token (encoders only).")
    self: float = _th(0.5, "Compared with scores.self.")
    sink: float = _th(0.6, "Compared with scores.sink_s004 (S004: M[:, 0].mean() > 0.6).")
    broad: float = _th(0.8, "Compared with scores.entropy_normalized.")


class InductionProbe(StrictModel):
    """Induction probe (Olsson et al. 2022): a start token and a seeded random segment of
    distinct non-special token ids, repeated; encoders get [CLS] ... [SEP] around it."""

    enabled: bool = Field(True, description="Run the probe (one extra forward, cached).")
    segment_length: int = Field(
        25, ge=1, le=4096, description="Tokens in the random segment (default 25). The probe "
        "(1 start token [+1 for encoders' SEP] + segment_length x repeats) must fit in n_ctx."
    )
    repeats: int = Field(4, ge=2, le=64, description="Copies of the segment (default 4, >= 2).")
    seed: int = Field(
        0, ge=0, le=2**63 - 1, description="Seed of torch.Generator for the segment (default 0)."
    )


class HeadsRequest(TextOrTexts):
    """Scores and a label for every head, from one text or several (scores averaged over texts)."""

    thresholds: HeadThresholds = Field(
        default_factory=HeadThresholds, description="Label thresholds (defaults documented per field)."
    )
    probe: InductionProbe = Field(
        default_factory=InductionProbe, description="The induction probe (on by default)."
    )
    exclude_bos: bool = Field(
        False, description="TransformerLens detect_head option for previous_token, "
        "duplicate_token, induction and next_token: zero the attention to key position 0 "
        "(BOS / [CLS] / first token) before scoring."
    )
    exclude_current_token: bool = Field(
        False, description="TransformerLens detect_head option for the same scores: zero each "
        "query's attention to itself before scoring."
    )
    error_measure: ErrorMeasure = Field(
        "mul", description="TransformerLens 4.3 detect_head's error_measure for previous_token, "
        "duplicate_token, induction and next_token. 'mul' (default): fraction of the head's "
        "attention mass on the detection pattern P, sum(A*P)/sum(A), in [0, 1]. 'abs': "
        "1 - round(sum|A - P| / T, 3) (TransformerLens' 1 - round(mean|A - P| * T, 3), its "
        "3-decimal rounding included; the exclusions zero |A - P| in column 0 / on the "
        "diagonal), in (-1, 1], 1 = exactly the pattern. The labels compare their thresholds "
        "with the scores as measured (label_scores). The other scores do not depend on it."
    )
    heads: list[HeadPair] | None = Field(
        None, min_length=1, max_length=MAX_HEAD_PAIRS, fail_fast=True, json_schema_extra=DISTINCT,
        description="Score only these heads, as [layer, head] pairs (0-based, each once; at "
        "most " + f"{MAX_HEAD_PAIRS}" + "), as TransformerLens detect_head's heads=[(layer, "
        "head), ...]; null (default) = every head. TransformerLens gives every other head the "
        "score -1; here the others are left out of the response's heads. Echoed as "
        "selected_heads."
    )
    exclude_heads: list[HeadPair] = Field(
        default_factory=list, max_length=MAX_HEAD_PAIRS, fail_fast=True, json_schema_extra=DISTINCT,
        description="Heads to leave out, as [layer, head] pairs (0-based, each once), from "
        "'heads' or from every head; at least one head must remain. Echoed."
    )
    round: int | None = Field(
        None, ge=0, le=10, description="Decimal places for the scores; null = full precision."
    )
    norm_scores: bool = Field(
        True, description="Also report each head's norm-based scores (HeadResult.norm_scores: "
        "the 'no-op attention' on the sink, Kobayashi et al. 2020)."
    )


class HeadScoreSet(LenientModel):
    """Every score of one head (averaged over texts where several were given). null = not
    defined (e.g. next_token for a causal model, induction_probe when the probe is off, a
    pattern score whose remaining attention mass is 0 after exclusions)."""

    previous_token: float | None = Field(
        None, description="TransformerLens detect_head 'previous_token_head' score with the "
        "response's error_measure: 'mul', the fraction of the head's attention mass on key = "
        "query-1, sum(A*P)/sum(A), in [0, 1]; 'abs', 1 - round(sum|A - P| / T, 3), in (-1, 1]. "
        "The same holds for duplicate_token, induction and next_token."
    )
    duplicate_token: float | None = Field(
        None, description="TransformerLens 'duplicate_token_head' score: fraction of attention "
        "mass on earlier copies of the query token, in [0, 1]. 0 for a text without repeats."
    )
    induction: float | None = Field(
        None, description="TransformerLens 'induction_head' score on the text: fraction of "
        "attention mass on tokens right after an earlier copy of the query token, in [0, 1]."
    )
    next_token: float | None = Field(
        None, description="Fraction of attention mass on key = query+1 (same formula), in "
        "[0, 1]; encoders only (null for causal models)."
    )
    self: float | None = Field(
        None, description="Mean over query rows of the attention to itself (diagonal), [0, 1]."
    )
    sink: float | None = Field(
        None, description="Mean over query rows of the attention to position 0 (BOS / [CLS] / "
        "first token; see the response's sink_position), [0, 1] (S004: M[:, 0].mean())."
    )
    previous_s004: float | None = Field(
        None, description="S004's previous-token score: mean of M[i, i-1] over rows i >= 1 "
        "(no exclusions), in [0, 1]; the previous_token threshold is compared with it. "
        "(previous_token above is TransformerLens' sum(A*P)/sum(A), which is this times "
        "(T-1)/T without exclusions.)"
    )
    sink_s004: float | None = Field(
        None, description="S004's sink score M[:, 0].mean() (equal to sink), in [0, 1]; the "
        "sink threshold is compared with it."
    )
    entropy: float | None = Field(
        None, description="Mean over query rows of the row entropy -sum A ln A, in nats (>= 0)."
    )
    entropy_normalized: float | None = Field(
        None, description="Mean over query rows with >= 2 visible keys of entropy / "
        "ln(visible keys) (q+1 causal, T encoder; min(q+1, w) in a layer with a sliding "
        "window w), in [0, 1]; 1 = uniform attention over the visible keys."
    )
    mean_distance: float | None = Field(
        None, description="Mean over query rows of sum_k A[q,k] |q-k|: expected query-key "
        "distance in tokens, in [0, T-1]."
    )
    induction_probe: float | None = Field(
        None, description="Induction probe score (Olsson et al. 2022): mean over the tokens of "
        "repeats 2..R of the attention mass on the tokens that followed the same token in ALL "
        "earlier repeats, in [0, 1]; null when the probe is off."
    )


class HeadResult(LenientModel):
    layer: int = Field(description="Layer index, from 0.")
    head: int = Field(description="Head index within the layer, from 0.")
    label: HeadLabel = Field(description="The primary label: the first of 'labels' (in "
                             "label_order), else 'none'.")
    labels: list[HeadLabel] = Field(
        default_factory=list, description="Every label whose score passes its threshold, in "
        "label_order (a head can be an induction head and a sink); [] = none.")
    margin: float | None = Field(
        None, description="The primary label's score minus its threshold (> 0); for 'none' the "
        "largest margin over the labels (<= 0: how far the nearest label is). A small "
        "|margin| means the label could flip with the text, the dtype or the rounding.")
    margins: dict[str, float | None] = Field(
        default_factory=dict, description="Per label: its score (response's label_scores) "
        "minus its threshold; null where the score is undefined.")
    scores: HeadScoreSet = Field(description="Every score of this head.")
    norm_scores: "HeadNormScores | None" = Field(
        None, description="Norm-based scores (request norm_scores); null when not asked."
    )


class ProbeInfo(LenientModel):
    segment_length: int = Field(description="Tokens in the random segment.")
    repeats: int = Field(description="Copies of the segment.")
    seed: int = Field(description="Generator seed.")
    start: int = Field(description="Position of the segment's first token (after the start token).")
    method: str = Field(
        "olsson_all_earlier_repeats", description="How the probe is scored: for each query of "
        "repeats 2..R, the attention mass on the successors of its token in ALL earlier repeats "
        "(Olsson et al. 2022), averaged over the (R-1) x segment_length queries.")
    n_queries: int | None = Field(None, description="Queries averaged: (repeats-1) x segment_length.")
    tokens: list[Token] = Field(description="The probe's tokens (ids and labels; no offsets).")


class HeadsResponse(LenientModel):
    model: ModelRef
    n_texts: int = Field(description="Texts the scores are averaged over.")
    n_tokens: list[int] = Field(description="Token count of each text, in order.")
    add_bos: bool = add_bos_echo()
    sink_position: int = Field(
        0, description="The key position the sink scores measure: 0 (BOS with add_bos, [CLS] "
        "for encoders, else the text's first token).")
    sink_tokens: list[str] = Field(
        default_factory=list, description="Per text, the token at sink_position.")
    sink_is_bos: list[bool] = Field(
        default_factory=list, description="Per text, whether the token at sink_position is "
        "the tokenizer's BOS token (false with add_bos false, for a tokenizer without "
        "BOS such as Qwen2's, and for encoders: then the sink scores measure attention to the "
        "text's first token, which the model may or may not use as a sink).")
    dtype: str = Field("float32", description="The dtype the patterns were computed in (the "
                       "model's; scores are then computed in float64).")
    label_scores: dict[str, str] = Field(
        default_factory=dict, description="Per label, the score its threshold is compared with.")
    exclude_bos: bool = Field(description="As requested.")
    exclude_current_token: bool = Field(description="As requested.")
    error_measure: ErrorMeasure = Field(
        "mul", description="As requested: the measure of previous_token, duplicate_token, "
        "induction and next_token ('mul' or 'abs', TransformerLens detect_head's).")
    selected_heads: list[list[int]] | None = Field(
        None, description="The request's heads, as given ([layer, head] pairs); null = every "
        "head.")
    exclude_heads: list[list[int]] = Field(
        default_factory=list, description="The request's exclude_heads, as given.")
    thresholds: HeadThresholds = Field(description="The thresholds used (defaults + overrides).")
    label_order: list[HeadLabel] = Field(description="The order in which labels are tried.")
    probe: ProbeInfo | None = Field(None, description="The probe run; null when disabled.")
    heads: list[HeadResult] = Field(description="Every head, layer-major; with selected_heads "
                                    "or exclude_heads, the heads selected and not excluded.")


class HeadNormScores(LenientModel):
    """Scores from the contribution norms ||alpha^h_ij f_h(x_j)|| (Kobayashi et al. 2020;
    /v1/attention-norms), averaged over texts. Sink = key position 0 (BOS / [CLS] / first
    token); per query row, weight share = alpha[q, 0], norm share = n[q, 0] / sum_k n[q, k]."""

    noop: float | None = Field(
        None, description="'No-op attention': mean over query rows of the weight on the sink, "
        "counted where the sink's norm share is below its weight share, in [0, 1]. High = the "
        "head parks attention on the sink, which contributes little (small value vector)."
    )
    sink_norm_share: float | None = Field(
        None, description="Mean over query rows of the sink's share of the row's contribution "
        "norm, in [0, 1] (compare with scores.sink, its weight share)."
    )


HeadResult.model_rebuild()
