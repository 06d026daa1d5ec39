#!/usr/bin/env python3
"""Soak test: many concurrent clients against a real uvicorn on 127.0.0.1, bounded in time and count.

    .venv/bin/python scripts/soak.py --duration 90 --concurrency 32
    .venv/bin/python scripts/soak.py --url http://127.0.0.1:8000 --duration 60   # a running server

Without ``--url`` it starts ``attnscope serve --model bundled`` on a free loopback port with a
small forward cache (``--cache-entries 8``, so forwards keep running rather than every request
hitting the cache) and a small body limit (for the 413 case), and stops it at the end.
Loopback only: a ``--url`` whose host is not 127.0.0.1 / ::1 / localhost is refused.

Phases:
  1. serial: every good request once, one at a time; its answer is the reference. A sample the
     server rejects (an endpoint changed or absent) is reported and dropped from the mix.
     Endpoints in /openapi.json without a sample here are listed as not exercised.
  2. soak: ``--concurrency`` threads, each with its own HTTP client, pick requests at random
     (``--bad-fraction`` of them bad: blank text, out-of-range index, unknown field, malformed
     JSON, over-size body, unknown path, wrong method, too many texts), until ``--duration``
     seconds or ``--max-requests`` requests.
Report (stdout, and ``--json-out``): requests, throughput, count by status, 5xx, good responses
that differ from the serial answer, bad requests answered with an unexpected status, p50/p99
latency (all and per endpoint), and the server's RSS (VmRSS of its process, or
process_resident_memory_bytes from /metrics) after the serial phase and at the end.
Exit status 1 when there was any 5xx, mismatch, unexpected status or transport error.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from urllib.parse import urlparse

import httpx

TEXTS = [
    "Then I tried to find some way of embracing my mother's ghost.",
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "The cat sat on the mat. The cat sat on the mat.",
    "Attention is all you need, or so the paper says.",
    "A B C D E F G A B C D E F G",
    "Blessed are the meek: for they shall inherit the earth.",
    "To every thing there is a season, and a time to every purpose under the heaven.",
    "Let there be light: and there was light.",
    "one two three four five six seven eight nine ten",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Vanity of vanities, saith the Preacher; all is vanity.",
]


def good_requests() -> list[tuple[str, str, dict | None]]:
    """(method, path, json body) of requests whose answer must not depend on concurrency."""
    reqs: list[tuple[str, str, dict | None]] = [
        ("GET", "/healthz", None), ("GET", "/readyz", None), ("GET", "/v1/model", None),
    ]
    for i, t in enumerate(TEXTS):
        other = TEXTS[(i + 1) % len(TEXTS)]
        reqs += [
            ("POST", "/v1/tokenize", {"text": t}),
            ("POST", "/v1/attention", {"text": t, "layers": [0], "round": 4}),
            ("POST", "/v1/attention", {"text": t, "encoding": "base64", "include_scores": True}),
            ("POST", "/v1/attention", {"texts": [t, other], "head_mean": True, "round": 3}),
            ("POST", "/v1/heads", {"text": t}),
            ("POST", "/v1/links", {"text": t, "layer": 1, "top_k": 2}),
            ("POST", "/v1/trajectories", {"text": t}),
            ("POST", "/v1/verify", {"text": t}),
        ]
    rng = random.Random(7)
    for n in (3, 5, 8):
        m = [[round(rng.uniform(-1, 1), 3) for _ in range(4)] for _ in range(n)]
        reqs.append(("POST", "/v1/scratch-attention", {"q": m, "k": m, "v": m, "variant": "causal"}))
    return reqs


def bad_requests(max_body: int) -> list[tuple[str, str, object, tuple[int, ...]]]:
    """(method, path, body, expected statuses). ``bytes`` bodies are sent raw as JSON."""
    return [
        ("POST", "/v1/attention", {"text": "   "}, (422,)),
        ("POST", "/v1/attention", {"text": "x", "layers": [99]}, (422,)),
        ("POST", "/v1/attention", {"text": "x", "no_such_field": 1}, (422,)),
        ("POST", "/v1/attention", b'{"text": "x"', (422,)),
        ("POST", "/v1/attention", {"texts": ["a"] * 500}, (422,)),
        ("POST", "/v1/attention", {"text": "word " * 2000}, (422,)),
        ("POST", "/v1/tokenize", b"\xff\xfe not json", (422,)),
        ("POST", "/v1/links", {"text": "x"}, (422,)),
        ("POST", "/v1/links", {"text": "hello world", "layer": 42}, (422,)),
        ("POST", "/v1/heads", {"text": ""}, (422,)),
        ("POST", "/v1/scratch-attention", {"q": [[1.0, 2.0], [3.0]], "k": [[1.0]], "v": [[1.0]]}, (422,)),
        ("POST", "/v1/attention", b'{"text": "' + b"a" * (max_body + 10) + b'"}', (413,)),
        ("POST", "/v1/attention", b'{"text": "lone \\ud800 surrogate"}', (422,)),
        ("POST", "/v1/heads", b'{"texts": ["ok", "\\udfff"]}', (422,)),
        ("POST", "/v1/verify", b'{"text": "\\ud83d"}', (422,)),
        ("GET", "/v1/no-such-endpoint", None, (404,)),
        ("GET", "/v1/attention", None, (405,)),
    ]


def first_diff(a, b, path: str = "") -> str | None:
    """Where two JSON values first differ: 'path: a != b' (None when equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            d = first_diff(a.get(k), b.get(k), f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_diff(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{path}: {str(a)[:60]} != {str(b)[:60]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_of(pid: int | None, url: str) -> int | None:
    """Resident set size, bytes: /proc/<pid>/status when we own the process, else /metrics."""
    if pid is not None:
        try:
            m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
            if m:
                return int(m.group(1)) * 1024
        except OSError:
            pass
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
        m = re.search(r"^process_resident_memory_bytes ([0-9.e+]+)$", text, re.M)
        return int(float(m.group(1))) if m else None
    except httpx.HTTPError:
        return None


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q * (len(v) - 1)))))]


def start_server(args) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="attnscope-soak-")) / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "attnscope.service.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--model", args.model, "--cache-entries", str(args.cache_entries),
           "--max-body-bytes", str(args.max_body_bytes or 200_000), "--max-queue", str(args.max_queue),
           "--log-level", "warning", *args.server_arg]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"server not ready:\n{log.read_text()[-3000:]}")


def send(c: httpx.Client, method: str, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return c.request(method, path, content=body, headers={"content-type": "application/json"})
    if body is None:
        return c.request(method, path)
    return c.request(method, path, json=body)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server on loopback (default: start one)")
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of soak (max 3600)")
    ap.add_argument("--max-requests", type=int, default=50_000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--bad-fraction", type=float, default=0.15)
    ap.add_argument("--cache-entries", type=int, default=8)
    ap.add_argument("--max-body-bytes", type=int, default=None,
                    help="the server's body limit: set on the server we start (default 200000); "
                    "with --url, the running server's setting (default 4000000, the service's "
                    "default)")
    ap.add_argument("--max-queue", type=int, default=256)
    ap.add_argument("--api-key", default=os.environ.get("ATTNSCOPE_API_KEY"))
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra 'attnscope serve' argument for the started server (repeatable), "
                    "e.g. --server-arg=--forward-batch-size=1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    args.duration = min(max(args.duration, 1.0), 3600.0)

    proc = None
    if args.url:
        host = urlparse(args.url).hostname
        if host not in ("127.0.0.1", "::1", "localhost"):
            raise SystemExit(f"--url must be on loopback (127.0.0.1, ::1, localhost), got {host!r}")
        url = args.url.rstrip("/")
        deadline = time.time() + 180
        while True:  # wait for readiness, as for a started server
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise SystemExit(f"{url} is not ready after 180 s")
            time.sleep(0.3)
    else:
        proc, url, _log = start_server(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        return run(args, url, proc, headers)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()


def run(args, url: str, proc, headers: dict) -> int:
    pid = proc.pid if proc is not None else None
    with httpx.Client(base_url=url, timeout=120, headers=headers) as c:
        paths = set(c.get("/openapi.json").json().get("paths", {}))
        good, reference, dropped = [], {}, []
        for method, path, body in good_requests():
            if path not in paths:
                dropped.append(f"{method} {path}: not in /openapi.json")
                continue
            r = send(c, method, path, body)
            if r.status_code != 200:
                dropped.append(f"{method} {path} {json.dumps(body)[:80]}: {r.status_code} "
                               f"{r.text[:200]}")
                continue
            key = (method, path, json.dumps(body, sort_keys=True))
            if key not in reference:
                reference[key] = r.json()
                good.append((method, path, body, key))
        bad = [(m, p, b, e) for m, p, b, e in bad_requests(args.max_body_bytes or (4_000_000 if args.url else 200_000))
               if p in paths or e in ((404,), (405,))]
        exercised = {p for _, p, _, _ in good}
        not_exercised = sorted(p for p in paths if p not in exercised and p != "/metrics")
    rss_start = rss_of(pid, url)

    rng = random.Random(args.seed)
    lock = threading.Lock()
    status = Counter()
    latency: dict[str, list[float]] = defaultdict(list)
    all_lat: list[float] = []
    mismatches: list[str] = []
    unexpected: list[str] = []
    transport: list[str] = []
    count = [0]
    stop_at = time.time() + args.duration

    def worker(seed: int):
        r_local = random.Random(seed)
        with httpx.Client(base_url=url, timeout=120, headers=headers) as c:
            while time.time() < stop_at:
                with lock:
                    if count[0] >= args.max_requests:
                        return
                    count[0] += 1
                is_bad = r_local.random() < args.bad_fraction
                if is_bad:
                    method, path, body, expect = r_local.choice(bad)
                else:
                    method, path, body, key = r_local.choice(good)
                t0 = time.perf_counter()
                try:
                    r = send(c, method, path, body)
                except httpx.HTTPError as exc:
                    with lock:
                        transport.append(f"{method} {path}: {type(exc).__name__}: {exc}")
                    continue
                dt = time.perf_counter() - t0
                label = f"{method} {path}" + (" (bad)" if is_bad else "")
                with lock:
                    status[r.status_code] += 1
                    latency[label].append(dt)
                    all_lat.append(dt)
                if is_bad:
                    if r.status_code not in expect:
                        with lock:
                            unexpected.append(f"{label}: {r.status_code} (expected {expect}) "
                                              f"{r.text[:160]}")
                    elif r.json().get("error", {}).get("type") is None:
                        with lock:
                            unexpected.append(f"{label}: {r.status_code} without the envelope")
                elif r.status_code == 200:
                    if r.json() != reference[key]:
                        with lock:
                            mismatches.append(f"{label} {key[2][:80]} -> "
                                              f"{first_diff(reference[key], r.json())}")
                elif r.status_code != 429:
                    with lock:
                        unexpected.append(f"{label}: {r.status_code} {r.text[:160]}")

    t_start = time.time()
    threads = [threading.Thread(target=worker, args=(rng.randrange(1 << 30),))
               for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.time() - t_start
    rss_end = rss_of(pid, url)

    n = sum(status.values())
    n5xx = sum(v for k, v in status.items() if k >= 500)
    report = {
        "url": url, "duration_s": round(elapsed, 1), "concurrency": args.concurrency,
        "requests": n, "throughput_rps": round(n / elapsed, 1) if elapsed else None,
        "by_status": dict(sorted(status.items())), "5xx": n5xx,
        "good_distinct": len(good), "bad_kinds": len(bad),
        "mismatches": len(mismatches), "unexpected_status": len(unexpected),
        "transport_errors": len(transport),
        "latency_ms": {"p50": round(pct(all_lat, 0.5) * 1000, 1),
                       "p99": round(pct(all_lat, 0.99) * 1000, 1),
                       "max": round(max(all_lat, default=0) * 1000, 1)},
        "per_endpoint_ms": {k: {"n": len(v), "p50": round(pct(v, 0.5) * 1000, 1),
                                "p99": round(pct(v, 0.99) * 1000, 1)}
                            for k, v in sorted(latency.items())},
        "rss_mb": {"start": round(rss_start / 2**20, 1) if rss_start else None,
                   "end": round(rss_end / 2**20, 1) if rss_end else None},
        "dropped_samples": dropped, "not_exercised": not_exercised,
        "examples": {"mismatches": mismatches[:5], "unexpected": unexpected[:5],
                     "transport": transport[:5]},
    }
    print(json.dumps(report, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    ok = not (n5xx or mismatches or unexpected or transport)
    print("SOAK", "PASSED" if ok else "FAILED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
