"""Cost of /v1/attention-norms and /v1/rollout next to /v1/attention for the same text.

    .venv/bin/python bench/norms_rollout.py            # GPT-2 small shapes, T = 16, 128, 512
    .venv/bin/python bench/norms_rollout.py --quick    # T = 16, 128, fewer runs
    .venv/bin/python bench/norms_rollout.py --tiny     # a tiny model (seconds)

A randomly initialised ``GPT2Config()`` model (GPT-2 small's shapes, as bench/run.py builds it)
served by a real uvicorn (``attnscope serve``) on 127.0.0.1. Per length T and endpoint, the
median latency to the last byte over several runs, two ways: ``cold`` = a fresh text of exactly
T tokens each time (the forward runs), ``warm`` = the same text again (the forward comes from
the cache: what the analysis and its encoding cost). Attention flow is measured at T = 16, its
limit (``FLOW_MAX_TOKENS``). Prints a table; no assertion (figures, not tests).
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from run import Texts, build_model  # noqa: E402  (bench/run.py: the same model and texts)

CASES = {  # name -> (path, request options)
    "attention json": ("/v1/attention", {}),
    "attention base64": ("/v1/attention", {"encoding": "base64"}),
    "norms json": ("/v1/attention-norms", {}),
    "norms base64": ("/v1/attention-norms", {"encoding": "base64"}),
    "norms summed only b64": ("/v1/attention-norms", {"encoding": "base64", "per_head": False,
                                                      "value_norms": False}),
    "rollout json": ("/v1/rollout", {}),
    "rollout base64": ("/v1/rollout", {"encoding": "base64"}),
    "rollout + flow (last layer)": ("/v1/rollout", {"encoding": "base64", "flow": True}),
}


def port() -> int:
    for _ in range(100):
        p = random.randint(20000, 60000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
                return p
            except OSError:
                continue
    raise RuntimeError("no free port")


def serve(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    p = port()
    url = f"http://127.0.0.1:{p}"
    env = {**os.environ, "ATTNSCOPE_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnscope.service.cli", "serve", "--host", "127.0.0.1", "--port",
         str(p), "--model", str(model_dir), "--request-timeout-s", "900"],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(log.read_text()[-2000:])
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server not ready")


def timed(http: httpx.Client, path: str, body: dict) -> tuple[float, int]:
    t = time.perf_counter()
    r = http.post(path, json=body)
    n = len(r.content)
    dt = time.perf_counter() - t
    if r.status_code != 200:
        raise RuntimeError(f"{path}: {r.status_code} {r.text[:300]}")
    return dt, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    lengths = [16, 128] if args.quick else [16, 128, 512]
    runs = 3 if args.quick else 5
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args.tiny, Path(tmp) / "model")
        texts = Texts(model_dir)
        proc, url = serve(model_dir, Path(tmp) / "server.log")
        try:
            with httpx.Client(base_url=url, timeout=900) as http:
                timed(http, "/v1/attention", {"text": texts.make(16)})  # warm-up
                rows = []
                for T in lengths:
                    for name, (path, opts) in CASES.items():
                        if opts.get("flow") and T > 16:
                            continue
                        cold, size = [], 0
                        for _ in range(runs):
                            dt, size = timed(http, path, {"text": texts.make(T), **opts})
                            cold.append(dt)
                        text = texts.make(T)
                        timed(http, path, {"text": text, **opts})  # fill the cache
                        warm = [timed(http, path, {"text": text, **opts})[0] for _ in range(runs)]
                        rows.append((T, name, statistics.median(cold) * 1e3,
                                     statistics.median(warm) * 1e3, size))
                        print(f"T={T:<4} {name:<28} cold {rows[-1][2]:9.1f} ms   warm "
                              f"{rows[-1][3]:9.1f} ms   {size / 1e6:8.2f} MB", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    model = "tiny random GPT-2" if args.tiny else "random GPT2Config() (GPT-2 small shapes)"
    print(f"\n{model}; median of {runs} runs; cold = fresh text (forward included), warm = cached "
          "forward")
    print(f"{'T':>4}  {'endpoint':<28} {'cold ms':>9} {'warm ms':>9} {'MB':>8}  x attention (cold)")
    base = {(T, "json" if "json" in n else "base64"): c for T, n, c, _, _ in rows
            if n.startswith("attention")}
    for T, name, c, w, size in rows:
        ref = base.get((T, "json" if "json" in name else "base64"))
        print(f"{T:>4}  {name:<28} {c:9.1f} {w:9.1f} {size / 1e6:8.2f}  {c / ref:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
