"""The HTTP server: uvicorn with limits set by us (issue 17, "Connections"), not its defaults.

uvicorn by itself holds an idle TCP connection forever (its keep-alive timer starts only
after a first response), holds a client that trickles its headers one byte at a time forever,
and with httptools accepts headers of any size (h11's 16 KiB bound does not apply to it):
21,000 idle connections exhausted the process's file descriptors (every new client failed for
~20 s) and one 100 MB header cost +230 MB. :func:`guarded_protocol` wraps uvicorn's httptools
protocol (h11 where httptools is missing) with:

* a connection limit (``Settings.max_connections``): a connection beyond it first evicts the
  connection idle the longest (no request in flight: fresh and silent, kept alive after a
  response, or lingering after a last one), so a flood of idle sockets never locks out a real
  client; when none is idle the newcomer gets ``503`` (envelope type ``overloaded``,
  ``Retry-After: 1``) and is closed at once;
* a header-read timeout (``Settings.header_timeout_s``): from the connection's start, or a
  request's first byte, to the end of its headers; past it ``408`` and close;
* a header size limit (``Settings.max_header_bytes``): request line + headers beyond it get
  ``431`` and close, before the headers are parsed further; bytes of a request's body are
  never counted;
* a body-read timeout (``Settings.body_timeout_s``): from the end of a request's headers to
  the end of its body; past it ``408`` (the request's handler sees the client gone and its
  answer is dropped) and close. Not the client's fault, so not counted: time while uvicorn
  does not read (the handler has not taken the body read so far, a pipelined request waits
  its turn, the event loop ran late with the bytes unread, ``Expect: 100-continue`` not yet
  answered);
* malformed HTTP (bad or duplicate Content-Length, Content-Length with Transfer-Encoding, a
  bad chunk, control characters in a header, an unknown method) gets ``400`` with the error
  envelope (type ``http_error``, the parser's reason), not uvicorn's plain text;
* one response per request: a response that starts while the request's body is still
  arriving (``401`` before the body is read, ``413`` from Content-Length, a ``504`` during a
  slow body) says ``connection: close`` and the connection closes after it, lingering;
* a lingering close wherever a connection is closed while the client may still be sending
  (the cases above, 408, 431, 400): the response is written, then a FIN (half-close), then
  what the client still sends is read and dropped (never parsed) until it closes or
  :data:`LINGER_S` pass. A plain close with unread bytes makes the kernel send RST, which can
  destroy the response before the client reads it (nginx's ``lingering_close``);
* uvicorn's own ``timeout_keep_alive`` (``Settings.keep_alive_timeout_s``) and
  ``limit_concurrency`` (a backstop a little above max_connections: uvicorn answers 503 to
  requests beyond it) and h11's ``h11_max_incomplete_event_size`` (= max_header_bytes).

When a request is ended here (400, 408) while its handler runs, the status goes into the
request's scope under ``CLIENT_STATUS_KEY`` for the access log and the metrics
(service/ops/middlewares.py). The body timeout, the 400 envelope and the one-response rule
need httptools' parser callbacks: with the h11 fallback they are uvicorn's own behaviour.

The process's soft file-descriptor limit is raised to its hard limit at start-up, and
``max_connections`` must leave room under it (checked; the model's files, the device thread,
and the logs need some).
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
from typing import Any

log = logging.getLogger("attnscope.server")

FD_RESERVE = 256  # descriptors kept for everything but client connections
LINGER_S = 5.0
SLOW_SCAN = 64
"""At most this many of the oldest senders are compared when one is evicted (bounded loop
time per new connection under a flood)."""
FRESH_GRACE_S = 0.05
"""A connection just accepted is not evicted as idle for this long: its client's first bytes
are on their way (under a connection flood each newcomer would otherwise evict the one
accepted just before it)."""
"""Most seconds a closing connection keeps reading (and dropping) what its client still sends
after the last response and a FIN (the lingering close; nginx's ``lingering_timeout``)."""


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def _envelope_response(status: int, reason: str, type_: str, message: str,
                       extra: bytes = b"") -> bytes:
    from .encoding import dumps
    from .errors import envelope

    body = dumps(envelope(type_, message))
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n").encode() + extra + \
        b"\r\n" + body


def _unread(transport) -> bool:
    """True when the connection's socket holds bytes the event loop has not read yet."""
    import socket as _socket

    sock = transport.get_extra_info("socket")
    try:
        fd = sock.fileno()
        with _socket.socket(fileno=os.dup(fd)) as dup:
            return bool(dup.recv(1, _socket.MSG_PEEK | _socket.MSG_DONTWAIT))
    except (OSError, AttributeError, ValueError):
        return False


class _HeadersTooBig(Exception):
    pass


class _CycleTransport:
    """The transport as one request's uvicorn cycle sees it: its ``close()`` (after a response
    with ``connection: close``) becomes the protocol's close, which lingers while the
    request's body is still arriving."""

    def __init__(self, protocol):
        self._protocol = protocol
        self._transport = protocol.transport

    def close(self) -> None:
        self._protocol._close_after_response()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def guarded_protocol(max_connections: int, header_timeout_s: float, max_header_bytes: int,
                     body_timeout_s: float = 0.0, max_client_connections: int = 0,
                     slow_sender_s: float = 0.25):
    """A uvicorn HTTP protocol class enforcing the limits of the module docstring."""
    from .ops.middlewares import CLIENT_STATUS_KEY

    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
        httptools = True
    except ImportError:  # pragma: no cover - uvicorn[standard] brings httptools
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base
        httptools = False

    # connections with no request in flight, oldest first, each with the loop time before
    # which it is not evicted (a fresh connection's first bytes are on their way)
    idle: dict[Any, float] = {}
    # connections whose client is sending a request (headers, or a body the server reads),
    # oldest first, with the loop time the request began: the slow ones go before others
    sending: dict[Any, float] = {}
    per_client: dict[str, int] = {}  # open connections per client address

    class GuardedProtocol(Base):
        LIMITS = {"max_connections": max_connections, "header_timeout_s": header_timeout_s,
                  "max_header_bytes": max_header_bytes, "body_timeout_s": body_timeout_s,
                  "max_client_connections": max_client_connections,
                  "slow_sender_s": slow_sender_s}

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._hdr_timer = self._body_timer = self._linger_timer = None
            self._hdr_bytes = 0
            self._reading = True  # awaiting or reading a request's headers: bytes count
            self._in_body = False  # between a request's headers and the end of its body
            self._lingering = False
            self._any_bytes = False
            peer = transport.get_extra_info("peername")
            self._peer = peer[0] if isinstance(peer, tuple) and peer else str(peer)
            self._counted = False
            self._rx = 0  # bytes received since the current request began
            if max_client_connections and \
                    per_client.get(self._peer, 0) >= max_client_connections and \
                    not self._make_room(self._peer):
                return self._refuse_connection(
                    f"too many connections from this client (max_client_connections="
                    f"{max_client_connections}); retry shortly", "max_client_connections")
            if len(self.connections) > max_connections and not self._make_room(None):
                return self._refuse_connection(
                    f"too many connections (max_connections={max_connections}); retry "
                    "shortly", "max_connections")
            per_client[self._peer] = per_client.get(self._peer, 0) + 1
            self._counted = True
            idle[self] = self.loop.time() + FRESH_GRACE_S
            self._arm()

        def _refuse_connection(self, message: str, limit: str) -> None:
            log.warning("connection refused: %s (%d open)", limit, len(self.connections) - 1)
            self.transport.write(_envelope_response(
                503, "Service Unavailable", "overloaded", message, b"retry-after: 1\r\n"))
            self.transport.close()
            self.connections.discard(self)

        def _make_room(self, peer: str | None) -> bool:
            """Close one connection (of client ``peer`` only, when given) to make room: the
            one idle the longest (past its first FRESH_GRACE_S); else, of the connections whose request has been arriving for
            at least ``slow_sender_s``, the one that sent the fewest bytes per second since
            (a trickling client: 408; a body the server is not reading is not the client's
            fault and never counts); else the oldest fresh one. False when none qualifies."""
            now = self.loop.time()
            victim = next((c for c, until in idle.items() if until <= now and
                           (peer is None or c._peer == peer)), None)
            if victim is not None:
                idle.pop(victim, None)
                victim._drop()
                return True
            best, best_rate, best_age, seen = None, float("inf"), 0.0, 0
            for c, since in sending.items():  # oldest first
                age = now - since
                if age < slow_sender_s or seen >= SLOW_SCAN:
                    break  # the rest began later (or: enough candidates, the loop's time)
                if (peer is None or c._peer == peer) and not c.flow.read_paused and \
                        not c.transport.is_closing():
                    seen += 1
                    rate = c._rx / max(age, 1e-9)  # bytes per second since its request began
                    if rate < best_rate:
                        best, best_rate, best_age = c, rate, age
            if best is not None:
                best._evict_slow(best_age)
                return True
            # a flood of fresh connections: the oldest of them, within its grace too
            victim = next((c for c in idle if peer is None or c._peer == peer), None)
            if victim is not None:
                idle.pop(victim, None)
                victim._drop()
                return True
            return False

        def _evict_slow(self, age: float) -> None:
            """Answer 408 to the request still arriving and close at once (the slot is
            needed now: no lingering)."""
            sending.pop(self, None)
            idle.pop(self, None)
            self._disarm()
            self._disarm_body()
            log.info("slow connection evicted to make room: its request has been arriving "
                     "for %.3g s (slow_sender_s)", age)
            cycle = self.cycle
            answer = cycle is None or cycle.response_complete
            if cycle is not None and not cycle.response_complete and self._in_body:
                cycle.scope[CLIENT_STATUS_KEY] = 408
                answer = not cycle.response_started
                cycle.disconnected = True  # the handler's receive() says so, its send drops
                cycle.message_event.set()
            if answer:
                self.transport.write(_envelope_response(
                    408, "Request Timeout", "timeout",
                    f"the request was still arriving after {age:.3g} s when the server needed "
                    "its connection for others (slow_sender_s)"))
            self.transport.close()

        def _sending(self, on: bool) -> None:
            if on:
                if self not in sending:
                    sending[self] = self.loop.time()
            else:
                sending.pop(self, None)
                self._rx = 0  # the next request counts from its own first byte

        def _drop(self) -> None:
            self._disarm()
            self._disarm_body()
            if not self.transport.is_closing():
                self.transport.close()

        def _arm(self) -> None:
            if self._hdr_timer is None and header_timeout_s > 0:
                self._armed_at = self.loop.time()
                self._hdr_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._hdr_timer is not None:
                self._hdr_timer.cancel()
                self._hdr_timer = None

        def _arm_body(self) -> None:
            if self._body_timer is None and body_timeout_s > 0:
                self._body_armed_at = self.loop.time()
                self._body_timer = self.loop.call_later(body_timeout_s, self._body_timeout)

        def _disarm_body(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _header_timeout(self) -> None:
            self._hdr_timer = None
            if not self._reading or self.transport.is_closing() or self._lingering:
                return
            late = self.loop.time() - self._armed_at - header_timeout_s
            if late > 0.1 and _unread(self.transport):
                # the event loop itself ran late (busy) and bytes the client sent wait unread
                # in the socket: not the client's fault; another period
                return self._arm()
            idle.pop(self, None)
            if not self._any_bytes:
                log.debug("idle connection closed after %.3g s (header_timeout_s)",
                          header_timeout_s)
                self.transport.close()
                return
            # a request began and its headers never ended
            log.info("connection dropped: headers not complete after %.3g s "
                     "(header_timeout_s)", header_timeout_s)
            self._refuse(408, _envelope_response(
                408, "Request Timeout", "timeout",
                f"the request's headers took longer than {header_timeout_s:g} s "
                "(header_timeout_s)"))

        def _body_timeout(self) -> None:
            self._body_timer = None
            cycle = self.cycle
            if not self._in_body or self.transport.is_closing() or self._lingering or \
                    cycle is None or cycle.response_started:
                return  # (a response under way closes the connection after it)
            late = self.loop.time() - self._body_armed_at - body_timeout_s
            if self.flow.read_paused or cycle.waiting_for_100_continue or \
                    (late > 0.1 and _unread(self.transport)):
                # uvicorn is not reading (the handler has not read the body so far, or a
                # pipelined request waits), the client waits for 100 Continue, or the event
                # loop ran late with bytes unread: not the client's fault; another period
                return self._arm_body()
            log.info("request dropped: body not complete %.3g s after its headers "
                     "(body_timeout_s)", body_timeout_s)
            self._refuse(408, _envelope_response(
                408, "Request Timeout", "timeout",
                f"the request's body took longer than {body_timeout_s:g} s after its "
                "headers (body_timeout_s)"))

        def connection_lost(self, exc) -> None:
            idle.pop(self, None)
            sending.pop(self, None)
            if getattr(self, "_counted", False):
                self._counted = False
                n = per_client.get(self._peer, 1) - 1
                if n > 0:
                    per_client[self._peer] = n
                else:
                    per_client.pop(self._peer, None)
            self._disarm()
            self._disarm_body()
            if self._linger_timer is not None:
                self._linger_timer.cancel()
                self._linger_timer = None
            super().connection_lost(exc)

        def _refuse(self, status: int, response: bytes) -> None:
            """Answer ``response`` (an error of the request being read) and close, lingering.

            The request whose headers or body are being read is refused: with a handler
            running (its body being read, no response started) the handler sees the client
            gone, its own answer is dropped and ``status`` is recorded for the access log.
            When an earlier request is still being answered (pipelining) or the request's
            own answer has started, no second response is written over it: the connection
            closes after that answer instead."""
            self._disarm()
            self._disarm_body()
            idle.pop(self, None)
            sending.pop(self, None)
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                if self._in_body:
                    cycle.scope[CLIENT_STATUS_KEY] = status
                if not (self._in_body and not cycle.response_started):
                    cycle.keep_alive = False
                    self.flow.pause_reading()
                    return
                cycle.disconnected = True  # the handler's receive() says so, its send drops
                cycle.message_event.set()
            self.transport.write(response)
            self._linger()

        def _linger(self) -> None:
            """Half-close (FIN after what was written), then drop what the client still sends
            until it closes or LINGER_S pass."""
            if self._lingering or self.transport.is_closing():
                return
            self._lingering = True
            self._disarm()
            self._disarm_body()
            self._unset_keepalive_if_required()
            if httptools:
                self.pipeline.clear()  # requests queued behind the last one: not answered
            idle[self] = 0.0  # first to go when connections run short
            try:
                self.transport.write_eof()
            except (OSError, RuntimeError, NotImplementedError):
                self.transport.close()
                return
            self.flow.resume_reading()
            self._linger_timer = self.loop.call_later(LINGER_S, self._drop)

        def _close_after_response(self) -> None:
            """A cycle closes the connection after its response (``connection: close``)."""
            if self._in_body and not self.transport.is_closing():
                self._linger()  # the request's body is still arriving
            elif not self.transport.is_closing():
                self.transport.close()

        def _too_big(self) -> None:
            log.info("request refused: headers over %d bytes (max_header_bytes)",
                     max_header_bytes)
            self._refuse(431, _envelope_response(
                431, "Request Header Fields Too Large", "payload_too_large",
                f"the request line and headers exceed {max_header_bytes} bytes "
                "(max_header_bytes)"))

        def _invalid(self, reason: str) -> None:
            log.info("request refused: invalid HTTP (%s)", reason)
            self._refuse(400, _envelope_response(
                400, "Bad Request", "http_error", f"invalid HTTP request: {reason}"))

        def data_received(self, data: bytes) -> None:
            if self._lingering:
                return  # after the last response: read and dropped
            if self.transport.is_closing():
                return
            self._rx += len(data)
            if self._reading:
                self._hdr_bytes += len(data)  # a header trickled in over many reads
                if not self._any_bytes:
                    self._any_bytes = True
                    idle.pop(self, None)
                    self._sending(True)
                    self._arm()
            if not httptools:
                return super().data_received(data)
            import httptools as ht

            self._unset_keepalive_if_required()  # uvicorn's data_received, + the size check
            try:
                self.parser.feed_data(data)
            except ht.HttpParserError as exc:
                if isinstance(self._hdr_error, _HeadersTooBig):
                    return self._too_big()
                return self._invalid(str(exc) or "unparsable")
            except ht.HttpParserUpgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
                return
            if self._reading and self._hdr_bytes > max_header_bytes and \
                    not self.transport.is_closing() and not self._lingering:
                self._too_big()

        _hdr_error = None

        if httptools:
            def _count(self, n: int) -> None:  # the headers parsed within one read
                self._parsed += n
                if self._parsed > max_header_bytes:
                    self._hdr_error = _HeadersTooBig()
                    raise self._hdr_error

            def on_url(self, url: bytes) -> None:
                self._count(len(url))
                super().on_url(url)

            def on_header(self, name: bytes, value: bytes) -> None:
                self._count(len(name) + len(value) + 4)
                super().on_header(name, value)

            def on_message_begin(self) -> None:
                self._parsed = 0
                if not self._reading:  # the next request of a kept-alive connection
                    self._reading, self._hdr_bytes = True, 0
                idle.pop(self, None)
                self._any_bytes = True
                self._sending(True)
                self._arm()
                super().on_message_begin()

            def on_headers_complete(self) -> None:
                self._reading = False
                self._disarm()
                before = self.cycle
                super().on_headers_complete()
                if self.cycle is not before:  # a new request (not a websocket upgrade)
                    self._in_body = True
                    self._watch(self.cycle)
                    self._arm_body()

            def _watch(self, cycle) -> None:
                """A response that starts while the request's body is still arriving closes
                the connection after it: uvicorn then says ``connection: close``."""
                send = cycle.send

                async def guarded_send(message) -> None:
                    if not cycle.response_started and cycle.more_body:
                        cycle.keep_alive = False
                    await send(message)

                cycle.send = guarded_send
                cycle.transport = _CycleTransport(self)

            def on_message_complete(self) -> None:
                self._in_body = False
                self._sending(False)
                self._disarm_body()
                super().on_message_complete()
                cycle = self.cycle
                if cycle is not None and cycle.response_complete:
                    self._await_next()  # answered before its body ended, kept alive

            def on_response_complete(self) -> None:
                super().on_response_complete()
                if self._lingering:
                    self._unset_keepalive_if_required()  # the linger timer closes it
                elif not self._in_body:
                    self._await_next()

            def _await_next(self) -> None:
                """The request was read whole and answered: wait for the next one."""
                if not self.transport.is_closing() and not self._lingering and \
                        not self.pipeline:
                    self._reading, self._hdr_bytes, self._any_bytes = True, 0, False
                    idle[self] = 0.0  # uvicorn's keep-alive timer closes it in time

    return GuardedProtocol


class _CutStreamFilter(logging.Filter):
    """Drops uvicorn's error line for a response our middleware saw cut on purpose (the
    deadline, or the client gone: ``RESPONSE_CUT``); the encoding layer has logged the one
    warning (or info) line for it."""

    MESSAGE = "ASGI callable returned without completing response."

    def filter(self, record: logging.LogRecord) -> bool:
        from .ops.middlewares import RESPONSE_CUT

        return not (record.msg == self.MESSAGE and RESPONSE_CUT.get())


def uvicorn_config(app, settings) -> "Any":
    """The uvicorn.Config for ``app`` with every limit taken from ``settings``."""
    import uvicorn

    from .logs import logging_config

    soft = raise_fd_limit()
    max_conn = settings.max_connections
    if max_conn + FD_RESERVE > soft:
        raise ValueError(f"max_connections={max_conn} needs {max_conn + FD_RESERVE} file "
                         f"descriptors; the process may open {soft} (ulimit -n)")
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, workers=1,
        log_level=settings.log_level, log_config=logging_config(settings.log_level,
                                                                settings.log_format),
        access_log=False,
        timeout_graceful_shutdown=int(max(1, round(getattr(settings, "shutdown_grace_s", 30)))),
        http=guarded_protocol(max_conn, settings.header_timeout_s, settings.max_header_bytes,
                              settings.body_timeout_s,
                              getattr(settings, "max_client_connections", 0),
                              getattr(settings, "slow_sender_s", 0.25)),
        limit_concurrency=max_conn + 64,  # evicted ones count until their close completes
        timeout_keep_alive=max(1, int(round(settings.keep_alive_timeout_s))),
        h11_max_incomplete_event_size=settings.max_header_bytes,
        backlog=2048,  # accept at once: the guard, not the kernel queue, sheds the excess
    )
    error_log = logging.getLogger("uvicorn.error")  # configured by uvicorn.Config above
    if not any(isinstance(f, _CutStreamFilter) for f in error_log.filters):
        error_log.addFilter(_CutStreamFilter())
    return config


class DrainingServer:
    """uvicorn's Server, draining the app on shutdown (SIGTERM / SIGINT): from the first
    moment new requests get 503 ``shutting_down`` in the envelope (``Connection: close``,
    ``Retry-After``) and ``/readyz`` says 503; requests in flight may finish; at the end of
    the grace period (``timeout_graceful_shutdown`` less :data:`DRAIN_MARGIN_S`) the jobs
    still running are cancelled (service/serving/core/cancel.py) and their clients get the
    same 503 envelope instead of uvicorn's plain-text 500 when it cancels their tasks."""

    def __new__(cls, config, app):
        import uvicorn

        class _Server(uvicorn.Server):
            async def shutdown(self, sockets=None):
                state = getattr(app, "state", None)
                if state is not None:
                    state.draining = True
                    loop = asyncio.get_running_loop()
                    grace = float(self.config.timeout_graceful_shutdown or 0)
                    engine = getattr(state, "engine", None)
                    if engine is not None:
                        def stop_jobs():
                            n = engine.cancel_all()
                            if n:
                                log.warning("drain: %d job(s) still running at the end of the "
                                            "grace period were stopped (503 to their clients)",
                                            n)
                        loop.call_later(max(0.0, grace - DRAIN_MARGIN_S), stop_jobs)
                await super().shutdown(sockets)

        return _Server(config)


DRAIN_MARGIN_S = 2.0
"""Seconds before uvicorn's graceful-shutdown timeout at which running jobs are cancelled, so
their 503 is sent before uvicorn cancels their tasks."""


async def health_listener(app, host: str, port: int, max_connections: int = 64):
    """A small HTTP/1.x listener of its own for ``/healthz`` and ``/readyz`` (``health_port``),
    so that probes are answered while the main listener is saturated (every connection slot
    held by slow clients): one request per connection, a 2 s read limit, at most
    ``max_connections`` at once (503 beyond). ``/healthz``: 200 while the process serves;
    ``/readyz``: 200 once the model is loaded, 503 while loading, after a failed load, or
    while draining. Returns the ``asyncio.Server``."""
    from .encoding import dumps
    from .errors import envelope

    open_now = [0]

    def answer(path: str) -> tuple[int, bytes]:
        state = app.state
        if path == "/healthz":
            return 200, dumps({"status": "ok"})
        if path == "/readyz":
            rt = getattr(state, "runtime", None)
            if getattr(state, "draining", False):
                return 503, dumps(envelope("shutting_down", "the service is shutting down"))
            if rt is None:
                err = getattr(state, "load_error", None)
                return 503, dumps(envelope("not_ready", f"model failed to load: {err}" if err
                                           else "model is loading"))
            return 200, dumps({"status": "ready", "model": rt.info["id"]})
        return 404, dumps(envelope("not_found", f"{path} is not served here: this listener "
                                   "answers /healthz and /readyz only"))

    reasons = {200: "OK", 404: "Not Found", 503: "Service Unavailable", 400: "Bad Request"}

    async def handle(reader, writer):
        open_now[0] += 1
        try:
            if open_now[0] > max_connections:
                status, body = 503, dumps(envelope("overloaded", "too many probe connections"))
            else:
                try:
                    line = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2.0)
                    parts = line.split(b" ", 2)
                    path = parts[1].decode("latin-1").split("?")[0] if len(parts) > 1 else ""
                    status, body = answer(path)
                except (asyncio.TimeoutError, asyncio.IncompleteReadError,
                        asyncio.LimitOverrunError, ConnectionError):
                    status, body = 400, dumps(envelope("http_error", "incomplete request"))
            writer.write(f"HTTP/1.1 {status} {reasons[status]}\r\ncontent-type: "
                         f"application/json\r\ncontent-length: {len(body)}\r\n"
                         "connection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            open_now[0] -= 1
            writer.close()

    return await asyncio.start_server(handle, host, port, limit=8192, backlog=256)


async def serve_async(server, app, settings) -> None:
    """Run ``server`` (a :class:`DrainingServer`) on the running loop until it exits, with the
    probes' own listener (:func:`health_listener`) on ``settings.health_port`` when set."""
    port = int(getattr(settings, "health_port", 0) or 0)
    probes = await health_listener(app, settings.host, port) if port else None
    try:
        await server.serve()
    finally:
        if probes is not None:
            probes.close()


def serve(app, settings) -> None:
    """Run ``app`` under uvicorn with our limits until stopped (SIGINT/SIGTERM), draining on
    shutdown (:class:`DrainingServer`); with ``health_port`` the probes' own listener too."""
    from uvicorn._compat import asyncio_run

    config = uvicorn_config(app, settings)
    asyncio_run(serve_async(DrainingServer(config, app), app, settings),
                loop_factory=config.get_loop_factory())
