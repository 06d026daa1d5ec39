"""The route builder: one FastAPI route per entry of the endpoint table (:mod:`.table`), each
a :class:`V1Route` (request bodies parsed off the event loop) with the OpenAPI error responses
of a /v1 route, making ONE engine call (service/serving/core/engine.py). No per-endpoint
router files: docs/architecture.md, "How to add an endpoint"."""

from __future__ import annotations

import asyncio
import email.message
import json
import re
import weakref
from typing import Any, Callable, Coroutine

import inspect
from functools import partial

import anyio
import anyio.to_thread
import numpy as np
import orjson
from fastapi import APIRouter, Request, params
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.responses import Response

from .table import Endpoint


def error_responses(invalid: str = "Invalid request (field, limit and value named).",
                    *, device: bool = True) -> dict:
    """OpenAPI ``responses`` of a /v1 route: every status it can answer besides 200, each with
    the error envelope. ``invalid`` describes the route's own 422 cases; ``device=False`` for
    routes that never wait for the device (no 429)."""
    from attnscope.schemas import ErrorResponse

    out = {
        401: {"model": ErrorResponse, "description": "API keys are configured and none was valid."},
        413: {"model": ErrorResponse, "description": "Request body too large."},
        422: {"model": ErrorResponse, "description": invalid},
        429: {"model": ErrorResponse, "description": "Overloaded: the device queue is full."},
        503: {"model": ErrorResponse, "description": "The model is not loaded yet."},
        504: {"model": ErrorResponse, "description": "The request ran past request_timeout_s."},
    }
    if not device:
        del out[429]
    return out


# ----------------------------------------------------------------- request bodies off the loop
#: Request bodies above this many bytes are parsed and validated in a worker thread; smaller
#: ones take FastAPI's own path on the event loop (no thread hop).
INLINE_BODY_BYTES = 64 << 10

#: Bodies nested deeper are refused as unparsable, as the standard library refuses them on the
#: event loop past ~950 levels (its recursion limit less the server's stack there).
MAX_BODY_DEPTH = 900

# Integers of 19+ digits may not fit orjson's 64-bit integers (it reads them as floats, the
# standard library as ints): such bodies are parsed by the standard library.
_LONG_DIGITS = re.compile(rb"\d{19}")
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_limiters: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _parse_limiter() -> anyio.CapacityLimiter:
    """One body parsed at a time per event loop: the parse and validation hold the GIL in C
    calls, so more threads would only take more turns of it from the event loop."""
    loop = asyncio.get_running_loop()
    lim = _limiters.get(loop)
    if lim is None:
        lim = _limiters[loop] = anyio.CapacityLimiter(1)
    return lim


def parse_json_body(body: bytes) -> Any:
    """``body`` parsed as Starlette's ``Request.json()`` (``json.loads``) parses it: orjson
    where both agree, the standard library for everything orjson refuses or reads otherwise
    (NaN/Infinity, lone surrogates, a BOM, UTF-16/32, integers beyond 64 bits, nesting past
    orjson's 1024 levels). Raises what ``json.loads`` raises; ``RecursionError`` for nesting
    deeper than :data:`MAX_BODY_DEPTH` (on the loop the standard library's own limit, which
    depends on the stack, lies a little above it)."""
    if _LONG_DIGITS.search(body) is None:
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError:
            value = _UNPARSED
    else:
        value = _UNPARSED
    if value is _UNPARSED:
        value = json.loads(body)
        encoding = json.detect_encoding(body)
        if encoding != "utf-8":  # for the depth below: the brackets as UTF-8 bytes
            body = body.decode(encoding, "surrogatepass").encode("utf-8", "surrogatepass")
    if body.count(b"[") + body.count(b"{") > MAX_BODY_DEPTH and \
            nesting_depth(body) > MAX_BODY_DEPTH:
        raise RecursionError("maximum recursion depth exceeded while decoding a JSON array "
                             "from a unicode string")
    return value


_UNPARSED = object()


def nesting_depth(body: bytes) -> int:
    """How deep the arrays and objects of ``body`` (valid UTF-8 JSON) nest: 0 for a scalar.
    Vectorised: strings removed, then the running count of brackets."""
    if b'"' in body:
        body = _JSON_STRING.sub(b"", body)
    a = np.frombuffer(body, np.uint8)
    opens = (a == 0x5B) | (a == 0x7B)
    idx = np.flatnonzero(opens | (a == 0x5D) | (a == 0x7D))
    if idx.size == 0:
        return 0
    return int(np.where(opens[idx], 1, -1).cumsum().max())


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this Content-Type as JSON (its own test)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")


def _parse_and_validate(field, body: bytes) -> tuple[str, Any]:
    """In a worker thread: ``("parse_error", exc)``, ``("invalid", (errors, value))`` or
    ``("ok", model)``; the validation is FastAPI's own (``field.validate``, loc ``body``)."""
    try:
        value = parse_json_body(body)
    except Exception as exc:  # noqa: BLE001 - re-raised where FastAPI reads the body
        return "parse_error", exc
    model, errors = field.validate(value, {}, loc=("body",))
    if errors:
        return "invalid", (errors, value)
    return "ok", model


class _ParsedBodyRequest(Request):
    """A Request whose ``json()`` gives the body already parsed and validated off the loop
    (FastAPI's validation of a validated model instance returns it as is), or raises the
    parse error, so FastAPI turns it into the same 422 as ever."""

    _outcome: tuple[str, Any] | None = None

    async def json(self) -> Any:
        if self._outcome is None:
            return await super().json()
        kind, value = self._outcome
        if kind == "parse_error":
            raise value
        return value


def _params(dependant) -> tuple[int, int]:
    """(body params, path/query/header/cookie params) of ``dependant`` and its dependencies."""
    body = len(dependant.body_params)
    other = sum(len(x) for x in (dependant.path_params, dependant.query_params,
                                  dependant.header_params, dependant.cookie_params))
    for sub in dependant.dependencies:
        b, o = _params(sub)
        body, other = body + b, other + o
    return body, other


class V1Route(APIRoute):
    """The route class of every /v1 POST: a JSON body over :data:`INLINE_BODY_BYTES` is parsed
    (orjson) and validated (pydantic, FastAPI's own validation of the route's body model) in a
    worker thread, one at a time, so a flood of big bodies (issue 17: 16 concurrent 1.5 MB
    /v1/scratch-attention bodies) does not hold the event loop. Same results as FastAPI's
    path: the same value, the same RequestValidationError (hence the same 422 envelope) and
    the same parse errors (but see :data:`MAX_BODY_DEPTH`); the OpenAPI document is
    untouched.

    Applies to routes whose only input is one JSON body model (no path, query, header or
    cookie parameters, no embedded body): a body error is then the request's only possible
    422, so raising it before the route's dependencies run (they only read app state) changes
    nothing. ``offloads_body`` says whether it applies."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        field = self.body_field
        self.offloads_body = (
            field is not None and _params(self.dependant) == (1, 0)
            and not getattr(self, "_embed_body_fields", True)
            and not isinstance(field.field_info, params.Form)
        )
        if not self.offloads_body:
            return handler

        async def route_handler(request: Request) -> Response:
            request = _ParsedBodyRequest(request.scope, request.receive)
            try:
                body = await request.body()
            except Exception:  # noqa: BLE001 - FastAPI reads it again and answers as ever
                return await handler(request)
            if len(body) > INLINE_BODY_BYTES and _is_json(request.headers.get("content-type")):
                outcome = await anyio.to_thread.run_sync(
                    _parse_and_validate, field, body, limiter=_parse_limiter())
                if outcome[0] == "invalid":
                    errors, value = outcome[1]
                    raise RequestValidationError(errors, body=value)
                request._outcome = outcome
            return await handler(request)

        return route_handler


def v1_router(**kwargs) -> APIRouter:
    """An APIRouter whose routes are :class:`V1Route` (every /v1 router is made here)."""
    return APIRouter(route_class=V1Route, **kwargs)


# ------------------------------------------------------------------------ streamed progress
def wants_ndjson(accept: str | None) -> bool:
    """True when the ``Accept`` header prefers ``application/x-ndjson`` (q > 0) to JSON, read
    as ``encoding.wants_binary`` reads it for safetensors: the highest q of each media type;
    a tie with ``*/*`` / ``application/*`` goes to NDJSON, a tie with ``application/json``
    named to JSON. A header without it (or none) is False: the plain JSON answer, unchanged.
    Only endpoints whose plan reports progress (/v1/patch, /v1/path-patch) stream; the others
    answer JSON as before. Linear in the header's length; a bad q value counts as 0."""
    if not accept or "ndjson" not in accept.lower():
        return False
    best: dict[str, float] = {}
    for part in accept.split(","):
        bits = [b.strip() for b in part.split(";")]
        media = bits[0].lower()
        q = 1.0
        for b in bits[1:]:
            if b[:2].lower() == "q=":
                try:
                    q = min(max(float(b[2:]), 0.0), 1.0)
                except ValueError:
                    q = 0.0
                if q != q:  # NaN
                    q = 0.0
        best[media] = max(best.get(media, 0.0), q)
    nd = best.get("application/x-ndjson", 0.0)
    js = best.get("application/json", 0.0)
    return nd > 0 and (nd > js or (nd == js and "application/json" not in best))


# ------------------------------------------------------------------------ the route builder
def _responses(ep: Endpoint) -> dict:
    """OpenAPI ``responses`` of ``ep``: every error status with the envelope; for an
    endpoint that negotiates safetensors, the binary 200 and 406."""
    from attnscope.schemas import ErrorResponse

    from ...encoding import SAFETENSORS

    if ep.request is None:
        return {}
    out = error_responses(ep.invalid, device=ep.device)
    if ep.streams:
        from .engine import NDJSON

        ref = "#/components/schemas/"
        out = {
            200: {"content": {NDJSON: {"schema": {
                "description": "One JSON document a line: ProgressLine lines while the job "
                               "runs, then the response body (or, when the job failed after "
                               "the stream began, the error envelope).",
                "anyOf": [{"$ref": ref + "ProgressLine"},
                          {"$ref": ref + ep.response.__name__},
                          {"$ref": ref + "ErrorResponse"}]}}},
                  "description": "JSON, or with Accept: application/x-ndjson a stream of "
                                 "progress lines and the body as its last line (docs/api.md, "
                                 "'Streamed progress')."},
            **out,
        }
    if ep.binary:
        out = {
            200: {"content": {SAFETENSORS: {}}, "description": "JSON, or with Accept: "
                  "application/x-safetensors one safetensors file (README, 'Tensors on the "
                  "wire')."},
            406: {"model": ErrorResponse, "description": "Accept names no media type we produce."},
            **out,
        }
    return out


def route_function(ep: Endpoint):
    """The async function FastAPI calls for ``ep``: the body parsed as ``ep.request``, then
    ``prepare`` / ``check`` / tokenize / ``plan`` / admission / one device turn in the engine
    (or ``ep.handler``). Its signature is built for FastAPI (body model, engine, request)."""
    from ...deps import EngineDep
    from ...encoding import wants_binary

    async def endpoint(engine, request: Request, req=None):
        if ep.handler is not None:
            return await ep.handler(engine, req)
        rt = engine.runtime if ep.needs_model else getattr(engine._state, "runtime", None)
        if ep.prepare is not None:
            req = ep.prepare(rt, req)
        if not ep.binary:
            return await engine.serve(req, ep.plan, check=ep.check, tokenize=ep.tokenize,
                                      needs_model=ep.needs_model, request=request,
                                      stream=wants_ndjson(request.headers.get("accept")))
        binary = wants_binary(request.headers.get("accept"))
        return await engine.serve(req, partial(ep.plan, binary=binary), check=ep.check,
                                  binary=binary, tokenize=ep.tokenize, needs_model=ep.needs_model,
                                  request=request)

    params = [inspect.Parameter("engine", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                annotation=EngineDep),
              inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                annotation=Request)]
    if ep.request is not None:
        params.append(inspect.Parameter("req", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                        annotation=ep.request))
    endpoint.__signature__ = inspect.Signature(params)
    endpoint.__name__ = ep.name
    endpoint.__doc__ = ep.description
    return endpoint


def add_routes(app, endpoints: list[Endpoint]) -> None:
    """One route per entry of ``endpoints`` (the endpoint table) on ``app``, in table order:
    POST routes are :class:`V1Route` (bodies parsed off the loop), GET routes plain."""
    for ep in endpoints:
        router = v1_router(tags=list(ep.tags)) if ep.request is not None else APIRouter(
            tags=list(ep.tags))
        router.add_api_route(
            ep.path, route_function(ep), methods=[ep.method], response_model=ep.response,
            responses=_responses(ep), summary=ep.summary, description=ep.description,
            name=ep.name,
        )
        app.include_router(router)
