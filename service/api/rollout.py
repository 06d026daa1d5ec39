"""POST /v1/rollout."""

from __future__ import annotations

from functools import partial

from fastapi import Request

from attnscope.schemas import RolloutRequest, RolloutResponse
from .attention import ERRORS as ATTENTION_ERRORS
from ..serving.core.routes import v1_router
from ..deps import EngineDep
from ..encoding import wants_binary
from ..serving import rollout as serving

router = v1_router(tags=["rollout"])


@router.post(
    "/v1/rollout",
    response_model=RolloutResponse,
    responses=ATTENTION_ERRORS,
    summary="Attention rollout per layer and attention flow (Abnar & Zuidema 2020)",
)
async def rollout(req: RolloutRequest, engine: EngineDep, request: Request):
    """Attention rollout (Abnar and Zuidema 2020, "Quantifying Attention Flow in
    Transformers"; S004): per layer ``Â_l = rownorm((1 - residual) F_l + residual I)`` with
    ``F_l`` the heads fused by ``fusion`` (after dropping the first-token sink on request and
    discarding the lowest ``discard`` fraction), and ``R_l = Â_l ... Â_1``: ``rollout``
    float32 ``[layer, query_pos, key_pos]``, rows sum to 1, causal models never put weight on a
    later token. ``flow``: networkx maximum flow from each (layer output, query) node to each
    input token over the layered graph with capacities Â, rows divided by their sums
    ``[flow_layer, query_pos, key_pos]``; inputs up to ``flow_max_tokens`` (16) tokens.

    Errors: 422 blank text / too many tokens / flow over 16 tokens (the limit named) /
    unknown fusion or sink / residual outside [0, 1] / discard outside [0, 1) / layer out of
    range / 'tril' on an encoder / memory estimate over ``max_request_bytes``; 406; 413;
    429; 503.
    """
    binary = wants_binary(request.headers.get("accept"))
    return await engine.serve(req, partial(serving.plan, binary=binary), check=serving.check,
                              binary=binary)
