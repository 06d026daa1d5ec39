"""POST /v1/attention."""

from __future__ import annotations

from functools import partial

from fastapi import Request

from attnscope.schemas import AttentionRequest, AttentionResponse, ErrorResponse
from ..serving.core.routes import v1_router
from ..deps import EngineDep
from ..encoding import SAFETENSORS, wants_binary
from ..serving import attention as serving

router = v1_router(tags=["attention"])

ERRORS = {
    200: {"content": {SAFETENSORS: {}}, "description": "JSON, or with Accept: "
          "application/x-safetensors one safetensors file (README, 'Tensors on the wire')."},
    406: {"model": ErrorResponse, "description": "Accept names no media type we produce."},
    413: {"model": ErrorResponse, "description": "Request body too large."},
    422: {"model": ErrorResponse, "description": "Invalid request (field, limit and value named)."},
    429: {"model": ErrorResponse, "description": "Overloaded: the device queue is full."},
    503: {"model": ErrorResponse, "description": "The model is not loaded yet."},
}


@router.post(
    "/v1/attention",
    response_model=AttentionResponse,
    responses=ERRORS,
    summary="Attention patterns (and optionally pre-softmax scores) per layer and head",
)
async def attention(req: AttentionRequest, engine: EngineDep, request: Request):
    """Attention of the resident model for ``text`` (response field ``attention``) or
    ``texts`` (response field ``results``, in order).

    ``pattern``: float32 post-softmax weights ``[layer, head, query_pos, key_pos]`` (or
    ``[layer, query_pos, key_pos]`` with ``head_mean``), equal to Hugging Face's
    ``output_attentions``. ``scores`` (``include_scores``): pre-softmax ``q.k * scaling``, masked
    entries null/-inf. ``layout`` 'tril' sends the lower triangle (causal models);
    ``sparse`` the top-k / thresholded pattern with the kept mass per row. ``Accept:
    application/x-safetensors`` returns the response as one safetensors file (tensors by name,
    the JSON body in ``__metadata__["attnscope"]``). Source: Vaswani et al. 2017;
    000_1c89b6c8c2a32040.txt.

    Errors: 422 blank text / too many tokens / layer or head out of range / batch over
    ``max_batch`` / 'tril' on an encoder / memory estimate over ``max_request_bytes``; 406
    Accept; 413 body too large; 429 overloaded; 503 not ready.
    """
    binary = wants_binary(request.headers.get("accept"))
    return await engine.serve(req, partial(serving.plan, binary=binary), check=serving.check,
                              binary=binary)
