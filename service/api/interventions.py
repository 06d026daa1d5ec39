"""POST /v1/predictions, /v1/ablate, /v1/patch: next-token predictions and interventions."""

from __future__ import annotations

from functools import partial

from fastapi import Request

from attnscope.schemas import ErrorResponse
from attnscope.schemas.interventions import (
    AblateRequest, AblateResponse, PatchRequest, PatchResponse, PredictionsRequest,
    PredictionsResponse,
)
from ..serving.core.routes import error_responses, v1_router
from ..deps import EngineDep
from ..encoding import SAFETENSORS, wants_binary
from ..serving import interventions as serving

router = v1_router(tags=["interventions"])


@router.post("/v1/predictions", response_model=PredictionsResponse, summary="Next-token predictions",
             responses=error_responses("Invalid request: an encoder without an LM head "
                                       "(unsupported_model), positions out of range, too many tokens."))
async def predictions(req: PredictionsRequest, engine: EngineDep):
    """For each position p of ``text`` (or each of ``texts``): the ``top_k`` most probable next
    tokens (probability, logit), the log-probability (nats) and rank (1 = top) of the token that
    actually follows, the per-token loss ``-log p`` (nats), the entropy of the next-token
    distribution (nats) and the mean loss. Equal to Hugging Face's ``GPT2LMHeadModel`` logits
    and loss. Causal LMs only: an encoder answers 422 ``unsupported_model``.
    """
    return await engine.serve(req, serving.predictions_plan, check=serving.check_lm)


ABLATE_ERRORS = {
    200: {"content": {SAFETENSORS: {}}, "description": "JSON, or with Accept: "
          "application/x-safetensors one safetensors file (the patterns as tensors)."},
    406: {"model": ErrorResponse, "description": "Accept names no media type we produce."},
    **error_responses("Invalid request: no LM head, heads/positions out of range or repeated, "
                      "target/distractor not one token, resample_text of another token count, "
                      "memory."),
}


@router.post("/v1/ablate", response_model=AblateResponse, summary="Ablate attention heads",
             responses=ABLATE_ERRORS)
async def ablate(req: AblateRequest, engine: EngineDep, request: Request):
    """Ablate ``heads`` ([[layer, head], ...]) together (``method`` zero / mean / resample,
    on each head's z before the output projection, TransformerLens ``hook_z``) and report per
    position KL(clean ‖ ablated) (nats), the change of loss on the actual next token, top-k
    before/after, the logit difference of ``logit_diff`` before/after and optionally the
    patterns after the ablation ``[layer, head, query_pos, key_pos]`` (any /v1/attention
    encoding; ``Accept: application/x-safetensors`` too). ``scan``: every head ablated alone,
    an effect grid ``[layer, head]`` on ``scan_metric``. Source: S004 (docs/sources.md).
    """
    binary = wants_binary(request.headers.get("accept"))
    return await engine.serve(req, partial(serving.ablate_plan, binary=binary),
                              check=serving.ablate_check, binary=binary, tokenize=False)


@router.post("/v1/patch", response_model=PatchResponse, summary="Activation patching clean -> corrupted",
             responses=error_responses("Invalid request: no LM head, texts of different token "
                                       "counts, target/distractor not one token, too many "
                                       "patched forwards for max_request_bytes."))
async def patch(req: PatchRequest, engine: EngineDep):
    """Patch the clean run's head outputs z into the corrupted run one head at a time ->
    ``heads`` ``[layer, head]`` of the normalised metric ``(patched - corrupted) / (clean -
    corrupted)`` (TransformerLens ``get_act_patch_attn_head_out_all_pos``), optionally
    ``heads_per_position`` ``[layer, head, pos]`` and ``residual`` ``[layer, pos]``
    (``get_act_patch_resid_pre``). ``method`` 'attribution': the linear approximation from one
    backward (Nanda 2023; Kramár et al. 2024), said so in ``approximation``.
    """
    return await engine.serve(req, serving.patch_plan, check=serving.patch_check, tokenize=False)
