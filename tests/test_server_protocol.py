"""The HTTP protocol under attack (issue 17, "Bounded cost"; service/server.py ``GuardedProtocol``)
against a real uvicorn on 127.0.0.1 (in a thread, around the already loaded bundled runtime),
spoken to on raw sockets:

* one response per request: a response that starts while the request's body is still arriving
  (401 before the body is read, 413 from Content-Length, 504 during a slow body) says
  ``connection: close``; what the client still sends (the rest of the body, a pipelined
  request) is never parsed, so never answered with a stray 431 or 408; the client sees the
  response, then EOF (no reset), and its next request, on a new connection, is served;
* a body slower than ``body_timeout_s`` gets 408 (envelope) and the connection is closed;
* malformed HTTP gets 400 with the error envelope;
* the access log and ``attnscope_requests_total`` record an aborted upload as 499 and a
  malformed body as 400, not 500.
"""

from __future__ import annotations

import json
import re
import select
import socket
import threading
import time

import httpx
import pytest

from conftest import free_port, restore_loggers, save_loggers

pytestmark = pytest.mark.e2e

KEY = "k1"
AUTH = f"Authorization: Bearer {KEY}\r\n"




class Served:
    """``attnscope serve``'s uvicorn (service/server.py ``uvicorn_config``) in a thread."""

    def __init__(self, runtime, **settings):
        import uvicorn

        from attnscope.service.app import create_app
        from attnscope.service.config import Settings
        from attnscope.service.server import uvicorn_config

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.settings = Settings(model="bundled", port=self.port, api_keys=[KEY], **settings)
        # uvicorn applies our dictConfig to this (the test) process: put the loggers back
        self._saved = save_loggers()
        self.app = create_app(self.settings, runtime=runtime)
        self.server = uvicorn.Server(uvicorn_config(self.app, self.settings))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.server.started

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        restore_loggers(self._saved)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=30)

    def in_flight(self) -> float:
        """``attnscope_requests_in_flight`` (this /metrics request included)."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return float(re.search(r"^attnscope_requests_in_flight (\S+)$", text, re.M).group(1))

    def wait_in_flight(self, above: float, fewer: bool = False, bound_s: float = 60.0) -> None:
        """Wait until more than ``above`` requests are in flight (one sent since has reached
        the app), or with ``fewer`` until no more are (it has ended); the bound is for the
        event, not a figure."""
        deadline = time.monotonic() + bound_s
        while (self.in_flight() > above) if fewer else (self.in_flight() <= above):
            assert time.monotonic() < deadline, f"in flight: still {self.in_flight()}"
            time.sleep(0.02)

    def requests_total(self) -> dict[tuple[str, str, str], float]:
        """``attnscope_requests_total`` by (method, route, status), from /metrics."""
        out = {}
        text = httpx.get(self.url + "/metrics", timeout=30).text
        for m in re.finditer(r'^attnscope_requests_total\{([^}]*)\} (\S+)$', text, re.M):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            out[(labels["method"], labels["route"], labels["status"])] = float(m.group(2))
        return out


@pytest.fixture(scope="module")
def served(gpt2_runtime):
    s = Served(gpt2_runtime, header_timeout_s=2.0, body_timeout_s=1.5, request_timeout_s=60.0)
    yield s
    s.close()


def read_to_end(sock: socket.socket, bound_s: float = 60.0) -> tuple[bytes, str]:
    """Everything the server sends until it closes: (bytes, 'eof' | 'reset' | 'open': still
    open after ``bound_s``, a bound for the event, not a figure)."""
    got = b""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        r, _, _ = select.select([sock], [], [], 0.1)
        if not r:
            continue
        try:
            data = sock.recv(1 << 16)
        except ConnectionResetError:
            return got, "reset"
        if not data:
            return got, "eof"
        got += data
    return got, "open"


def responses(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The HTTP/1.1 responses in ``raw`` (each with a content-length): status, headers, body."""
    out = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        assert sep, raw[:200]
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        n = int(headers.get("content-length", "0"))
        out.append((status, headers, rest[:n]))
        raw = rest[n:]
    return out


def one_response(raw: bytes, status: int) -> tuple[dict[str, str], dict]:
    """The only response in ``raw``: ``status`` with the error envelope; (headers, error)."""
    got = responses(raw)
    assert [r[0] for r in got] == [status], [(r[0], r[2][:120]) for r in got]
    headers, body = got[0][1], got[0][2]
    assert headers["content-type"] == "application/json", headers
    err = json.loads(body)["error"]
    assert set(err) == {"type", "message", "param"}, err
    return headers, err


def post_head(path: str, length: int | None, extra: str = "", chunked: bool = False) -> bytes:
    framing = "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {length}\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
            f"{framing}\r\n").encode()


def body_of(n: int) -> bytes:
    """A valid /v1/attention body of ``n`` bytes (JSON whitespace ahead of it)."""
    core = b'{"text": "hello world"}'
    return b" " * (n - len(core)) + core


# ------------------------------------------------------------- one response per request
@pytest.mark.regression
def test_401_before_the_body_then_a_pipelined_request_gets_one_response(served):
    """The tester's case: the headers of a 200 KB POST without the API key, the 401, then the
    body and a pipelined GET on the same socket. Before: the body was counted as header bytes
    after the 401, so a stray 431 followed (and a reset)."""
    body = body_of(200_000)
    with served.connect() as s:
        s.sendall(post_head("/v1/attention", len(body)))
        first = b""
        while b"\r\n\r\n" not in first or not first.rstrip().endswith(b"}"):
            data = s.recv(1 << 16)
            assert data, first
            first += data
        try:
            s.sendall(body + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may have stopped reading: it owes no answer to these bytes
        rest, end = read_to_end(s)
    headers, err = one_response(first + rest, 401)
    assert err["type"] == "unauthorized" and headers["connection"] == "close"
    assert end == "eof", end
    r = httpx.get(served.url + "/healthz", timeout=30)
    assert r.status_code == 200


@pytest.mark.regression
def test_keep_alive_client_after_an_early_401_is_served(served):
    """httpx keeps connections alive: after the 401 to a 1 MB body its next request went out
    on the same connection and got the stray 431 (the rest of the body counted as headers). Now the 401 closes the connection, so
    the next request goes on a new one."""
    with httpx.Client(base_url=served.url, timeout=30) as c:
        r = c.post("/v1/attention", content=body_of(1_000_000),
                   headers={"content-type": "application/json"})
        assert r.status_code == 401
        closed = r.headers.get("connection")
        for _ in range(3):
            r = c.post("/v1/attention", json={"text": "hello world", "layers": [0]},
                       headers={"authorization": f"Bearer {KEY}"})
            assert r.status_code == 200, r.text
    assert closed == "close"


@pytest.mark.regression
def test_413_from_content_length_is_the_only_response(served):
    """A Content-Length over max_body_bytes: 413 at once, connection: close, then EOF; the
    body the client goes on sending is never parsed (no second response)."""
    n = served.settings.max_body_bytes + 1_000_000
    with served.connect() as s:
        s.sendall(post_head("/v1/attention", n, AUTH))
        sent = 0
        chunk = b" " * 65536
        try:
            while sent < 2_000_000:
                s.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        raw, end = read_to_end(s)
    headers, err = one_response(raw, 413)
    assert err["type"] == "payload_too_large" and headers["connection"] == "close"
    assert end == "eof", end


@pytest.mark.regression
def test_504_during_a_slow_body_is_the_only_response(gpt2_runtime):
    """request_timeout_s passes while the body trickles in: 504. Before: the body still
    arriving after it armed the header timer, and a stray 408 followed on the connection.
    (body_timeout_s off here, so the request timeout is what fires.)"""
    srv = Served(gpt2_runtime, request_timeout_s=1.0, header_timeout_s=1.0, body_timeout_s=0)
    try:
        with srv.connect() as s:
            body = body_of(400)
            s.sendall(post_head("/v1/attention", len(body), AUTH) + body[:10])
            got = b""
            while b"\r\n\r\n" not in got:  # the 504
                data = s.recv(1 << 16)
                assert data, got
                got += data
            for i in range(10, 40):  # trickle on, past header_timeout_s
                try:
                    s.sendall(body[i:i + 1])
                except (BrokenPipeError, ConnectionResetError):
                    break
                time.sleep(0.1)
            try:
                s.sendall(body[40:] + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            rest, end = read_to_end(s)
        headers, err = one_response(got + rest, 504)
        assert err["type"] == "timeout" and headers["connection"] == "close"
        assert end == "eof", end
    finally:
        srv.close()


def test_a_body_read_whole_keeps_the_connection_alive(served):
    """The normal case is unchanged: a 100 KB body read by its handler, then two more requests
    on the same connection (body bytes never count against max_header_bytes)."""
    body = body_of(100_000)
    with served.connect() as s:
        s.sendall(post_head("/v1/attention", len(body), AUTH) + body)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        s.sendall(post_head("/v1/tokenize", len(body), AUTH) + body)
        raw = b""
        while len(responses_or_none(raw)) < 3:
            data = s.recv(1 << 16)
            assert data, raw[-300:]
            raw += data
    assert [r[0] for r in responses(raw)] == [200, 200, 200]
    assert all("connection" not in r[1] for r in responses(raw))


def responses_or_none(raw: bytes) -> list:
    try:
        return responses(raw) if raw.endswith((b"}", b"]")) else []
    except (AssertionError, ValueError, IndexError):
        return []


# ------------------------------------------------------------------- body timeout
def test_a_body_slower_than_body_timeout_gets_408_and_is_closed(served):
    """One byte every 0.2 s of a 1,000-byte body: 408 (envelope naming body_timeout_s) once
    body_timeout_s (1.5 s) has passed since the headers, then EOF; the request is recorded as
    408. Without the timeout it would hold its connection until request_timeout_s (60 s)."""
    before = served.requests_total()
    body = body_of(1000)
    with served.connect() as s:
        s.sendall(post_head("/v1/attention", len(body), AUTH))
        got, sent = b"", 0
        deadline = time.monotonic() + 60  # a bound for the event, not a figure
        while time.monotonic() < deadline:
            r, _, _ = select.select([s], [], [], 0.2)
            if r:
                data = s.recv(1 << 16)
                if not data:
                    break
                got += data
                continue
            try:
                s.sendall(body[sent:sent + 1])
                sent += 1
            except (BrokenPipeError, ConnectionResetError):
                break
        headers, err = one_response(got, 408)
    assert err["type"] == "timeout" and "body_timeout_s" in err["message"], err
    assert headers["connection"] == "close"
    assert sent < len(body)
    after = served.requests_total()
    key = ("POST", "/v1/attention", "408")
    assert after.get(key, 0) == before.get(key, 0) + 1, (before, after)
    assert httpx.get(served.url + "/healthz", timeout=30).status_code == 200


# --------------------------------------------------------------------- malformed HTTP
MALFORMED = {
    "duplicate content-length": b"POST /v1/attention HTTP/1.1\r\nHost: x\r\nContent-Length: 2"
                                b"\r\nContent-Length: 3\r\n\r\n{}",
    "bad content-length": b"POST /v1/attention HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n",
    "content-length and transfer-encoding": b"POST /v1/attention HTTP/1.1\r\nHost: x\r\n"
        b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "control character in a header": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\x01b\r\n\r\n",
    "unknown method": b"FROB /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
    "bad chunk size": b"POST /v1/attention HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                      b"\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
}


@pytest.mark.regression
@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_http_gets_400_with_the_envelope(served, name):
    """uvicorn answered these with a plain-text '400 Invalid HTTP request received.'."""
    with served.connect() as s:
        s.sendall(MALFORMED[name])
        raw, end = read_to_end(s)
    headers, err = one_response(raw, 400)
    assert err["type"] == "http_error" and err["message"].startswith("invalid HTTP request: ")
    assert headers["connection"] == "close" and end == "eof"


# ------------------------------------------------ what the access log and metrics record
@pytest.mark.regression
def test_an_aborted_upload_is_recorded_as_499_and_a_bad_chunk_as_400(served):
    """A client that sends part of a body and goes away, and a chunked body with a bad chunk
    after a good one: both were recorded as status 500 (the handler ended without a response)."""
    key = {s: ("POST", "/v1/attention", s) for s in ("499", "400", "500")}
    before = served.requests_total()
    idle = served.in_flight()
    with served.connect() as s:
        s.sendall(post_head("/v1/attention", 100_000, AUTH) + b" " * 1000)
        served.wait_in_flight(idle)  # the app has it and reads the body
    served.wait_in_flight(idle, fewer=True)  # and it is over
    with served.connect() as s:
        s.sendall(post_head("/v1/attention", None, AUTH, chunked=True) + b"5\r\n{\"tex\r\n")
        served.wait_in_flight(idle)
        s.sendall(b"zz\r\n")
        raw, end = read_to_end(s)
    deadline = time.monotonic() + 60  # a bound for the event, not a figure
    while time.monotonic() < deadline:
        after = served.requests_total()
        if sum(after.get(k, 0) - before.get(k, 0) for k in key.values()) >= 2:
            break
        time.sleep(0.1)
    assert after.get(key["500"], 0) == before.get(key["500"], 0), after
    assert after.get(key["499"], 0) == before.get(key["499"], 0) + 1, after
    assert after.get(key["400"], 0) == before.get(key["400"], 0) + 1, after
    _, err = one_response(raw, 400)
    assert "chunk" in err["message"], err
