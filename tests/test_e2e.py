"""End to end against a real uvicorn on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import SENTENCE, start_server, stop_server

pytestmark = pytest.mark.e2e

BAD = [
    ({"text": "   "}, 422, "validation_error"),
    ({"text": "word " * 400}, 422, "context_length_exceeded"),
    ({"text": "x", "layers": [7]}, 422, "out_of_range"),
    ({"text": "x", "heads": [4]}, 422, "out_of_range"),
    ({"texts": ["a"] * 40}, 422, "batch_too_large"),
]


def test_bad_inputs_then_good_request(live_server):
    with httpx.Client(base_url=live_server.url, timeout=30) as c:
        for body, status, etype in BAD:
            r = c.post("/v1/attention", json=body)
            assert r.status_code == status and r.json()["error"]["type"] == etype
            assert r.json()["error"]["message"]
            assert c.post("/v1/attention", json={"text": "good", "layers": [0]}).status_code == 200
        r = c.post("/v1/attention", content=b"[" * 5_000_000, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "payload_too_large"
        assert c.post("/v1/attention", json={"text": "good"}).status_code == 200


def test_concurrent_requests_identical_to_serial(live_server):
    texts = [f"Request number {i}: and God said, let there be light {i * 7}." for i in range(32)]
    with httpx.Client(base_url=live_server.url, timeout=60) as c:
        serial = [c.post("/v1/attention", json={"text": t, "encoding": "base64"}).json() for t in texts]
    with ThreadPoolExecutor(32) as ex:
        def call(t):
            with httpx.Client(base_url=live_server.url, timeout=60) as c:
                return c.post("/v1/attention", json={"text": t, "encoding": "base64"})
        conc = list(ex.map(call, texts))
    assert all(r.status_code == 200 for r in conc)
    assert [r.json() for r in conc] == serial


def test_healthz_answers_during_long_forward(live_server):
    """A blocked loop makes /healthz wait for the whole forward: /healthz answers while the
    forward runs, and the probe on the server's loop (tests/loop_lag.py) wakes within the idle
    baseline's bound throughout."""
    from loop_lag import assert_responsive

    long_texts = [" ".join(["light"] * 200) + f" {i}" for i in range(32)]
    done = threading.Event()
    got = {}

    def long_call():
        with httpx.Client(base_url=live_server.url, timeout=120) as c:
            got["r"] = c.post("/v1/attention", json={"texts": long_texts, "include_scores": True,
                                                     "round": 4})
        done.set()

    idle = live_server.lag.idle()
    th = threading.Thread(target=long_call)
    answered = 0
    with live_server.lag.window() as busy:
        th.start()
        with httpx.Client(base_url=live_server.url, timeout=120) as c:
            while not done.is_set() and answered < 20:
                assert c.get("/healthz").status_code == 200
                answered += 1
                done.wait(0.05)
        th.join()
    assert got["r"].status_code == 200 and answered >= 1
    # a blocked loop waits for the whole forward; a busy machine slows both alike, so the
    # bound also allows half of the forward's span (as the /healthz bound did)
    assert_responsive(idle, busy, "/v1/attention, 32 texts", share=0.5)


def test_overload_gets_429_then_recovers(tmp_path):
    s = start_server(tmp_path, "--model", "bundled", "--max-queue", "1")
    try:
        body = {"texts": [" ".join(["light"] * 200) + f" {i}" for i in range(16)], "include_scores": True}
        with ThreadPoolExecutor(12) as ex:
            rs = list(ex.map(lambda _: httpx.post(s.url + "/v1/attention", json=body, timeout=120), range(12)))
        codes = [r.status_code for r in rs]
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
        e = next(r for r in rs if r.status_code == 429).json()["error"]
        assert e["type"] == "overloaded" and "max_queue=1" in e["message"]
        assert httpx.post(s.url + "/v1/attention", json={"text": SENTENCE}, timeout=30).status_code == 200
    finally:
        stop_server(s)


def test_startup_fails_clearly_on_bad_model(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "attnscope.service.cli", "serve", "--model", str(tmp_path / "nope"),
         "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert p.returncode != 0
    assert "could not load model" in (p.stderr + p.stdout)
