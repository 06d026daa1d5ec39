"""Operations: request ids and JSON request logs, Prometheus metrics, API keys, CORS, time limit.

``install_ops(app, settings)`` adds, outermost first (pure ASGI middlewares, no per-request
``BaseHTTPMiddleware`` overhead)::

    RequestContextMiddleware  request id (X-Request-ID accepted if sane, else generated; echoed),
                              one JSON log line per request, request metrics, and the 500
                              envelope for anything unhandled
    CORSMiddleware            only when settings.cors_origins is non-empty (Starlette's)
    ApiKeyMiddleware          only when settings.api_keys is non-empty: /v1/... needs
                              ``Authorization: Bearer <key>``; 401 envelope otherwise
    TimeoutMiddleware         settings.request_timeout_s > 0: 504 envelope at the deadline
    BodyLimitMiddleware       (service.app) 413 beyond max_body_bytes

and ``GET /metrics`` (Prometheus text format; not in the OpenAPI schema).

Open without a key: ``/healthz``, ``/readyz`` (probes), ``/metrics`` (scrapers; it shows
counts, latencies and the model's identity, never request content — keep it on an internal
network), ``/openapi.json`` and ``/docs``. Everything under ``/v1/`` (everything that runs the
model) needs a key when keys are configured.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import time
import uuid

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from attnscope.service.encoding import DEADLINE_KEY, ORJSONResponse
from attnscope.service.errors import envelope
from attnscope.service.logs import request_id_var

log = logging.getLogger("attnscope.ops")
access_log = logging.getLogger("attnscope.access")


OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
_QUIET_PATHS = OPEN_PATHS  # logged at debug level (probes and scrapes every few seconds)
_REQUEST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


# ------------------------------------------------------------------------------------ metrics
class _StateCollector:
    """Reads live state at scrape time: queue depth, cache, forward count, model info."""

    def __init__(self, app: FastAPI):
        self.app = app

    def describe(self):
        return []

    def collect(self):
        st = self.app.state
        slot = getattr(st, "slot", None)
        rt = getattr(st, "runtime", None)
        g = GaugeMetricFamily(
            "attnscope_queue_depth", "Requests waiting for or holding the device slot."
        )
        g.add_metric([], slot.depth if slot is not None else 0)
        yield g
        g = GaugeMetricFamily("attnscope_ready", "1 once the model is loaded and probed, else 0.")
        g.add_metric([], 1 if rt is not None else 0)
        yield g
        g = GaugeMetricFamily(
            "attnscope_abandoned_requests",
            "Requests answered 504 whose forward pass is still finishing in the background.",
        )
        g.add_metric([], len(getattr(st, "abandoned", ())))
        yield g
        if rt is None:
            return
        cache = rt.cache
        for name, doc, val in (
            ("attnscope_cache_hits", "Forward-cache lookups that found the text's forward.", cache.hits),
            ("attnscope_cache_misses", "Forward-cache lookups that needed a forward pass.", cache.misses),
            ("attnscope_forwards", "Padded forward passes run on the device.", rt.forward_count),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], val)
            yield c
        g = GaugeMetricFamily("attnscope_cache_bytes", "Bytes of tensors held by the forward cache.")
        g.add_metric([], cache.nbytes)
        yield g
        g = GaugeMetricFamily("attnscope_cache_entries", "Forward results held by the cache.")
        g.add_metric([], len(cache))
        yield g
        info = InfoMetricFamily("attnscope_model", "The resident model (chosen at start-up).")
        keys = ("id", "revision", "architecture", "family", "n_layers", "n_heads", "d_model",
                "n_ctx", "device", "dtype", "fallback")
        info.add_metric([], {k: str(rt.info.get(k)) for k in keys})
        yield info


class Metrics:
    """The Prometheus registry of one app (a registry per app, so tests can build many)."""

    def __init__(self, app: FastAPI):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "attnscope_requests", "HTTP requests answered, by method, route template and status.",
            ["method", "route", "status"], registry=r,
        )
        self.latency = Histogram(
            "attnscope_request_duration_seconds",
            "Time from request start to the end of the response, by method and route template.",
            ["method", "route"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.in_flight = Gauge(
            "attnscope_requests_in_flight", "HTTP requests being served.", registry=r
        )
        self.device_seconds = Histogram(
            "attnscope_forward_seconds",
            "Time one request held the device slot for its forward passes (a request whose "
            "forwards are all cached does not wait for the slot and is not counted).",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.queue_seconds = Histogram(
            "attnscope_queue_wait_seconds", "Time a request waited for the device slot before "
            "its forward passes.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        r.register(_StateCollector(app))
        ProcessCollector(registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


metrics_router = APIRouter()


@metrics_router.get("/metrics", include_in_schema=False)
async def metrics_endpoint(request: Request) -> Response:
    """Prometheus text exposition of this replica's metrics."""
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


# ---------------------------------------------------------------------------------- helpers
async def send_envelope(send, status: int, type_: str, message: str, param: str | None = None,
                        headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = ORJSONResponse(envelope(type_, message, param)).body
    await send({
        "type": "http.response.start", "status": status,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()), *(headers or [])],
    })
    await send({"type": "http.response.body", "body": body})


def _route_template(scope, templates=None) -> str:
    """The matched route's path template (bounded label values), else ``"unmatched"``.
    Requests answered before routing (401, 413, 504) are matched by ``templates(path)``."""
    route = scope.get("route")
    path = getattr(route, "path_format", None) or getattr(route, "path", None)
    if path is None and templates is not None:
        path = templates(scope.get("path", ""))
    return path or "unmatched"


def _openapi_templates(app: FastAPI):
    """``path -> template`` over the OpenAPI paths (compiled on first use)."""
    compiled: list = []

    def match(path: str) -> str | None:
        if not compiled:
            from starlette.routing import compile_path

            for template in app.openapi().get("paths", {}):
                compiled.append((compile_path(template)[0], template))
        for rx, template in compiled:
            if rx.match(path):
                return template
        return None

    return match


# ------------------------------------------------------------------------------ middlewares
class RequestContextMiddleware:
    """Request id, one access-log line, request metrics, and the 500 envelope of last resort."""

    def __init__(self, app, metrics: Metrics, templates=None):
        self.app = app
        self.metrics = metrics
        self.templates = templates

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = None
        for k, v in scope.get("headers", []):
            if k == b"x-request-id":
                given = v.decode("latin-1")
                break
        rid = given if given and _REQUEST_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        token = request_id_var.set(rid)
        status = 500
        started = False
        t0 = time.perf_counter()
        t_end: list[float] = []  # when the response's last byte was handed to the server
        m = self.metrics
        m.in_flight.inc()

        async def send_with_id(msg):
            nonlocal status, started
            if msg["type"] == "http.response.start":
                started = True
                status = msg["status"]
                headers = [(k, v) for k, v in msg.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", rid.encode()))
                msg = {**msg, "headers": headers}
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
                t_end.append(time.perf_counter())
            await send(msg)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            await send_envelope(send_with_id, 500, "internal_error",
                                "internal error; the service keeps serving")
        finally:
            # the client's latency: to the end of the response (a 504 ends before its handler)
            dt = (t_end[0] if t_end else time.perf_counter()) - t0
            route = _route_template(scope, self.templates)
            method = scope.get("method", "")
            m.in_flight.dec()
            m.requests.labels(method, route, str(status)).inc()
            m.latency.labels(method, route).observe(dt)
            path = scope.get("path", "")
            access_log.log(
                logging.DEBUG if path in _QUIET_PATHS and status < 400 else logging.INFO,
                "request",
                extra={"fields": {
                    "method": method, "path": path, "route": route, "status": status,
                    "duration_ms": round(dt * 1000, 2),
                    "client": (scope.get("client") or ("", 0))[0],
                    # False: the response started but its last byte was never sent (cut at
                    # the deadline, or the client went away)
                    **({"complete": False} if started and not t_end else {}),
                }},
            )
            request_id_var.reset(token)


class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` on ``/v1/...`` when keys are configured.

    Keys are compared as SHA-256 digests with :func:`hmac.compare_digest`, against every
    configured key without short-circuiting, so neither the position of a matching key nor the
    length or prefix of a wrong one shows in the response time.
    """

    def __init__(self, app, keys: list[str]):
        self.app = app
        # keys are compared stripped (as the header's token is); blank ones configure nothing
        self.digests = [hashlib.sha256(k.strip().encode()).digest() for k in keys if k.strip()]

    @staticmethod
    def protected(path: str) -> bool:
        return path == "/v1" or path.startswith("/v1/")

    def check(self, header: str | None) -> bool:
        if not header:
            return False
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        # the header was decoded as latin-1: encode back to its raw bytes (UTF-8 keys match)
        given = hashlib.sha256(token.strip().encode("latin-1")).digest()
        ok = False
        for d in self.digests:
            ok |= hmac.compare_digest(d, given)
        return ok

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.digests or not self.protected(scope["path"]):
            return await self.app(scope, receive, send)
        found = [v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"authorization"]
        header = found[0] if found else None
        if len(found) == 1 and self.check(header):
            return await self.app(scope, receive, send)
        if len(found) > 1:  # ambiguous: never let the order of two headers decide
            msg = (f"{len(found)} Authorization headers were sent; send exactly one "
                   "'Authorization: Bearer <key>'")
            challenge = b'Bearer realm="attnscope", error="invalid_request"'
        elif header is None:
            msg = "an API key is required: send the header 'Authorization: Bearer <key>'"
            challenge = b'Bearer realm="attnscope"'
        else:
            msg = "the API key is not valid (expected 'Authorization: Bearer <key>')"
            challenge = b'Bearer realm="attnscope", error="invalid_token"'
        await send_envelope(send, 401, "unauthorized", msg, "Authorization",
                            [(b"www-authenticate", challenge)])


class TimeoutMiddleware:
    """Answer 504 (envelope type ``timeout``) when a request runs past ``seconds``.

    The handler runs in the request's own task as usual; a timer armed at the start fires at
    the deadline and, if no response has started, sends the 504 at once. The handler is
    *abandoned, not cancelled*: a forward pass already running in its worker thread cannot be
    interrupted, so it finishes in the background (whatever it then sends is dropped) and
    releases the device slot normally. The slot's accounting therefore stays true: an
    abandoned forward still counts against ``max_queue`` until it ends, so a burst of timeouts
    turns into 429s rather than a pile-up, and the device is never used by two forwards at
    once. ``attnscope_abandoned_requests`` shows them. A response that has already started
    cannot be replaced by a 504: a streamed one (``service.encoding.ChunkedResponse``, every
    big JSON or safetensors body) stops at the deadline (put in the scope under
    ``DEADLINE_KEY``), logs a warning and closes the connection without the end of the body,
    so the client sees an incomplete response (httpx: ``RemoteProtocolError``). Health, readiness and metrics are never
    timed. (A timer rather than running the handler as a separate task: handing the
    handler to another task added ~250 ms per forward under uvicorn+uvloop here.)
    """

    def __init__(self, app, seconds: float, abandoned: set | None = None):
        self.app = app
        self.seconds = seconds
        self.abandoned: set = abandoned if abandoned is not None else set()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.seconds <= 0 or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        state = {"started": False, "timed_out": False}
        token = object()

        async def guarded_send(msg):
            if state["timed_out"]:
                return
            if msg["type"] == "http.response.start":
                state["started"] = True
            await send(msg)

        async def fire():
            if state["started"] or state["done"]:
                return
            state["timed_out"] = True
            self.abandoned.add(token)
            log.warning("request timed out after %.3g s; its work finishes in the background",
                        self.seconds, extra={"fields": {"path": scope.get("path")}})
            await send_envelope(
                send, 504, "timeout",
                f"the request took longer than {self.seconds:g} s (request_timeout_s); its work "
                "was abandoned — retry with a smaller request, or later",
            )

        state["done"] = False
        # streamed responses (service.encoding.ChunkedResponse) stop at this deadline
        scope[DEADLINE_KEY] = time.monotonic() + self.seconds
        loop = asyncio.get_running_loop()
        fired: list[asyncio.Task] = []
        timer = loop.call_later(self.seconds, lambda: fired.append(loop.create_task(fire())))
        try:
            await self.app(scope, receive, guarded_send)
        except Exception:
            if not state["timed_out"]:
                raise
            log.warning("abandoned request ended with an error", exc_info=True)
        finally:
            state["done"] = True
            timer.cancel()
            if fired:
                await fired[0]  # the 504 is fully sent before this request's task ends
            self.abandoned.discard(token)


# ---------------------------------------------------------------------------------- openapi
def _document_errors(app: FastAPI, keys: bool, timeout_s: float) -> None:
    """Make OpenAPI tell the truth about errors: every 4xx/5xx body is the envelope
    (``ErrorResponse``), not FastAPI's ``HTTPValidationError``; ``/v1/...`` documents 401 when
    keys are configured and 504 when a time limit is set."""
    from attnscope.schemas.common import ErrorResponse

    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        spec = build()
        comps = spec.setdefault("components", {}).setdefault("schemas", {})
        if "ErrorResponse" not in comps:
            js = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
            comps.update(js.pop("$defs", {}))
            comps["ErrorResponse"] = js
        ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        extra = {}
        if keys:
            extra["401"] = "Unauthorized: API keys are configured and the request has none or "\
                "a wrong one ('Authorization: Bearer <key>')."
        if timeout_s > 0:
            extra["504"] = f"The request took longer than request_timeout_s ({timeout_s:g} s)."
        for path, ops in spec.get("paths", {}).items():
            for op in ops.values():
                responses = op.get("responses", {})
                for code, resp in responses.items():
                    if code[:1] in ("4", "5"):
                        schema = (resp.get("content") or {}).get("application/json", {}).get("schema")
                        if not schema or schema.get("$ref", "").endswith("/HTTPValidationError"):
                            resp["content"] = ref
                if path.startswith("/v1/"):
                    for code, desc in extra.items():
                        responses.setdefault(code, {"description": desc, "content": ref})
        app.openapi_schema = spec
        return spec

    app.openapi = openapi


# ---------------------------------------------------------------------------------- install
def _cors_middleware():
    """Starlette's CORSMiddleware whose refused preflights (400) answer the error envelope
    (type ``validation_error``, param the refused part: origin, method or headers)."""
    from starlette.middleware.cors import CORSMiddleware

    class EnvelopeCORSMiddleware(CORSMiddleware):
        def preflight_response(self, request_headers):
            resp = super().preflight_response(request_headers)
            if resp.status_code < 400:
                return resp
            text = bytes(resp.body).decode("utf-8", "replace")
            keep = {k: v for k, v in resp.headers.items()
                    if k.lower() not in ("content-length", "content-type")}
            what = text.removeprefix("Disallowed CORS ").split(",")[0].strip() or "origin"
            param = {"origin": "Origin", "method": "Access-Control-Request-Method",
                     "headers": "Access-Control-Request-Headers"}.get(what, "Origin")
            # the refusal names what was refused, never the allowed origins (which would
            # tell anyone where the service is used from); methods and headers are public
            return ORJSONResponse(
                envelope("validation_error", f"CORS preflight refused ({text}); allowed "
                         "methods GET, POST, OPTIONS, headers Authorization, Content-Type, "
                         "X-Request-ID", param),
                status_code=resp.status_code, headers=keep,
            )

    return EnvelopeCORSMiddleware


def install_ops(app: FastAPI, settings) -> None:
    """Add metrics, the operational middlewares (see the module docstring) and ``/metrics``.
    Call after the body-limit middleware was added (middlewares added later wrap it)."""
    app.state.metrics = Metrics(app)
    app.include_router(metrics_router)
    timeout_s = float(getattr(settings, "request_timeout_s", 0) or 0)
    app.state.abandoned = set()
    app.add_middleware(TimeoutMiddleware, seconds=timeout_s, abandoned=app.state.abandoned)
    keys = [k for k in (getattr(settings, "api_keys", []) or []) if k.strip()]
    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=keys)
    origins = list(getattr(settings, "cors_origins", []) or [])
    if origins:
        app.add_middleware(
            _cors_middleware(),
            allow_origins=origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "X-Request-ID"],
            expose_headers=["X-Request-ID"],
            max_age=600,
        )
    app.add_middleware(RequestContextMiddleware, metrics=app.state.metrics,
                       templates=_openapi_templates(app))
    _document_errors(app, bool(keys), timeout_s)
