"""POST /v1/attention-norms."""

from __future__ import annotations

from functools import partial

from fastapi import Request

from attnscope.schemas import NormsRequest, NormsResponse
from .attention import ERRORS as ATTENTION_ERRORS
from ..serving.core.routes import v1_router
from ..deps import EngineDep
from ..encoding import wants_binary
from ..serving import norms as serving

router = v1_router(tags=["norms"])


@router.post(
    "/v1/attention-norms",
    response_model=NormsResponse,
    responses=ATTENTION_ERRORS,
    summary="Value-weighted contribution norms ||alpha f(x)|| per layer and head (Kobayashi et al. 2020)",
)
async def attention_norms(req: NormsRequest, engine: EngineDep, request: Request):
    """What each key position contributes to each query, beyond its attention weight
    (Kobayashi et al. 2020, "Attention is Not Only a Weight"; S004): with ``f_h(x) = (x W_V^h
    + b_V^h) W_O^h`` and ``x`` the attention input (the LayerNorm output entering attention),

    * ``norms``: ``||alpha^h_ij f_h(x_j)||`` float32 ``[layer, head, query_pos, key_pos]``;
    * ``summed``: ``||sum_h alpha^h_ij f_h(x_j)||`` ``[layer, query_pos, key_pos]`` (over the
      selected heads);
    * ``value_norms``: ``||f_h(x_j)||`` ``[layer, head, key_pos]``.

    Norms are Euclidean, in the residual stream's units, >= 0. Biases: by default (the
    paper's) b_V is inside f and the output projection's bias b_O is in no key's contribution
    (the contributions sum to the attention output minus b_O); ``value_bias`` /
    ``output_bias`` change that. Every wire form of /v1/attention: json, base64, 'tril'
    (causal), sparse, and ``Accept: application/x-safetensors``.

    Errors: 422 blank text / too many tokens / layer or head out of range or repeated / empty
    heads or layers / nothing asked for / 'tril' on an encoder / memory estimate over
    ``max_request_bytes``; 406 Accept; 413; 429; 503.
    """
    binary = wants_binary(request.headers.get("accept"))
    return await engine.serve(req, partial(serving.plan, binary=binary), check=serving.check,
                              binary=binary)
