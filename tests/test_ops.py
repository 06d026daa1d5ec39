"""Operations: API keys, request ids and JSON logs, /metrics, CORS, time limit, graceful shutdown,
start-up-only model choice — in process and through a real uvicorn on 127.0.0.1."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from attnscope.service.config import Settings

from conftest import SENTENCE, start_server, stop_server

KEYS = "k-one-0123456789,k-two-abcdefghij"


def _metrics(text: str) -> dict:
    """{(sample name, frozenset(labels)): value} from the Prometheus text format."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _sample(m: dict, name: str, **labels) -> float:
    return m.get((name, frozenset(labels.items())), 0.0)


def _long_body(n: int = 16) -> dict:
    tag = uuid.uuid4().hex  # never in the cache
    return {"texts": [" ".join(["light"] * 200) + f" {tag} {i}" for i in range(n)],
            "include_scores": True, "encoding": "base64"}


# ------------------------------------------------------------------- through a real uvicorn
@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("keyed"), "--model", "bundled",
                     env={"ATTNSCOPE_API_KEYS": KEYS, "ATTNSCOPE_LOG_FORMAT": "json"})
    yield s
    stop_server(s)


def test_keys_required_on_api_and_health_open(keyed_server):
    with httpx.Client(base_url=keyed_server.url, timeout=30) as c:
        for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
            assert c.get(path).status_code == 200, path
        r = c.post("/v1/attention", json={"text": SENTENCE})
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "unauthorized"
        assert "Authorization: Bearer" in r.json()["error"]["message"]
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert c.get("/v1/model").status_code == 401
        m = _metrics(c.get("/metrics").text)  # refused before routing, counted by route
        assert _sample(m, "attnscope_requests_total", method="GET", route="/v1/model",
                       status="401") == 1
        for header in ("Bearer wrong-key", "Bearer k-one-012345678", "Basic k-one-0123456789",
                       "k-one-0123456789", "Bearer"):
            r = c.post("/v1/attention", json={"text": SENTENCE}, headers={"Authorization": header})
            assert r.status_code == 401, header
            assert r.json()["error"]["type"] == "unauthorized"
            assert 'error="invalid_token"' in r.headers["www-authenticate"]
        for key in KEYS.split(","):
            h = {"Authorization": f"Bearer {key}"}
            r = c.post("/v1/attention", json={"text": SENTENCE, "layers": [0]}, headers=h)
            assert r.status_code == 200, r.text
            assert r.json()["attention"]["layers"] == [0]
            assert c.get("/v1/model", headers=h).status_code == 200
        # 4xx after auth still use the envelope
        r = c.post("/v1/attention", json={"text": "x", "layers": [9]},
                   headers={"Authorization": "bearer k-two-abcdefghij"})
        assert r.status_code == 422 and r.json()["error"]["type"] == "out_of_range"


def test_request_id_echoed_and_json_logs(keyed_server):
    h = {"Authorization": "Bearer k-one-0123456789"}
    rid = f"trace-{uuid.uuid4().hex[:12]}"
    with httpx.Client(base_url=keyed_server.url, timeout=30) as c:
        r = c.post("/v1/tokenize", json={"text": SENTENCE}, headers={**h, "X-Request-ID": rid})
        assert r.status_code == 200 and r.headers["x-request-id"] == rid
        bad = c.get("/healthz", headers={"X-Request-ID": "x" * 300})
        gen = bad.headers["x-request-id"]
        assert gen != "x" * 300 and len(gen) == 32 and int(gen, 16) >= 0
        assert c.get("/healthz").headers["x-request-id"] != gen
        r401 = c.post("/v1/tokenize", json={"text": "x"}, headers={"X-Request-ID": rid + "-b"})
        assert r401.status_code == 401 and r401.headers["x-request-id"] == rid + "-b"
    deadline = time.time() + 10
    while time.time() < deadline:
        lines = [json.loads(x) for x in keyed_server.log.read_text().splitlines()
                 if x.startswith("{")]
        mine = [x for x in lines if x.get("request_id") == rid and x.get("msg") == "request"]
        if mine:
            break
        time.sleep(0.2)
    assert mine, keyed_server.log.read_text()[-2000:]
    assert mine[0]["status"] == 200 and mine[0]["route"] == "/v1/tokenize"
    assert mine[0]["method"] == "POST" and mine[0]["duration_ms"] >= 0
    assert {"ts", "level", "logger"} <= set(mine[0])
    # uvicorn's own lines are JSON too, and no key ever reaches the log
    text = keyed_server.log.read_text()
    assert any(x.get("logger", "").startswith("uvicorn") for x in lines)
    assert "k-one-0123456789" not in text and "k-two-abcdefghij" not in text
    # and every line is a JSON object (no progress bar of the model load in between)
    stray = [x for x in text.splitlines() if x.strip() and not x.startswith("{")]
    assert not stray, stray[:5]


def test_text_log_format_keeps_the_access_fields():
    import logging

    from attnscope.service.logs import TextFormatter

    rec = logging.LogRecord("attnscope.access", logging.INFO, __file__, 1, "request", None, None)
    rec.fields = {"method": "POST", "path": "/v1/heads", "status": 422, "duration_ms": 1.5}
    line = TextFormatter().format(rec)
    assert line.endswith("request method=POST path=/v1/heads status=422 duration_ms=1.5"), line
    assert "attnscope.access [-]:" in line


def test_healthcheck_module(keyed_server):
    cmd = [sys.executable, "-m", "attnscope.service.healthcheck"]
    assert subprocess.run(cmd + [keyed_server.url + "/readyz"], timeout=30).returncode == 0
    assert subprocess.run(cmd + ["http://127.0.0.1:9/readyz"], timeout=30,
                          capture_output=True).returncode == 1


def test_graceful_shutdown_finishes_in_flight_request(tmp_path):
    """SIGTERM while a request holds the device (held there by the test's gate until the
    signal is sent, so it is in flight on any hardware): it is answered, then the server ends."""
    hold = tmp_path / "hold"
    s = start_server(tmp_path, "--model", "bundled", hold=hold)
    result: dict = {}

    def call():
        try:
            r = httpx.post(s.url + "/v1/attention", json=_long_body(8), timeout=120)
            result["status"] = r.status_code
            result["n"] = len(r.json()["results"])
        except Exception as exc:  # noqa: BLE001 - reported below
            result["error"] = repr(exc)

    th = threading.Thread(target=call)
    try:
        hold.touch()
        th.start()
        deadline = time.time() + 120  # a safety net, not a figure
        while time.time() < deadline:  # wait until the request holds the device
            m = _metrics(httpx.get(s.url + "/metrics", timeout=30).text)
            if _sample(m, "attnscope_queue_depth") >= 1:
                break
            time.sleep(0.02)
        else:
            pytest.fail("the long request never reached the device")
        s.proc.send_signal(signal.SIGTERM)
        hold.unlink()
        th.join(timeout=90)
        assert result.get("status") == 200, result
        assert result["n"] == 8
        # uvicorn re-raises SIGTERM after its graceful shutdown: exit by the signal (or 0)
        assert s.proc.wait(timeout=40) in (0, -signal.SIGTERM)
        log = s.log.read_text()
        assert "Shutting down" in log or "shutdown" in log.lower()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


def test_timeout_through_uvicorn(tmp_path):
    """504 at the deadline on a real server; the abandoned forward ends; the same keep-alive
    connection and the device slot serve the next request. The device is held by the test's
    gate (tests/lag_serve.py) until the 504 is in: the work cannot finish first on any
    hardware."""
    hold = tmp_path / "hold"
    s = start_server(tmp_path, "--model", "bundled", "--request-timeout-s", "0.05", hold=hold)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            body = {**_long_body(32), "encoding": "json"}
            hold.touch()
            r = c.post("/v1/attention", json=body, headers={"X-Request-ID": "slow-1"})
            assert r.status_code == 504 and r.json()["error"]["type"] == "timeout", r.text[:300]
            assert r.headers["x-request-id"] == "slow-1"
            # answered at the deadline, not when the forward ended: the work is still held
            m = _metrics(c.get("/metrics").text)
            assert _sample(m, "attnscope_abandoned_requests") == 1
            hold.unlink()
            deadline = time.time() + 120  # a safety net, not a figure
            while time.time() < deadline:
                m = _metrics(c.get("/metrics").text)
                if _sample(m, "attnscope_abandoned_requests") == 0 and \
                        _sample(m, "attnscope_queue_depth") == 0:
                    break
                time.sleep(0.1)
            assert _sample(m, "attnscope_abandoned_requests") == 0
            assert _sample(m, "attnscope_requests_total", method="POST", route="/v1/attention",
                           status="504") == 1
            # the next request reaches the device slot and is answered: 200, or (on a busy
            # machine even a 2-token forward can pass 50 ms, and since issue 29 a job is
            # stopped at its deadline, so nothing it began is cached for a retry) a 504 whose
            # job was stopped, after which the slot is free again: never wedged
            for _ in range(10):
                r = c.post("/v1/attention", json={"text": "hi", "layers": [0]})
                if r.status_code != 504:
                    break
            assert r.status_code in (200, 504), r.text
            deadline = time.time() + 120  # a safety net, not a figure
            while time.time() < deadline:
                m = _metrics(c.get("/metrics").text)
                if _sample(m, "attnscope_abandoned_requests") == 0 and \
                        _sample(m, "attnscope_queue_depth") == 0:
                    break
                time.sleep(0.1)
            assert _sample(m, "attnscope_queue_depth") == 0
        assert s.proc.poll() is None
    finally:
        stop_server(s)


# ------------------------------------------------------------------------------ in process
def test_metrics_parse_and_counters_move(make_client, gpt2_runtime):
    c = make_client(gpt2_runtime)
    before = _metrics(c.get("/metrics").text)
    text = f"Metrics test {uuid.uuid4().hex}: the cat sat on the mat."
    assert c.post("/v1/attention", json={"text": text}).status_code == 200
    assert c.post("/v1/attention", json={"text": text}).status_code == 200  # cache hit
    assert c.post("/v1/attention", json={"text": "  "}).status_code == 422
    assert c.get("/no/such/path").status_code == 404
    r = c.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    after = _metrics(r.text)
    route = dict(method="POST", route="/v1/attention")
    d = lambda name, **lab: _sample(after, name, **lab) - _sample(before, name, **lab)  # noqa: E731
    assert d("attnscope_requests_total", **route, status="200") == 2
    assert d("attnscope_requests_total", **route, status="422") == 1
    assert d("attnscope_requests_total", method="GET", route="unmatched", status="404") == 1
    assert d("attnscope_request_duration_seconds_count", **route) == 3
    assert d("attnscope_request_duration_seconds_sum", **route) > 0
    assert d("attnscope_cache_misses_total") >= 1 and d("attnscope_cache_hits_total") >= 1
    assert d("attnscope_forwards_total") >= 1
    # one forward; the cache hit is answered without waiting for the device slot
    assert d("attnscope_forward_seconds_count") == 1 and d("attnscope_queue_wait_seconds_count") == 1
    assert _sample(after, "attnscope_queue_depth") == 0
    assert _sample(after, "attnscope_cache_bytes") > 0 and _sample(after, "attnscope_ready") == 1
    info = [k for k in after if k[0] == "attnscope_model_info"]
    assert len(info) == 1 and ("id", gpt2_runtime.info["id"]) in info[0][1]
    assert ("n_layers", "2") in info[0][1]
    assert _sample(after, "process_resident_memory_bytes") > 0


def test_no_keys_by_default_and_no_cors_by_default(client):
    r = client.post("/v1/tokenize", json={"text": "hi"}, headers={"Origin": "https://evil.example"})
    assert r.status_code == 200
    assert "access-control-allow-origin" not in r.headers


def test_cors_allow_list(make_client, gpt2_runtime):
    c = make_client(gpt2_runtime, cors_origins="https://lab.example", api_keys="secret-key-1")
    pre = c.options("/v1/attention", headers={
        "Origin": "https://lab.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200  # preflight answers without a key
    assert pre.headers["access-control-allow-origin"] == "https://lab.example"
    bad = c.options("/v1/attention", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert bad.headers.get("access-control-allow-origin") != "https://evil.example"
    r = c.post("/v1/tokenize", json={"text": "hi"}, headers={"Origin": "https://lab.example"})
    assert r.status_code == 401  # keys still apply, and the browser may read the 401
    assert r.headers["access-control-allow-origin"] == "https://lab.example"
    r = c.post("/v1/tokenize", json={"text": "hi"},
               headers={"Origin": "https://lab.example", "Authorization": "Bearer secret-key-1"})
    assert r.status_code == 200 and "x-request-id" in r.headers["access-control-expose-headers"].lower()


def test_timeout_gives_504_and_does_not_wedge_the_slot(gpt2_runtime):
    """The device is held (a job on the slot waiting for an event) until the 504 has been
    sent: the request cannot have finished its work, whatever the hardware, so the answer
    came at the deadline; then the held job and the abandoned work end and the slot serves."""
    import threading

    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app

    app = create_app(Settings(model="bundled", request_timeout_s=0.05), runtime=gpt2_runtime)
    released = threading.Event()  # the held device is let go once the 504 is sent
    at_start: list[tuple[bool, int]] = []  # (device let go, abandoned) when the response started
    spans: dict[str, float] = {}  # perf_counter readings around the app, for an ordering only

    async def watch(scope, receive, send):
        async def send_(msg):
            if scope.get("path") == "/v1/attention":
                if msg["type"] == "http.response.start":
                    at_start.append((released.is_set(), len(app.state.abandoned)))
                elif msg["type"] == "http.response.body" and not msg.get("more_body"):
                    spans.setdefault("released", time.perf_counter())
                    released.set()
            await send(msg)

        if scope.get("path") == "/v1/attention":
            spans.setdefault("entered", time.perf_counter())
        await app(scope, receive, send_)

    with TestClient(watch, raise_server_exceptions=False) as c:
        held = c.portal.start_task_soon(app.state.slot.run, released.wait, 300)  # 300: a net
        try:
            while app.state.slot.depth < 1:  # the held job has the device
                time.sleep(0.01)
            _timeout_checks(c, app, at_start, spans)
        finally:
            released.set()
        held.result(timeout=300)


def _timeout_checks(c, app, at_start, spans):
    r = c.post("/v1/attention", json={**_long_body(32), "encoding": "json"})
    assert r.status_code == 504, r.text[:300]
    err = r.json()["error"]
    assert err["type"] == "timeout" and "request_timeout_s" in err["message"]
    assert "x-request-id" in r.headers
    # answered at the deadline, not when the work ended: when the 504 started the device was
    # still held (the request had not even reached it) and the request was registered as
    # abandoned; the in-process client returns only once the handler ends
    assert at_start == [(False, 1)], at_start
    assert c.get("/healthz").status_code == 200  # health is never timed
    deadline = time.time() + 120  # a safety net, not a figure
    while (app.state.abandoned or app.state.slot.depth) and time.time() < deadline:
        time.sleep(0.05)
    assert not app.state.abandoned and app.state.slot.depth == 0
    m = _metrics(c.get("/metrics").text)
    # the latency recorded is the client's (to the 504's last byte, sent before the device was
    # let go), not the abandoned handler's (which ran its forwards after that): an ordering
    assert 0 < _sample(m, "attnscope_request_duration_seconds_sum", method="POST",
                       route="/v1/attention") <= spans["released"] - spans["entered"]
    r = c.post("/v1/attention", json={"text": "short", "layers": [0]})
    assert r.status_code == 200, r.text
    m = _metrics(c.get("/metrics").text)
    assert _sample(m, "attnscope_requests_total", method="POST", route="/v1/attention",
                   status="504") == 1


def test_settings_parse_comma_lists():
    from attnscope.service.config import Settings

    s = Settings(api_keys=" a , b,,", cors_origins="https://x.example")
    assert s.api_keys == ["a", "b"] and s.cors_origins == ["https://x.example"]
    assert "api_keys" not in repr(s) and "'a'" not in repr(s)
    assert Settings().api_keys == [] and Settings().cors_origins == []


# ------------------------------------------------------------ the model is start-up only
FORBIDDEN = {"model", "model_id", "model_name", "model_path", "revision", "checkpoint",
             "weights", "trust_remote_code", "hub", "repo_id", "model_dir"}


def _resolve(schema: dict, spec: dict) -> dict:
    while "$ref" in schema:
        ref = schema["$ref"].split("/")[-1]
        schema = spec["components"]["schemas"][ref]
    return schema


def _properties(schema: dict, spec: dict, seen=None) -> list[tuple[str, dict]]:
    """(name, schema) of every object schema's properties, recursively (a boolean schema,
    ``true`` / ``false`` in the rules between fields, has none)."""
    seen = seen if seen is not None else set()
    if not isinstance(schema, dict):
        return []
    if "$ref" in schema:
        ref = schema["$ref"]
        if ref in seen:
            return []
        seen.add(ref)
        schema = _resolve(schema, spec)
    out = []
    for k in ("anyOf", "oneOf", "allOf"):
        for s in schema.get(k, []):
            out += _properties(s, spec, seen)
    if "items" in schema:
        out += _properties(schema["items"], spec, seen)
    for name, s in (schema.get("properties") or {}).items():
        out.append((name, schema))
        out += _properties(s, spec, seen)
    return out


def test_no_request_can_choose_or_load_a_model(client, gpt2_runtime):
    spec = client.get("/openapi.json").json()
    posts = 0
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            body = op.get("requestBody")
            if not body:
                continue
            posts += 1
            schema = body["content"]["application/json"]["schema"]
            for name, _owner in _properties(schema, spec):
                assert name not in FORBIDDEN, f"{method.upper()} {path}: field {name!r}"
            top = _resolve(schema, spec)
            assert top.get("additionalProperties") is False, (
                f"{method.upper()} {path}: requests must forbid unknown fields")
            for p in op.get("parameters", []):
                assert p["name"] not in FORBIDDEN, f"{method.upper()} {path}: param {p['name']!r}"
    assert posts >= 2
    r = client.post("/v1/attention", json={"text": "x", "model": "gpt2"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "model"
    assert client.app.state.runtime is gpt2_runtime


def test_undecodable_body_and_lone_surrogates_are_422(client):
    """Found by the soak: a non-UTF-8 body was 400 'http_error', a lone surrogate a 500."""
    r = client.post("/v1/tokenize", content=b"\xff\xfe not json",
                    headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["type"] == "validation_error"
    assert r.json()["error"]["param"] == "body"
    bodies = {
        "/v1/tokenize": '{"text": "a \\ud800 b"}',
        "/v1/attention": '{"texts": ["fine", "\\udfff"]}',
        "/v1/heads": '{"text": "\\ud83d"}',
        "/v1/links": '{"text": "\\ud83d x", "layer": 0}',
        "/v1/trajectories": '{"text": "x \\ud83d"}',
        "/v1/verify": '{"text": "\\ud800"}',
    }
    paths = client.get("/openapi.json").json()["paths"]
    for path, body in bodies.items():
        if path not in paths:
            continue
        r = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 422, (path, r.status_code, r.text[:300])
        assert "surrogate" in r.json()["error"]["message"], path


def _ready(c, timeout=300):  # a safety net against a hang, not a figure
    deadline = time.time() + timeout
    while time.time() < deadline:
        if c.get("/readyz").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError("not ready")


@pytest.mark.regression
def test_model_load_is_not_recorded_as_a_request_forward():
    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app

    app = create_app(Settings(model="bundled"))
    with TestClient(app, raise_server_exceptions=False) as c:
        _ready(c)
        m = c.get("/metrics").text
        counts = {name: float(re.search(rf"^{name}_count (\S+)$", m, re.M).group(1))
                  for name in ("attnscope_forward_seconds", "attnscope_queue_wait_seconds")}
        assert counts == {"attnscope_forward_seconds": 0.0, "attnscope_queue_wait_seconds": 0.0}
        text = f"Metrics {uuid.uuid4().hex[:6]} the cat sat."
        assert c.post("/v1/heads", json={"text": text}).status_code == 200  # one forward
        assert c.post("/v1/heads", json={"text": text}).status_code == 200  # cached: not timed
        m = c.get("/metrics").text
        assert re.search(r"^attnscope_forward_seconds_count 1\.0$", m, re.M)
