"""The FastAPI application: lifespan (load the model once), error envelope, body limit, routers.

``create_app(settings)`` builds an app; ``uvicorn attnscope.service.app:app`` serves one built
from the environment (``ATTNSCOPE_*``). The model loads in the lifespan, in a worker thread,
so ``/healthz`` answers at once and ``/readyz`` says 503 until the probe forward passed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config import Settings
from .encoding import ORJSONResponse
from .errors import AttnscopeError, envelope, scrub_paths
from .ops import install_ops
from .ops import health
from .serving.core.routes import add_routes
from .serving.core.table import Endpoint, default_table
from .serving.core.engine import Engine
from .serving.core.slot import DeviceSlot
from .runtime import ModelLoadError, Runtime
from .analysis._blas import (
    one_blas_thread_for_process, preload_analysis_libraries,
)
from .encoding.responses import set_heap_release
from .serving.core.memory import (
    release_memory,
    freeze_startup_objects,
    unfreeze_startup_objects,
    set_numpy_hugepages,
    set_trim_free_bytes,
)

log = logging.getLogger("attnscope")

API_DESCRIPTION = """
attnscope keeps a transformer language model resident and tells you what its attention does.

Shapes are written `[layer, head, query_pos, key_pos]`. **pattern** = post-softmax attention
weights; **scores** = pre-softmax `q . k * scaling`. `hidden_states[0]` is the embedding output.
Every error has the envelope `{"error": {"type", "message", "param"}}`.
Descriptions cite their sources by id or file name (S000 = `000_1c89b6c8c2a32040.txt`, ...):
the list with titles is `docs/sources.md` in the repository.
"""


class BodyLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` with 413 (Content-Length or streamed count)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    n = int(v)
                except ValueError:
                    n = 0
                if n > self.max_bytes:
                    return await self._reject(send, n)
        chunks, total, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                return await self._reject(send, total)
            chunks.append(body)
            more = msg.get("more_body", False)
        buffered = b"".join(chunks)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": buffered, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _reject(self, send, n: int):
        body = ORJSONResponse(
            envelope(
                "payload_too_large",
                f"request body has at least {n} bytes; the limit is {self.max_bytes} bytes "
                "(max_body_bytes)",
                "body",
            )
        ).body
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class EmptyBodyDefaults:
    """An empty or missing body is ``{}`` on the POST routes in ``paths`` (those whose request
    schema has a default for every field: ``/v1/circuits``), so ``curl -X POST .../v1/circuits``
    means the defaults. Runs inside :class:`BodyLimitMiddleware` (the body is already bounded
    and buffered); every other route, and every non-empty body, passes unchanged."""

    def __init__(self, app, paths: frozenset[str]):
        self.app = app
        self.paths = paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" \
                or scope.get("path") not in self.paths:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        if not body.strip():
            body = b"{}"
            headers = [(k, v) for k, v in scope.get("headers", [])
                       if k not in (b"content-type", b"content-length")]
            scope = {**scope, "headers": headers + [(b"content-type", b"application/json"),
                                                    (b"content-length", b"2")]}
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def body_optional_paths(endpoints: list[Endpoint]) -> frozenset[str]:
    """The POST paths whose request schema validates from ``{}`` (every field defaulted): their
    body may be empty or missing (:class:`EmptyBodyDefaults`) and the OpenAPI document says
    ``requestBody.required: false`` for them, the schema still a ``$ref`` to the request model."""
    return frozenset(ep.path for ep in endpoints if ep.body_optional)


def _optional_bodies_in_openapi(app: FastAPI, paths: frozenset[str]) -> None:
    """``app.openapi()`` with ``requestBody.required`` false on ``paths`` (FastAPI's document
    is built once, then kept; only that flag changes: the body schema stays the model's
    ``$ref``, which making the route's parameter ``Model | None`` would turn into an anyOf)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = build()
            for path in paths:
                op = doc.get("paths", {}).get(path, {}).get("post")
                if op is not None and "requestBody" in op:
                    op["requestBody"]["required"] = False
        return app.openapi_schema

    app.openapi = openapi


class _Enough(Exception):
    pass


def _repr_head(obj, limit: int) -> str:
    """``repr(obj)`` when it is at most ``limit`` characters long, else a string of at least
    ``limit`` characters that starts like it, made without rendering the rest: the rejected
    value of a big body (a list of 200k floats) costs the event loop little, and a deeply
    nested one no recursion."""
    parts: list[str] = []
    size = 0

    def put(s: str) -> None:
        nonlocal size
        parts.append(s)
        size += len(s)
        if size >= limit:
            raise _Enough

    def walk(o) -> None:
        if type(o) is list:
            put("[")
            for i, x in enumerate(o):
                if i:
                    put(", ")
                walk(x)
            put("]")
        elif type(o) is dict:
            put("{")
            for i, (k, v) in enumerate(o.items()):
                if i:
                    put(", ")
                walk(k)
                put(": ")
                walk(v)
            put("}")
        else:
            put(repr(o))

    try:
        walk(obj)
    except _Enough:
        pass
    return "".join(parts)


_BRACKET_INDEX = re.compile(r"\[(-?\d+)\]")
_BRACKET_KEY = re.compile(r"\['([^'\\\[\]]*)'\]")


def param_spelling(param: str | None) -> str | None:
    """The one spelling of an error's ``param`` (docs/api.md, "Errors"): the request field's
    path as written in the body, keys and list indices joined by dots (``interventions.0.heads``,
    ``tokens.3``, ``logits.positions``), as pydantic's ``loc``. A path spelled with brackets
    by a lower layer (``interventions[0]``, ``grad.hooks[1]``, ``metrics['m']``) is
    re-spelled; anything else (``Authorization``, ``body``) passes unchanged."""
    if not param:
        return param
    return _BRACKET_KEY.sub(r".\1", _BRACKET_INDEX.sub(r".\1", param)).lstrip(".")


#: pydantic's names of union members in a ``loc`` (``constrained-str``, ``list[int]``,
#: ``function-after[...]``, a model's class name): never a field of this API (snake_case)
_UNION_TAG = re.compile(r"[\[\]\-,' ]|^[A-Z]|^(str|int|float|bool|list|dict|none|null)$")


def _user_loc(loc, body, etype: str) -> list:
    """``loc`` as the user wrote the request: pydantic's union member tags (``cache.0.
    constrained-str``, a discriminated union's ``interventions.0.zero``, ``vector.
    Base64Input``) dropped, by walking the loc through the body itself (a key the body has, an
    index of a list it has; the last element of a ``missing`` error is the absent field).
    Without the body, tags are told by their spelling (:data:`_UNION_TAG`)."""
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    out: list = []
    cur, known = body, body is not None
    for i, x in enumerate(parts):
        last = i == len(parts) - 1
        nxt = None if last else parts[i + 1]
        if (isinstance(cur, dict) and isinstance(x, str) and x in cur and not last
                and not isinstance(cur[x], (dict, list)) and isinstance(nxt, str)
                and (nxt in cur or (i + 1 == len(parts) - 1 and etype == "missing"))):
            continue  # a discriminated union's tag that is also a key ({"kind": "head",
            # "head": 0}: loc senders.0.head.layer is the sender's own layer)
        if isinstance(cur, dict) and isinstance(x, str) and x in cur:
            out.append(x)
            cur = cur[x]
        elif isinstance(cur, list) and isinstance(x, int) and -len(cur) <= x < len(cur):
            out.append(x)
            cur = cur[x]
        elif isinstance(x, int) and not known:
            out.append(x)
        elif isinstance(x, str) and ((last and etype == "missing") or (
                not known and not _UNION_TAG.search(x))):
            out.append(x)
            cur = None
        # else: a union member's tag (or a dict key validator's '[key]'): not the user's
    return out


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first problem of a refused body as ``(message, param)``: the field as the user
    wrote it (``cache.0``, never pydantic's ``cache.0.constrained-str``), the rule, the value
    given. For a union (a hook name or an object; a tensor as lists or base64) the member that
    got furthest names the problem (``vector.dtype`` of a base64 tensor), and members failing
    at the same field are said together ("a valid string, or a valid dictionary ...");
    the other members' failures one level up are not counted as more problems."""
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    if e.get("type") == "json_invalid":
        where = e.get("loc", ("body", "?"))[-1]
        err = (e.get("ctx") or {}).get("error", "invalid JSON")
        return f"body is not valid JSON: {err} (at character {where})", "body"
    if tuple(e.get("loc", ())) == ("body",) and e.get("type") in ("dict_type", "model_attributes_type"):
        return ("body must be a JSON object sent with 'Content-Type: application/json' "
                f"(got {type(e.get('input')).__name__})"), "body"
    if tuple(e.get("loc", ())) == ("body",) and e.get("type") == "missing":
        return ("body is missing: send a JSON object with 'Content-Type: application/json', "
                "see /docs for the fields"), "body"
    body = getattr(exc, "body", None)
    locs = []
    for x in errs:
        loc = _user_loc(x.get("loc", ()), body, str(x.get("type", "")))
        if x.get("type") in ("union_tag_invalid", "union_tag_not_found"):
            tag = str((x.get("ctx") or {}).get("discriminator", "")).strip("'\"")
            if tag:
                loc.append(tag)
        locs.append(tuple(loc))

    def related(a: tuple, b: tuple) -> bool:
        return a[:len(b)] == b or b[:len(a)] == a

    # the member that got furthest among the first error's union (same subtree)
    first = max((i for i in range(len(errs)) if related(locs[i], locs[0])),
                key=lambda i: (len(locs[i]), -i))
    e, loc = errs[first], locs[first]
    same = [i for i in range(len(errs)) if locs[i] == loc]
    msgs: list[str] = []
    for i in same:
        m = str(errs[i].get("msg", "invalid value")).removeprefix("Value error, ")
        if msgs:
            m = m.removeprefix("Input should be ")
        if m not in msgs:
            msgs.append(m)
    param = ".".join(str(x) for x in loc) or None
    msg = ", or ".join(msgs)
    given = e.get("input", None)
    if e.get("type") == "union_tag_invalid":  # the tag given, not the whole object
        given = (e.get("ctx") or {}).get("tag", given)
    text = f"{param}: {msg}" if param else msg
    if e.get("type") not in ("missing", "value_error") and given is not None:
        r = _repr_head(given, 81)
        text += f" (got {r[:80] + '...' if len(r) > 80 else r})"
    # other problems: other fields, not this one's union alternatives one level up
    more = {locs[i] for i in range(len(errs))
            if locs[i] != loc and not (related(locs[i], loc) and len(locs[i]) < len(loc))}
    if more:
        text += f" (and {len(more)} more problem{'s' if len(more) > 1 else ''})"
    return text, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(AttnscopeError)
    async def _domain(request: Request, exc: AttnscopeError):
        return ORJSONResponse(envelope(exc.type, exc.message, param_spelling(exc.param)),
                              status_code=exc.status,
                              headers=exc.headers or None)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return ORJSONResponse(envelope("validation_error", msg, param), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        types = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            # FastAPI's answer to a body it cannot decode (e.g. not UTF-8): same as bad JSON
            return ORJSONResponse(envelope(
                "validation_error", "body could not be parsed as JSON (it must be UTF-8 "
                "encoded JSON, nested at most a few hundred levels deep)", "body"),
                status_code=422)
        return ORJSONResponse(
            envelope(types.get(exc.status_code, "http_error"), str(exc.detail)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return ORJSONResponse(
            envelope("internal_error", "internal error; the service keeps serving"),
            status_code=500,
        )


def _install_offline_docs(app: FastAPI) -> None:
    """Swagger UI 5 at /docs (it reads OpenAPI 3.1; PyPI's swagger-ui-bundle ships Swagger UI 4,
    which cannot) from files vendored in the package by ``scripts/vendor-swagger-ui``: no CDN.
    Only the files /docs needs are served."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.responses import FileResponse

    from .web import SWAGGER_UI_DIR, SWAGGER_UI_FILES

    def asset(name: str):
        path = SWAGGER_UI_DIR / name

        async def serve():
            return FileResponse(path, headers={"cache-control": "public, max-age=86400"})
        return serve

    for name in SWAGGER_UI_FILES:
        app.add_api_route(f"/static/swagger-ui/{name}", asset(name), methods=["GET"],
                          include_in_schema=False)

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(
            openapi_url=app.openapi_url,
            title="attnscope - API docs",
            swagger_js_url="/static/swagger-ui/swagger-ui-bundle.js",
            swagger_css_url="/static/swagger-ui/swagger-ui.css",
            swagger_favicon_url="/static/swagger-ui/favicon-32x32.png",
            # no request to validator.swagger.io (offline); operations listed, models folded
            swagger_ui_parameters={"validatorUrl": None, "defaultModelsExpandDepth": 0},
        )


def _install_web(app: FastAPI) -> None:
    """The explorer (service/web/index.html) at ``/`` and ``/explorer``, its ES modules and
    stylesheet under ``/static/web/`` (same origin as the API: no CORS needed; no CDN)."""
    from fastapi.responses import FileResponse

    from .web import WEB_DIR, WEB_FILES

    async def index():
        return FileResponse(WEB_DIR / "index.html", headers={"cache-control": "no-cache"})

    for path in ("/", "/explorer"):
        app.add_api_route(path, index, methods=["GET"], include_in_schema=False)

    def asset(name: str):
        async def serve():
            return FileResponse(WEB_DIR / name, headers={"cache-control": "no-cache"})
        return serve

    rendered: list[bytes] = []

    async def client_module():
        # the JS client with the methods of THIS app's endpoint table (the committed file
        # holds the default table's: scripts/gen-clients)
        if not rendered:
            from .serving.core.table import with_js_endpoints

            source = (WEB_DIR / "attnscope.js").read_text()
            rendered.append(with_js_endpoints(source, app.state.endpoints).encode())
        from starlette.responses import Response

        return Response(rendered[0], media_type="text/javascript",
                        headers={"cache-control": "no-cache"})

    app.add_api_route("/static/web/attnscope.js", client_module, methods=["GET"],
                      include_in_schema=False)
    for name in WEB_FILES:
        if name == "attnscope.js":
            continue
        app.add_api_route(f"/static/web/{name}", asset(name), methods=["GET"],
                          include_in_schema=False)


def precompute(rt: Runtime, endpoints: list[Endpoint]) -> None:
    """What is computed once per model and only ever asked for whole, computed at start-up on
    the device thread, before ``/readyz`` says ready (so no request waits for it): the weight-
    only summaries of ``/v1/circuits`` when the table serves it (otherwise its first request
    paid them: ~5.6 CPU-seconds on GPT-2-small shapes on 2 cores, bench/circuits_latency.py;
    0.1 s on the bundled model). A model the feature does not serve (an encoder, a family the
    hooked forward does not run) is skipped; a failure here is logged, never fatal."""
    import time

    if not any(ep.path == "/v1/circuits" for ep in endpoints):
        return
    from .serving import circuits

    try:
        circuits.check(rt, None)
    except AttnscopeError:
        return
    t0 = time.perf_counter()
    try:
        circuits.computed(rt)
    except Exception:  # noqa: BLE001 - the endpoint computes (and reports) it on first use
        log.exception("precomputing /v1/circuits at start-up failed; computed on first use")
        return
    # its float64 temporaries (~0.6 GB on GPT-2 small) go back to the OS at start-up rather
    # than staying in the heap until a large response's trim
    release_memory()
    log.info("/v1/circuits precomputed at start-up in %.2f s", time.perf_counter() - t0)


def create_app(settings: Settings | None = None, runtime: Runtime | None = None,
               endpoints: list[Endpoint] | None = None) -> FastAPI:
    """Build the app. ``runtime`` given: use it (tests); else load ``settings.model`` in the
    lifespan, off the event loop. ``endpoints``: the endpoint table (default: every feature
    module's, :func:`~.serving.core.table.default_table`); one route is made per entry, and
    the JS client served at /static/web/attnscope.js lists exactly these."""
    settings = settings or Settings()
    set_heap_release(release_memory)  # process-wide: the encoding layer trims after bodies

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.settings = settings
        set_trim_free_bytes(settings.trim_free_bytes)
        set_numpy_hugepages(settings.numpy_hugepages)  # process-wide too
        app.state.slot = DeviceSlot(settings.max_queue, settings.max_request_bytes)
        app.state.runtime = runtime
        app.state.load_error = None
        frozen_here: list = []  # True once this app froze its start-up objects
        task = None
        if runtime is None:
            async def load():
                try:
                    await anyio.to_thread.run_sync(preload_analysis_libraries)
                    one_blas_thread_for_process()  # from the event loop's (main) thread
                    from transformers.utils import logging as hf_logging

                    hf_logging.disable_progress_bar()  # stderr holds log lines only (JSON)
                    # on the device thread: the probe forward's OpenMP team is the one every
                    # later forward uses (service/serving/core/slot.py)
                    rt = await app.state.slot.run(Runtime.load, settings, admit=False)
                    await app.state.slot.run(precompute, rt, app.state.endpoints, admit=False)
                    app.state.runtime = rt  # ready: /readyz says 200 from here
                    frozen = freeze_startup_objects()  # no 250 ms full collections later
                    frozen_here.append(True)
                    log.info("model ready: %s (%d start-up objects frozen for the garbage "
                             "collector)", app.state.runtime.info, frozen)
                except ModelLoadError as exc:
                    app.state.load_error = scrub_paths(str(exc))  # clients: no local paths
                    log.error("start-up failed: %s", exc)
                    if settings.exit_on_load_failure:
                        os._exit(3)
                except Exception as exc:  # pragma: no cover
                    app.state.load_error = scrub_paths(f"{type(exc).__name__}: {exc}")
                    log.exception("start-up failed")
                    if settings.exit_on_load_failure:
                        os._exit(3)
            task = asyncio.create_task(load())
        app.state.load_task = task
        yield
        if task is not None and not task.done():
            task.cancel()
        app.state.slot.close()
        if frozen_here:
            unfreeze_startup_objects()  # the last app to stop lets the collector see them again

    app = FastAPI(
        title="attnscope",
        version="0.1.0",
        description=API_DESCRIPTION,
        lifespan=lifespan,
        default_response_class=ORJSONResponse,
        docs_url=None,  # served below from local files: /docs works without the internet
        redoc_url=None,
    )
    app.state.engine = Engine(app.state)  # reads runtime/slot/metrics from the state
    install_error_handlers(app)
    _install_offline_docs(app)
    _install_web(app)
    table = default_table() if endpoints is None else endpoints
    optional = body_optional_paths(table)
    app.add_middleware(EmptyBodyDefaults, paths=optional)  # inside the body limit
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    install_ops(app, settings)  # request id, logs, metrics, keys, CORS, time limit, /metrics
    app.include_router(health.router)
    app.state.endpoints = table
    add_routes(app, table)
    _optional_bodies_in_openapi(app, optional)
    return app


def __getattr__(name: str):
    # ``uvicorn attnscope.service.app:app``: built on first access, not at import time.
    if name == "app":
        global app
        app = create_app()
        return app
    raise AttributeError(name)
