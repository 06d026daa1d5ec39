"""POST /v1/tokenize."""

from __future__ import annotations

from fastapi import APIRouter

from attnscope.schemas import TokenizeRequest, TokenizeResponse
from attnscope.service.api.common import tokenize_request
from attnscope.service.deps import RuntimeDep
from attnscope.service.encoding import ORJSONResponse

router = APIRouter(tags=["tokens"])


@router.post("/v1/tokenize", response_model=TokenizeResponse, summary="Tokenize text(s)")
async def tokenize(req: TokenizeRequest, rt: RuntimeDep):
    """Tokens exactly as the analyses see them: ids, readable labels, character offsets,
    framing. Errors: 422 (blank text, too many tokens, batch over max_batch)."""
    items = await tokenize_request(rt, req)
    results = [{"tokens": [t.as_dict() for t in it.tokens], "n_tokens": len(it)} for it in items]
    body: dict = {"model": rt.model_ref()}
    if req.text is not None:
        body["tokens"] = results[0]
    else:
        body["results"] = results
    return ORJSONResponse(body)
