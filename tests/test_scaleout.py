"""Scale-out on one host without Docker: three real ``attnscope serve --model bundled`` processes
on random loopback ports behind a real haproxy running the shipped configuration
(deploy/haproxy/haproxy.cfg via deploy/loopback_cluster.py), and ``attnscope batch`` through it.

* the load balancer's policy: health checks on /readyz; a connection failure is re-sent to
  another replica for every method; a request that was sent and then lost is re-sent by
  haproxy only for GET (idempotent reads) -- a POST comes back 502 and the client decides;
* a replica SIGKILLed midway through a corpus and restarted: every id exactly once in the
  output or in the failures file (with its error), results equal to a single server's;
* a rolling restart (each replica drained, stopped, replaced, readied; one at a time) during a
  run: zero failed items, zero 5xx answers from haproxy.

haproxy is Debian's package; ./scripts/test installs it. Without it these tests FAIL (never skip).
The replicas run with ``--cache-entries 0`` (every item is a real forward, so an answer
that came from another replica is recomputed, not replayed from a cache) and
OMP_NUM_THREADS=1 (three torch processes on two cores: docs/scaling.md).

The full-size figures (3,000 texts, throughput for 1-3 replicas) are in
scripts/scaleout_bench.py and docs/scaling.md; this test uses 600 texts, and runs the rolling
restart's batches back to back until the replacements are over (it checks that requests
arrived during each one).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import socketserver
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("loopback_cluster", ROOT / "deploy" / "loopback_cluster.py")
lc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lc)

N_TEXTS = 600
TOO_LONG = ["word " * 300, "token " * 280, "attention " * 270]  # > 256 tokens: 422 each
PARAMS = ["-a", "attention", "-a", "links",
          "--params", json.dumps({"attention": {"layers": [1], "head_mean": True}})]
SERVE = ["--model", "bundled", "--log-format", "text", "--cache-entries", "0"]


def _need_haproxy() -> None:
    if shutil.which("haproxy") is None:
        pytest.fail("haproxy is not installed: apt-get install -y haproxy (./scripts/test does it)")


@pytest.fixture(scope="module")
def cluster():
    _need_haproxy()
    c = lc.LoopbackCluster(3, serve_args=SERVE, replica_env={"OMP_NUM_THREADS": "1"})
    c.start()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return lc.corpus_texts(N_TEXTS, seed=16)


@pytest.fixture(scope="module")
def reference(cluster, texts, tmp_path_factory):
    """Single-server answers: the same corpus through ``attnscope batch`` straight to one
    replica (no haproxy), two requests in flight (each is forwarded alone: the engine does
    not batch across requests). text -> results; plus the failures."""
    d = tmp_path_factory.mktemp("reference")
    items = [{"id": f"ref-{i}", "text": t} for i, t in enumerate(texts + TOO_LONG)]
    lc.write_jsonl(d / "in.jsonl", items)
    rc, summary = lc.finish_batch(lc.start_batch(cluster.replicas[0].url, d / "in.jsonl",
                                                 d / "out.jsonl", 2, *PARAMS))
    assert rc == 4 and summary["done"] == N_TEXTS and summary["failed"] == len(TOO_LONG), summary
    by_id = {it["id"]: it["text"] for it in items}
    answers = {by_id[o["id"]]: o["results"] for o in lc.read_jsonl(d / "out.jsonl")}
    assert len(answers) == N_TEXTS
    failures = {by_id[f["id"]]: f["error"]["type"]
                for f in lc.read_jsonl(d / "out.jsonl.failures.jsonl")}
    assert failures == {t: "context_length_exceeded" for t in TOO_LONG}
    return answers, failures


def _check_run(items, out, fails, reference, expect_failed: set[str]):
    """Every id exactly once in ``out`` or ``fails``; results equal the single-server answer;
    the failed ids are exactly ``expect_failed``, with the single server's error type."""
    answers, ref_failures = reference
    text_of = {it["id"]: it["text"] for it in items}
    done = [o["id"] for o in lc.read_jsonl(out)]
    failed = lc.read_jsonl(fails)
    failed_ids = [f["id"] for f in failed]
    assert len(done) == len(set(done)), "duplicated ids in the output"
    assert len(failed_ids) == len(set(failed_ids)), "duplicated ids in the failures file"
    assert not set(done) & set(failed_ids), "ids both done and failed"
    assert set(done) | set(failed_ids) == set(text_of), "lost ids"
    assert set(failed_ids) == expect_failed
    for f in failed:
        assert f["error"]["type"] == ref_failures[text_of[f["id"]]], f
    mismatched = [o["id"] for o in lc.read_jsonl(out)
                  if o["results"] != answers[text_of[o["id"]]]]
    assert not mismatched, f"{len(mismatched)} results differ from the single server's"
    return len(done)


def test_haproxy_checks_readyz_and_balances_leastconn(cluster):
    """All three replicas UP by their /readyz check (layer 7), leastconn, and every replica
    takes part in a run's traffic."""
    rows = cluster.stats()
    for r in cluster.replicas:
        assert rows[r.name]["status"] == "UP"
        assert rows[r.name]["check_status"] == "L7OK", rows[r.name]
    cfg = lc.render_haproxy_config([(r.name, r.port) for r in cluster.replicas])
    assert "balance leastconn" in cfg and "option httpchk GET /readyz" in cfg
    before = {r.name: int(rows[r.name]["stot"]) for r in cluster.replicas}
    with httpx.Client(base_url=cluster.url, timeout=30) as h:
        for i in range(30):
            assert h.post("/v1/tokenize", json={"text": f"x {i}"}).status_code == 200
    rows = cluster.stats()
    for r in cluster.replicas:
        assert int(rows[r.name]["stot"]) > before[r.name], f"{r.name} got no requests"


class _DropsRequests(socketserver.BaseRequestHandler):
    """A 'replica' that passes its /readyz check and drops every other request after reading
    it (closes without a byte): what a replica that dies holding a request looks like."""

    def handle(self):
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.request.recv(65536)
            if not chunk:
                return
            data += chunk
        method_path = data.split(b"\r\n", 1)[0].split(b" ")[:2]
        if method_path == [b"GET", b"/readyz"]:
            body = b'{"status":"ready"}'
            self.request.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
                                 + body)
            return
        self.server.dropped.append(method_path[0].decode())


def _keep_routing(lb, server: str) -> None:
    """Checks off and the server forced up ('no check'), so haproxy keeps routing to it."""
    lb.admin(f"disable health attnscope/{server}")
    lb.admin(f"set server attnscope/{server} health up")
    assert lb.stats()[server]["status"] == "no check", lb.stats()[server]


def test_retries_connection_failures_always_sent_requests_only_for_get(cluster, tmp_path):
    """The shipped retry policy, on a real haproxy: (1) a server whose port refuses
    connections: POSTs and GETs are all redispatched to the live replica (the request never
    left haproxy); (2) a server that takes requests and drops them: GETs are re-sent to the
    live replica (200), POSTs are not (the client gets a 502 or a closed connection, and the
    dropping server saw each of those POSTs exactly once)."""
    _need_haproxy()
    good = cluster.replicas[0]
    dead_port = lc.free_port()  # nothing listens there
    srv = socketserver.ThreadingTCPServer(("127.0.0.1", lc.free_port()), _DropsRequests)
    srv.daemon_threads = True
    srv.dropped = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        # (1) connection refused -> re-sent elsewhere, whatever the method
        with lc.Haproxy([("dead", dead_port), ("good", good.port)], tmp_path,
                        lc.free_port()) as lb, httpx.Client(base_url=lb.url, timeout=30) as h:
            _keep_routing(lb, "dead")
            statuses = []
            for i in range(8):
                statuses.append(h.post("/v1/tokenize", json={"text": f"a {i}"}).status_code)
                statuses.append(h.get("/v1/model").status_code)
            row = lb.stats()["dead"]
            assert statuses == [200] * 16
            assert int(row["wretr"]) + int(row["wredis"]) >= 1, row  # it was tried, and re-sent
        # (2) sent and dropped -> re-sent only for GET
        with lc.Haproxy([("drops", srv.server_address[1]), ("good", good.port)], tmp_path,
                        lc.free_port()) as lb, httpx.Client(base_url=lb.url, timeout=30) as h:
            _keep_routing(lb, "drops")
            get_status = []
            for _ in range(40):
                get_status.append(h.get("/v1/model").status_code)
                if "GET" in srv.dropped and len(get_status) >= 4:
                    break
            assert "GET" in srv.dropped, "no GET reached the dropping server"
            assert set(get_status) == {200}, get_status
            post_status = []
            for i in range(40):
                try:
                    post_status.append(h.post("/v1/tokenize", json={"text": f"b {i}"}).status_code)
                except httpx.RemoteProtocolError:
                    # haproxy closes a kept-alive client connection without an answer when the
                    # server did (so that the client may retry); a fresh one gets a 502
                    post_status.append("closed")
                if srv.dropped.count("POST") >= 2:
                    break
            assert set(post_status) <= {200, 502, "closed"}, post_status
            lost = len(post_status) - post_status.count(200)
            assert lost == srv.dropped.count("POST") >= 1, (post_status, srv.dropped)
    finally:
        srv.shutdown()
        srv.server_close()


def _wait_lines(path, n: int, proc, timeout: float = 300.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = lc.count_lines(path)
        if got >= n or proc.poll() is not None:
            return got
        time.sleep(0.05)
    raise TimeoutError(f"{path}: fewer than {n} lines after {timeout} s")


def test_sigkill_midway_nothing_lost_results_equal_single_server(cluster, texts, reference,
                                                                 tmp_path):
    """A replica is SIGKILLed a quarter of the way through a corpus (3 texts in it are too long:
    recorded failures) and started again at once: every id exactly once in the output or the
    failures file, the failures exactly the too-long texts with the single server's error,
    every result equal to the single server's, and the killed replica back UP in haproxy."""
    items = [{"id": f"a-{i}", "text": t} for i, t in enumerate(texts + TOO_LONG)]
    lc.write_jsonl(tmp_path / "in.jsonl", items)
    out, fails = tmp_path / "out.jsonl", tmp_path / "out.jsonl.failures.jsonl"
    victim = cluster.replicas[1]
    proc = lc.start_batch(cluster.url, tmp_path / "in.jsonl", out, len(cluster.replicas),
                          *PARAMS)
    restart_s = {}

    def restart():
        t0 = time.monotonic()
        cluster.restart(1)
        restart_s["s"] = time.monotonic() - t0

    try:
        at_kill = _wait_lines(out, N_TEXTS // 4, proc)
        assert proc.poll() is None, "the run ended before the kill"
        cluster.kill(1)
        assert victim.proc.returncode == -signal.SIGKILL
        t = threading.Thread(target=restart)
        t.start()
        rc, summary = lc.finish_batch(proc)
        t.join(300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert at_kill < N_TEXTS, "the kill was not midway"
    assert "s" in restart_s, "the killed replica did not come back"
    assert cluster.stats()[victim.name]["status"] == "UP"
    assert rc == 4, summary  # 4: some items failed (the too-long ones)
    assert summary["failed"] == len(TOO_LONG) and summary["done"] == N_TEXTS, summary
    long_ids = {it["id"] for it in items if it["text"] in TOO_LONG}
    _check_run(items, out, fails, reference, long_ids)
    print(f"\nkill run: {summary['items_per_second']:.1f} items/s, restart {restart_s['s']:.1f} s,"
          f" haproxy 5xx {cluster.stats()['FRONTEND']['hrsp_5xx']}")


def test_rolling_restart_zero_failed_items(cluster, texts, reference, tmp_path):
    """Replicas replaced one at a time (drain in haproxy, wait for its requests to finish,
    SIGTERM, start a new process, /readyz, ready, UP) while ``attnscope batch`` runs, back to
    back on chunks of the corpus until a run that began after the last replacement is over:
    requests arrived during every replacement, zero failed items, zero 5xx from haproxy, every
    id of every run exactly once, results equal the single server's, and every new process
    served part of the work. (Runs back to back, not one run sized from the measured pace:
    the test ends ~10 s after the last replacement whatever the machine's speed.)"""
    per_run = N_TEXTS // 2
    runs: list[tuple] = []  # (items, out, fails, rc, summary), in order
    started = threading.Semaphore(0)
    lock, until, errors = threading.Lock(), [None], []  # until: how many runs in all

    def runner():
        k = 0
        try:
            while True:
                with lock:
                    if until[0] is not None and k >= until[0]:
                        return
                items = [{"id": f"b{k}-{i}", "text": texts[(k * per_run + i) % len(texts)]}
                         for i in range(per_run)]
                src, out = tmp_path / f"in-{k}.jsonl", tmp_path / f"out-{k}.jsonl"
                lc.write_jsonl(src, items)
                proc = lc.start_batch(cluster.url, src, out, len(cluster.replicas), *PARAMS)
                started.release()
                try:
                    rc, summary = lc.finish_batch(proc)
                finally:
                    if proc.poll() is None:
                        proc.kill()
                with lock:
                    runs.append((items, out, Path(f"{out}.failures.jsonl"), rc, summary))
                k += 1
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    five_xx_before = int(cluster.stats()["FRONTEND"]["hrsp_5xx"])
    t = threading.Thread(target=runner, daemon=True)
    t.start()
    served_after, arrived = {}, []
    try:
        assert started.acquire(timeout=120)
        _wait_lines(tmp_path / "out-0.jsonl", 20, _Alive(t))
        for i, r in enumerate(cluster.replicas):
            assert t.is_alive() and not errors, errors
            before = int(cluster.stats()["FRONTEND"]["req_tot"])  # HTTP requests
            cluster.replace(i)
            rows = cluster.stats()
            arrived.append(int(rows["FRONTEND"]["req_tot"]) - before)
            served_after[r.name] = int(rows[r.name]["stot"])
        with lock:  # the run in flight now (if any), then one begun after the replacements
            until[0] = len(runs) + 2
    finally:
        with lock:
            if until[0] is None:
                until[0] = 0
        t.join(timeout=600)
    assert not errors, errors
    assert all(a > 0 for a in arrived), f"no requests during a replacement: {arrived}"
    n = 0
    for items, out, fails, rc, summary in runs:
        assert rc == 0 and summary["failed"] == 0 and summary["done"] == len(items), summary
        assert lc.read_jsonl(fails) == []
        n += _check_run(items, out, fails, reference, set())
    rows = cluster.stats()
    assert int(rows["FRONTEND"]["hrsp_5xx"]) == five_xx_before, "haproxy answered 5xx"
    for r in cluster.replicas:
        assert r.starts >= 2
        assert int(rows[r.name]["stot"]) > served_after[r.name], \
            f"the new {r.name} served nothing"
    print(f"\nrolling restart: {len(runs)} runs, {n} items, requests during each "
          f"replacement {arrived}")


class _Alive:
    """:func:`_wait_lines`' ``proc`` for a thread: ``poll()`` is None while it runs."""

    def __init__(self, thread: threading.Thread):
        self.thread = thread

    def poll(self):
        return None if self.thread.is_alive() else 0
