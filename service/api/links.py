"""POST /v1/links: each query token's strongest earlier key token(s)."""

from __future__ import annotations

from attnscope.schemas import LinksRequest, LinksResponse
from ..serving.core.routes import error_responses, v1_router
from ..deps import EngineDep
from ..serving import links as serving

router = v1_router(tags=["links"])

ERRORS = error_responses(
    "Invalid request: layer/head/ignore position "
    "out of range, direction 'any' on a causal model, too many tokens.")


@router.post("/v1/links", response_model=LinksResponse, responses=ERRORS,
             summary="Strongest earlier link(s) of every query token")
async def links(req: LinksRequest, engine: EngineDep):
    """For each query token, its ``top_k`` strongest eligible key tokens in one layer's head
    mean (``head`` null) or one head, as ``strongest_previous_token`` in
    000_1c89b6c8c2a32040.txt defines it: future keys never count, self excluded by default,
    ``ignore`` positions never chosen, a query with no eligible key is skipped (listed in
    ``skipped``). ``weight`` = attention weight in [0, 1]. Encoders: ``direction`` 'any'
    lets later keys count too.

    Errors: 422 layer/head/ignore out of range, 'any' on a causal model, too many tokens;
    413; 429; 503.
    """
    return await engine.serve(req, serving.plan, check=serving.check)
