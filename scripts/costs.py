#!/usr/bin/env python3
"""Per-request costs of one replica, for the replica arithmetic in docs/scaling.md.

    .venv/bin/python scripts/costs.py [--n 40] [--saturate-s 15] [--model bundled]

Starts ``attnscope serve`` on a free loopback port (like scripts/soak.py), then
  1. serial: for each request kind, ``--n`` requests one at a time with texts never seen
     before (cache miss: tokenize + forward + analysis + encoding) and ``--n`` with one repeated
     text (cache hit); reports p50 / mean milliseconds;
  2. saturation: ``--clients`` concurrent clients sending cache-miss /v1/attention requests of
     the typical kind for ``--saturate-s`` seconds; reports requests per second — the capacity
     of one replica for that kind.
Prints one JSON object. Figures depend on the machine: state it next to them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import start_server  # noqa: E402

SENT = "In the beginning God created the heaven and the earth, and the earth was without form"


def kinds():
    return {
        "attention json (1 text, all layers, round 4)":
            ("/v1/attention", lambda t: {"text": t, "round": 4}),
        "attention base64 + scores (1 text)":
            ("/v1/attention", lambda t: {"text": t, "encoding": "base64", "include_scores": True}),
        "attention json (8 texts, head_mean)":
            ("/v1/attention", lambda t: {"texts": [f"{t} {i}" for i in range(8)], "head_mean": True,
                                         "round": 4}),
        "tokenize": ("/v1/tokenize", lambda t: {"text": t}),
        "heads": ("/v1/heads", lambda t: {"text": t}),
        "links": ("/v1/links", lambda t: {"text": t, "layer": 1}),
        "trajectories": ("/v1/trajectories", lambda t: {"text": t}),
        "verify": ("/v1/verify", lambda t: {"text": t}),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--saturate-s", type=float, default=15.0)
    args = ap.parse_args()
    srv_args = argparse.Namespace(model=args.model, cache_entries=128, max_body_bytes=4_000_000,
                                  max_queue=256, server_arg=[])
    proc, url, _ = start_server(srv_args)
    out: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                            f"{platform.python_implementation()} {platform.python_version()}",
                 "serial_ms": {}}
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            out["model"] = c.get("/v1/model").json()
            paths = set(c.get("/openapi.json").json()["paths"])
            for name, (path, body) in kinds().items():
                if path not in paths:
                    continue
                row = {}
                for mode in ("miss", "hit"):
                    lat = []
                    for i in range(args.n):
                        t = f"{SENT} {uuid.uuid4().hex[:8]}" if mode == "miss" else SENT
                        t0 = time.perf_counter()
                        r = c.post(path, json=body(t))
                        lat.append((time.perf_counter() - t0) * 1000)
                        if r.status_code != 200:
                            raise SystemExit(f"{name}: {r.status_code} {r.text[:300]}")
                    row[mode] = {"p50": round(statistics.median(lat), 1),
                                 "mean": round(statistics.fmean(lat), 1)}
                out["serial_ms"][name] = row
        stop = time.time() + args.saturate_s
        done = [0]
        lock = threading.Lock()

        def client():
            with httpx.Client(base_url=url, timeout=120) as c:
                while time.time() < stop:
                    r = c.post("/v1/attention",
                               json={"text": f"{SENT} {uuid.uuid4().hex[:8]}", "round": 4})
                    if r.status_code == 200:
                        with lock:
                            done[0] += 1

        t0 = time.time()
        ths = [threading.Thread(target=client) for _ in range(args.clients)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        out["saturation"] = {"kind": "attention json (1 text, all layers, round 4), cache miss",
                             "clients": args.clients,
                             "rps": round(done[0] / (time.time() - t0), 1)}
        m = httpx.get(url + "/metrics").text
        out["tokens_per_text"] = len(httpx.post(url + "/v1/tokenize", json={"text": SENT + " abcd1234"})
                                     .json()["tokens"]["tokens"])
        out["metrics_excerpt"] = [x for x in m.splitlines()
                                  if x.startswith(("attnscope_forward_seconds_sum",
                                                   "attnscope_forward_seconds_count"))]
    finally:
        proc.terminate()
        proc.wait(timeout=40)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
