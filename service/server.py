"""The HTTP server: uvicorn with limits set by us (issue 17, "Connections"), not its defaults.

uvicorn by itself holds an idle TCP connection forever (its keep-alive timer starts only
after a first response), holds a client that trickles its headers one byte at a time forever,
and with httptools accepts headers of any size (h11's 16 KiB bound does not apply to it):
21,000 idle connections exhausted the process's file descriptors (every new client failed for
~20 s) and one 100 MB header cost +230 MB. :func:`guarded_protocol` wraps uvicorn's httptools
protocol (h11 where httptools is missing) with:

* a connection limit (``Settings.max_connections``): a connection beyond it first evicts the
  connection idle the longest (no request in flight: fresh and silent, or kept alive after a
  response), so a flood of idle sockets never locks out a real client; when none is idle the
  newcomer gets ``503`` (envelope type ``overloaded``, ``Retry-After: 1``) and is closed at once;
* a header-read timeout (``Settings.header_timeout_s``): from the connection's start, or a
  request's first byte, to the end of its headers; past it ``408`` and close;
* a header size limit (``Settings.max_header_bytes``): request line + headers beyond it get
  ``431`` and close, before the headers are parsed further;
* uvicorn's own ``timeout_keep_alive`` (``Settings.keep_alive_timeout_s``) and
  ``limit_concurrency`` (a backstop a little above max_connections: uvicorn answers 503 to
  requests beyond it) and h11's ``h11_max_incomplete_event_size`` (= max_header_bytes).

The process's soft file-descriptor limit is raised to its hard limit at start-up, and
``max_connections`` must leave room under it (checked; the model's files, the device thread,
and the logs need some).
"""

from __future__ import annotations

import logging
import os
import resource
from typing import Any

log = logging.getLogger("attnscope.server")

FD_RESERVE = 256  # descriptors kept for everything but client connections


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
    from attnscope.service.encoding import dumps
    from attnscope.service.errors import envelope

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


def guarded_protocol(max_connections: int, header_timeout_s: float, max_header_bytes: int):
    """A uvicorn HTTP protocol class enforcing the limits of the module docstring."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
        httptools = True
    except ImportError:  # pragma: no cover - uvicorn[standard] brings httptools
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base
        httptools = False

    idle: dict[Any, None] = {}  # connections with no request in flight, oldest first

    class GuardedProtocol(Base):
        LIMITS = {"max_connections": max_connections, "header_timeout_s": header_timeout_s,
                  "max_header_bytes": max_header_bytes}

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._hdr_timer = None
            self._hdr_bytes = 0
            self._reading = True
            self._any_bytes = False
            if len(self.connections) > max_connections:
                victim = next(iter(idle), None)
                if victim is not None:
                    idle.pop(victim, None)
                    victim._drop()
                else:
                    log.warning("connection refused: %d connections open (max_connections)",
                                len(self.connections) - 1)
                    transport.write(_envelope_response(
                        503, "Service Unavailable", "overloaded",
                        f"too many connections (max_connections={max_connections}); retry "
                        "shortly", b"retry-after: 1\r\n"))
                    transport.close()
                    self.connections.discard(self)
                    return
            idle[self] = None
            self._arm()

        def _drop(self) -> None:
            self._disarm()
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

        def _header_timeout(self) -> None:
            self._hdr_timer = None
            if not self._reading or self.transport.is_closing():
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
            else:  # a request began and its headers never ended
                log.info("connection dropped: headers not complete after %.3g s "
                         "(header_timeout_s)", header_timeout_s)
                self.transport.write(_envelope_response(
                    408, "Request Timeout", "timeout",
                    f"the request's headers took longer than {header_timeout_s:g} s "
                    "(header_timeout_s)"))
            self.transport.close()

        def connection_lost(self, exc) -> None:
            idle.pop(self, None)
            self._disarm()
            super().connection_lost(exc)

        def _too_big(self) -> None:
            log.info("request refused: headers over %d bytes (max_header_bytes)",
                     max_header_bytes)
            self._disarm()
            idle.pop(self, None)
            self.transport.write(_envelope_response(
                431, "Request Header Fields Too Large", "payload_too_large",
                f"the request line and headers exceed {max_header_bytes} bytes "
                "(max_header_bytes)"))
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return
            if self._reading:
                self._hdr_bytes += len(data)  # a header trickled in over many reads
                if not self._any_bytes:
                    self._any_bytes = True
                    idle.pop(self, None)
                    self._arm()
            if not httptools:
                return super().data_received(data)
            import httptools as ht

            self._unset_keepalive_if_required()  # uvicorn's data_received, + the size check
            try:
                self.parser.feed_data(data)
            except ht.HttpParserError:
                if isinstance(self._hdr_error, _HeadersTooBig):
                    return self._too_big()
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self.send_400_response(msg)
                return
            except ht.HttpParserUpgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
                return
            if self._reading and self._hdr_bytes > max_header_bytes and \
                    not self.transport.is_closing():
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
                self._arm()
                super().on_message_begin()

            def on_headers_complete(self) -> None:
                self._reading = False
                self._disarm()
                super().on_headers_complete()

            def on_response_complete(self) -> None:
                super().on_response_complete()
                if not self.transport.is_closing() and not self.pipeline:
                    self._reading, self._hdr_bytes, self._any_bytes = True, 0, False
                    idle[self] = None  # uvicorn's keep-alive timer closes it in time

    return GuardedProtocol


def uvicorn_config(app, settings) -> "Any":
    """The uvicorn.Config for ``app`` with every limit taken from ``settings``."""
    import uvicorn

    from attnscope.service.logs import logging_config

    soft = raise_fd_limit()
    max_conn = settings.max_connections
    if max_conn + FD_RESERVE > soft:
        raise ValueError(f"max_connections={max_conn} needs {max_conn + FD_RESERVE} file "
                         f"descriptors; the process may open {soft} (ulimit -n)")
    return uvicorn.Config(
        app, host=settings.host, port=settings.port, workers=1,
        log_level=settings.log_level, log_config=logging_config(settings.log_level,
                                                                settings.log_format),
        access_log=False, timeout_graceful_shutdown=30,
        http=guarded_protocol(max_conn, settings.header_timeout_s, settings.max_header_bytes),
        limit_concurrency=max_conn + 8,
        timeout_keep_alive=max(1, int(round(settings.keep_alive_timeout_s))),
        h11_max_incomplete_event_size=settings.max_header_bytes,
        backlog=2048,  # accept at once: the guard, not the kernel queue, sheds the excess
    )


def serve(app, settings) -> None:
    """Run ``app`` under uvicorn with our limits until stopped (SIGINT/SIGTERM)."""
    import uvicorn

    uvicorn.Server(uvicorn_config(app, settings)).run()
