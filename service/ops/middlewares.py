"""The operational ASGI middlewares (pure ASGI, no per-request ``BaseHTTPMiddleware`` overhead).

* :class:`RequestContextMiddleware`: request id (X-Request-ID accepted if sane, else generated;
  echoed), one JSON log line per request, request metrics, and the 500 envelope for anything
  unhandled;
* :class:`ApiKeyMiddleware`: ``Authorization: Bearer <key>`` on ``/v1/...`` (401 envelope);
* :class:`TimeoutMiddleware`: 504 envelope at ``request_timeout_s``.

:func:`send_envelope` answers an error envelope straight from ASGI (before any route ran).
``attnscope.service.ops.install_ops`` adds them in order.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import hmac
import logging
import re
import time
import uuid

from ..encoding import DEADLINE_KEY, ORJSONResponse
from ..errors import envelope
from ..logs import request_id_var
from .metrics import Metrics
from .openapi import route_template

log = logging.getLogger("attnscope.ops")
access_log = logging.getLogger("attnscope.access")


OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
CLIENT_STATUS_KEY = "attnscope.client_status"
"""Scope key: the status the server (service/server.py) answered a request with after it
ended the request itself while its handler ran (400 malformed body, 408 body too slow)."""
CLIENT_CLOSED = 499
"""Status recorded (access log, metrics; never sent) for a request whose client went away
before any response started, e.g. an upload aborted mid-body (nginx's "client closed
request")."""
RESPONSE_CUT: contextvars.ContextVar[bool] = contextvars.ContextVar("attnscope_response_cut",
                                                                   default=False)
"""Set (in the request's task) when its response started but was never completed: cut at
the deadline or its client gone. The server's log filter (service/server.py) then drops
uvicorn's error line about it: one warning (the encoding layer's) per cut stream."""
_QUIET_PATHS = OPEN_PATHS  # logged at debug level (probes and scrapes every few seconds)
_REQUEST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")


async def send_envelope(send, status: int, type_: str, message: str, param: str | None = None,
                        headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer the error envelope ``{"error": {"type", "message", "param"}}`` with ``status``
    and ``headers`` through the ASGI ``send`` (no route ran, no response started)."""
    body = ORJSONResponse(envelope(type_, message, param)).body
    await send({
        "type": "http.response.start", "status": status,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()), *(headers or [])],
    })
    await send({"type": "http.response.body", "body": body})


def _draining(scope) -> bool:
    """Whether the server is draining (service/server.py ``DrainingServer`` sets the app's
    ``state.draining``)."""
    app = scope.get("app")
    return bool(getattr(getattr(app, "state", None), "draining", False))


class RequestContextMiddleware:
    """Request id, one access-log line, request metrics, and the 500 envelope of last resort.

    A request that ends with no response started because the client went away (the handler
    saw ``http.disconnect``) is recorded as :data:`CLIENT_CLOSED` (499), or as the status the
    server answered it with itself (``scope[CLIENT_STATUS_KEY]``: 400 for a malformed body,
    408 for a body past ``body_timeout_s``), not as 500."""

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

        gone = False  # the handler was told the client went away

        async def receive_watched():
            nonlocal gone
            msg = await receive()
            if msg["type"] == "http.disconnect":
                gone = True
            return msg

        try:
            if _draining(scope) and scope.get("path") not in OPEN_PATHS:
                await send_envelope(send_with_id, 503, "shutting_down",
                                    "the service is shutting down; retry (another replica "
                                    "answers)", headers=[(b"retry-after", b"1"),
                                                         (b"connection", b"close")])
            else:
                await self.app(scope, receive_watched, send_with_id)
        except asyncio.CancelledError:
            # uvicorn cancels the requests still running at the end of its graceful
            # shutdown: they get the 503 envelope, not its plain-text 500 and a traceback
            if not _draining(scope):
                raise
            log.warning("request cancelled by the server's shutdown",
                        extra={"fields": {"path": scope.get("path")}})
            if not started:
                try:
                    await send_envelope(send_with_id, 503, "shutting_down",
                                        "the service shut down before this request's work "
                                        "ended; retry (another replica answers)",
                                        headers=[(b"retry-after", b"1"),
                                                 (b"connection", b"close")])
                except Exception:  # noqa: BLE001 - the connection is gone too
                    pass
        except Exception:
            if gone and not started:  # e.g. Starlette's ClientDisconnect: nothing to answer
                log.debug("request ended after its client went away", exc_info=True)
            else:
                log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
                if started:
                    raise
                await send_envelope(send_with_id, 500, "internal_error",
                                    "internal error; the service keeps serving")
        finally:
            if started and not t_end:
                RESPONSE_CUT.set(True)  # read by the server's log filter after we return
            if CLIENT_STATUS_KEY in scope:  # the server answered it (its handler's was dropped)
                status = scope[CLIENT_STATUS_KEY]
            elif gone and not started:
                status = CLIENT_CLOSED
            # the client's latency: to the end of the response (a 504 ends before its handler)
            dt = (t_end[0] if t_end else time.perf_counter()) - t0
            route = route_template(scope, self.templates)
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
    *abandoned* (whatever it then sends is dropped) and its device job stops at the same
    deadline: the engine's cancel token (service/serving/core/cancel.py) is checked at every
    torch op and loop checkpoint, so the job ends within milliseconds and releases the device
    slot normally (issue 29; before, it ran to its end). The slot's accounting stays true: an
    abandoned job counts against ``max_queue`` until it ends, and the device is never used by
    two jobs at once. ``attnscope_abandoned_requests`` shows them. A response that has already started
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
            log.warning("request timed out after %.3g s; its job is stopped (cancel token)",
                        self.seconds, extra={"fields": {"path": scope.get("path")}})
            await send_envelope(
                send, 504, "timeout",
                f"the request took longer than {self.seconds:g} s (request_timeout_s); its work "
                "was stopped — retry with a smaller request, or later",
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
