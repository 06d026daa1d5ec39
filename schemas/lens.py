"""POST /v1/logit-lens and POST /v1/logit-attribution: the residual stream read through the
final LayerNorm and the unembedding (logit lens, nostalgebraist 2020; TransformerLens
``cache.accumulated_resid(apply_ln=True)``), and direct logit attribution of a logit
direction to every head, MLP, the embeddings and the attention output biases (TransformerLens
``cache.stack_head_results`` / ``decompose_resid`` + ``apply_ln_to_stack``).

Both run the hooked forward of ``/v1/run`` (TransformerLens 4.x hook names) on the model's
unprocessed weights: TransformerLens' ``enable_compatibility_mode(no_processing=True)``
(``HookedTransformer.from_pretrained_no_processing``), so ln_final's weight and bias are not
folded into ``W_U`` and are applied here explicitly."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from .interventions import TopToken
from .common import INDEX_MARK
from .common import (
    BYTES_DOC, LABEL_DOC, PARTIAL_DOC, EXAMPLE_TEXT, MAX_TEXTS, LenientModel, ModelRef, TextOrTexts, Token, add_bos_echo, example,
)

MAX_INDEX = 1 << 20
TokenId = Annotated[int, Field(ge=0, le=1 << 31, json_schema_extra={INDEX_MARK: "token"})]
TokenRef = Union[TokenId, Annotated[str, Field(min_length=1, max_length=200)]]
Position = Annotated[int, Field(ge=-MAX_INDEX, le=MAX_INDEX)]
Positions = Annotated[list[Position], Field(min_length=1, max_length=4096,
                                            json_schema_extra={"uniqueItems": True})]

WEIGHTS_DOC = (
    "The weights used: the checkpoint's own, unprocessed (no LayerNorm folding, no centring "
    "of writing weights or of the unembedding, b_V not folded into b_O): TransformerLens' "
    "enable_compatibility_mode(no_processing=True) / from_pretrained_no_processing. ln_final's "
    "weight w and bias b are therefore applied explicitly: LN(x) = (x - mean(x)) / scale * w + b."
)


# ------------------------------------------------------------------------------ logit lens
class LogitLensRequest(TextOrTexts):
    """The logit lens of every residual state of each prompt (``text``, ``texts``, ``tokens``
    or ``token_lists``; each prompt is its own forward)."""

    model_config = example(text=EXAMPLE_TEXT, top_k=3, positions=[-1])

    ln: Literal["own", "final"] = Field(
        "own", description="How each residual state x is normalised before the unembedding. "
        "'own': ln_final applied to x with x's own statistics, LN(x) = (x - mean x) / "
        "sqrt(var x + eps) * w + b (TransformerLens 4.3 accumulated_resid(apply_ln=True), which "
        "for the full stack recomputes the final norm per state, apply_ln_to_stack(..., "
        "recompute_ln=True)). 'final': the final LayerNorm's scale frozen from the run, (x - "
        "mean x) / scale_final * w + b, scale_final = ln_final.hook_scale of the last residual "
        "state at that position (TransformerLens apply_ln_to_stack(..., recompute_ln=False), "
        "then ln_final's w and b, which unprocessed weights do not fold into W_U). RMSNorm models "
        "(Llama, Mistral, Qwen2, Gemma, Gemma 2): 'own' = the model's final RMSNorm as Hugging "
        "Face computes it (float32, x * rsqrt(mean(x^2) + eps) * w, Gemma 1 + w; no centring, "
        "no bias) then lm_head and Gemma 2's final soft-cap; 'final' = x / s * w with s = "
        "ln_final.hook_scale = sqrt(mean(x_L^2) + eps) of the run's last state. The last "
        "state (final_post) gives the model's own logits either way.")
    incl_mid: bool = Field(False, description="Also each block's ``hook_resid_mid`` (after "
                           "attention, before the MLP), as accumulated_resid(incl_mid=True).")
    top_k: int = Field(5, ge=0, le=100, description="Top-k tokens per state and position "
                       "(0: none).")
    positions: Positions | None = Field(
        None, description="Positions whose per-position tables (top-k, target) are returned; "
        "null = every position; negatives count from the end. The loss is always over every "
        "position.")
    target: TokenRef | None = Field(
        None, description="A token (id, or a text that is one token) whose rank and log-prob "
        "are reported at every position. Null: the prompt's actual next token (none at the "
        "last position).")


class TargetStat(LenientModel):
    id: int = Field(description="Vocabulary id of the target.")
    label: str = Field(description=LABEL_DOC)
    bytes: str = Field(description=BYTES_DOC)
    partial: bool = Field(description=PARTIAL_DOC)
    rank: int = Field(description="Number of tokens with a strictly higher logit at this "
                      "state (0 = the top token).")
    logprob: float = Field(description="log-softmax of the lens logits at the target (nats, "
                           "<= 0).")
    prob: float = Field(description="exp(logprob), in [0, 1].")


class LensPosition(LenientModel):
    position: int = Field(description="The position (negatives resolved).")
    top: list[TopToken] = Field(description="Top-k tokens, most probable first.")
    target: TargetStat | None = Field(
        None, description="The target's rank and log-prob (null at the last position when the "
        "target is the next token).")


class LensState(LenientModel):
    label: str = Field(description="TransformerLens' accumulated_resid label: '{l}_pre', "
                       "'{l}_mid', 'final_post'.")
    hook: str = Field(description="The hook the state is read from, e.g. "
                      "'blocks.3.hook_resid_pre'; final_post is 'blocks.{L-1}.hook_resid_post'.")
    loss: float | None = Field(description="Mean next-token cross entropy over positions 0.."
                               "T-2 of the lens logits (nats); null for a 1-token prompt.")
    positions: list[LensPosition] = Field(description="Per requested position.")


class LensPrompt(LenientModel):
    tokens: list[Token] = Field(description="The prompt's tokens.")
    n_tokens: int = Field(description="Number of tokens.")
    states: list[LensState] = Field(description="Per residual state, in forward order.")


class LogitLensResponse(LenientModel):
    model: ModelRef
    add_bos: bool = add_bos_echo()
    ln: str = Field(description="The normalisation used ('own' or 'final', see the request).")
    ln_description: str = Field(description="The formula, in words.")
    weights: str = Field(description=WEIGHTS_DOC)
    prompts: list[LensPrompt] = Field(description="Per prompt, in request order.")


# ------------------------------------------------------------------ direct logit attribution
class LogitAttributionRequest(TextOrTexts):
    """Direct logit attribution at chosen positions to a logit direction (``text``, ``texts``,
    ``tokens`` or ``token_lists``; each prompt is its own forward)."""

    model_config = example(text=EXAMPLE_TEXT, target=" John", distractor=" the")

    target: Union[TokenRef, Annotated[list[TokenRef], Field(min_length=1, max_length=MAX_TEXTS)]] \
        = Field(..., description="The target token (id, or a text that is one token), or one "
                "per prompt.")
    distractor: Union[TokenRef, Annotated[list[TokenRef], Field(min_length=1,
                                                                 max_length=MAX_TEXTS)]] | None = \
        Field(None, description="Null: the direction is the target's unembedding (the target's "
              "logit is attributed). Else target minus distractor (the logit difference); one "
              "token, or one per prompt.")
    positions: Positions | None = Field(
        None, description="Positions whose logits are attributed; null = the last; negatives "
        "count from the end.")


class DLAPosition(LenientModel):
    position: int = Field(description="The position (negatives resolved).")
    target: int = Field(description="Target token id.")
    distractor: int | None = Field(description="Distractor token id, or null.")
    logit_diff: float = Field(description="The served value: logits[target] (- logits["
                              "distractor]) of the model's forward at this position.")
    scale: float = Field(description="ln_final.hook_scale at this position, sqrt(var(x) + "
                         "eps) of the last residual state (RMSNorm: sqrt(mean(x^2) + eps)): "
                         "the frozen scale every part is divided by.")
    embed: float = Field(description="hook_embed's part.")
    pos_embed: float | None = Field(description="hook_pos_embed's part; null on the rotary "
                                    "families (positions enter through RoPE: no such "
                                    "component).")
    heads: list[list[float]] = Field(description="[layer][head]: blocks.{l}.attn.hook_result's "
                                     "part (z_h W_O^h, without b_O). Gemma 2: the head's share "
                                     "of hook_attn_out (after the post-attention norm, what "
                                     "enters the residual stream) with ln1_post's scale frozen "
                                     "from the run, result_h / s_post * (1 + w_post).")
    attn_bias: list[float] | None = Field(description="[layer]: the attention output bias "
                                          "b_O's part; null where the model has no b_O "
                                          "(Llama, Mistral, Qwen2, Gemma, Gemma 2).")
    mlp: list[float] = Field(description="[layer]: blocks.{l}.hook_mlp_out's part (its b_out "
                             "included).")
    ln_final_bias: float = Field(description="b · d: ln_final's bias on the direction, the "
                                 "one term that is not a residual component (0 for RMSNorm, "
                                 "which has no bias).")
    pre_softcap_logit_diff: float | None = Field(
        None, description="Gemma 2 only (else null): the logit difference before the final "
        "soft-cap tanh(z / cap) * cap, which the parts decompose (the capped logit_diff is "
        "not a sum of parts).")
    sum_of_parts: float = Field(description="embed + pos_embed + sum(heads) + sum(attn_bias) + "
                                "sum(mlp).")
    residual_error: float = Field(description="logit_diff (Gemma 2: pre_softcap_logit_diff) - "
                                  "(sum_of_parts + ln_final_bias): float rounding only (the "
                                  "parts decompose the final state exactly once the scale is "
                                  "frozen).")


class DLAPrompt(LenientModel):
    tokens: list[Token] = Field(description="The prompt's tokens.")
    n_tokens: int = Field(description="Number of tokens.")
    positions: list[DLAPosition] = Field(description="Per attributed position, in request order.")


class LogitAttributionResponse(LenientModel):
    model: ModelRef
    add_bos: bool = add_bos_echo()
    method: str = Field(description="The formula, in words.")
    weights: str = Field(description=WEIGHTS_DOC)
    prompts: list[DLAPrompt] = Field(description="Per prompt, in request order.")
