"""/v1/tokenize: tokens as the analyses see them."""

from __future__ import annotations

from attnscope.schemas import TokenizeRequest, TokenizeResponse

from ..encoding import respond
from .common import text_or_results
from .core.inputs import with_add_bos
from .core.table import Endpoint


def body(rt, req, items) -> dict:
    """The response body: per text its tokens (id, label, offsets, special) and count."""
    results = [{"tokens": [t.as_dict() for t in it.tokens], "n_tokens": len(it)} for it in items]
    out: dict = {"model": rt.model_ref()}
    return text_or_results(req, out, "tokens", results)


async def tokenize_handler(engine, req):
    """Tokenize off the event loop (the engine's tokenize, with its checks) and render the
    body off the loop too; never waits for the device."""
    rt = engine.runtime
    req = engine.resolve(rt, req)
    return await respond(with_add_bos(body(rt, req, await engine.tokenize(rt, req)), req))


ENDPOINTS = [
    Endpoint(
        path='/v1/tokenize', name='tokenize',
        request=TokenizeRequest, response=TokenizeResponse,
        summary='Tokenize text(s)',
        description="""Tokens exactly as the analyses see them: ids, readable labels, character offsets,
framing. Never waits for the device. Errors: 422 (blank text, too many tokens, batch over
max_batch); 503 not ready.""",
        handler=tokenize_handler,
        device=False,
        tags=('tokens',), order=20,
    ),
]
