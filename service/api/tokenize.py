"""POST /v1/tokenize."""

from __future__ import annotations

from attnscope.schemas import TokenizeRequest, TokenizeResponse
from ..serving.core.routes import v1_router
from ..deps import EngineDep
from ..encoding import respond
from ..serving.tokenize import body

router = v1_router(tags=["tokens"])


@router.post("/v1/tokenize", response_model=TokenizeResponse, summary="Tokenize text(s)")
async def tokenize(req: TokenizeRequest, engine: EngineDep):
    """Tokens exactly as the analyses see them: ids, readable labels, character offsets,
    framing. Never waits for the device. Errors: 422 (blank text, too many tokens, batch over
    max_batch); 503 not ready."""
    rt = engine.runtime
    return await respond(body(rt, req, await engine.tokenize(rt, req)))  # rendered off the loop
