"""POST /v1/tokenize."""

from __future__ import annotations

from attnscope.schemas import TokenizeRequest, TokenizeResponse
from attnscope.service.api.common import v1_router
from attnscope.service.deps import EngineDep
from attnscope.service.encoding import respond
from attnscope.service.serving.tokenize import body

router = v1_router(tags=["tokens"])


@router.post("/v1/tokenize", response_model=TokenizeResponse, summary="Tokenize text(s)")
async def tokenize(req: TokenizeRequest, engine: EngineDep):
    """Tokens exactly as the analyses see them: ids, readable labels, character offsets,
    framing. Never waits for the device. Errors: 422 (blank text, too many tokens, batch over
    max_batch); 503 not ready."""
    rt = engine.runtime
    return await respond(body(rt, req, await engine.tokenize(rt, req)))  # rendered off the loop
