"""/v1/tokenize: tokens as the analyses see them."""

from __future__ import annotations

from attnscope.schemas import TokenizeRequest, TokenizeResponse

from ..encoding import respond
from ..errors import MemoryLimitExceeded
from .common import text_or_results
from .core.estimates import tokens_bytes
from .core.inputs import with_add_bos
from .core.table import Endpoint


def body_of(rt, req, items) -> dict:
    """The response body: per text its tokens (id, label, offsets, special) and count."""
    results = [{"tokens": [t.as_dict() for t in it.tokens], "n_tokens": len(it)} for it in items]
    out: dict = {"model": rt.model_ref()}
    return text_or_results(req, out, "tokens", results)


def estimate(req) -> int:
    """An upper bound of the response's bytes before tokenizing: at most one token per UTF-8
    byte of each text (+ BOS), or the ids given, each :data:`~.core.estimates.TOKEN_BYTES`."""
    texts = [req.text] if req.text is not None else list(req.texts or [])
    n = sum(len(t.encode("utf-8", "surrogatepass")) + 1 for t in texts)
    n += len(req.tokens or []) + sum(len(x) for x in (req.token_lists or []))
    return tokens_bytes(n) + 4096


async def tokenize_handler(engine, req):
    """Admitted like every endpoint (issue 29 item 9): the response's estimate against
    ``max_request_bytes`` (422 ``memory_limit_exceeded``) and the global memory budget (waits,
    then 429), held until its last byte is sent. Tokenizes off the event loop (the engine's
    tokenize, with its checks) and renders the body off the loop too; never waits for the
    device."""
    rt = engine.runtime
    req = engine.resolve(rt, req)
    need = estimate(req)
    limit = engine.max_request_bytes
    if limit and need > limit:
        raise MemoryLimitExceeded(
            f"this request needs an estimated {need} bytes of memory for its tokens; the limit "
            f"is {limit} bytes (max_request_bytes). Send fewer or shorter texts",
            "texts" if req.texts is not None else "text")
    ticket = await engine.budget.acquire(need)
    try:
        body = with_add_bos(body_of(rt, req, await engine.tokenize(rt, req)), req)
        return await respond(body, on_close=ticket.release)
    except BaseException:
        ticket.release()
        raise


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
