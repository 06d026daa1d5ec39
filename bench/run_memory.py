#!/usr/bin/env python
"""/v1/run caching every hook at T = 1024 (issue 25: "streams without holding the response
twice"): the server's peak RSS growth during one request against the response's size, for
the cache encoded hook by hook inside the forward (``after``: this checkout) and the former
flow (``before``: the whole float32 cache returned by the forward, then encoded, so both are
held; reproduced in the child server by calling ``hooked.run`` without ``keep`` and encoding
its cache afterwards, as service/serving/run.py did up to this change).

Two ``attnscope serve`` children of this checkout on a random GPT-2-small-shaped model
(``GPT2Config()``); requests alternate between them (order rotated each round), streamed and
counted, never held by this process. Peak: the child's ``VmHWM`` after resetting it
(``/proc/PID/clear_refs`` 5) just before the request; growth = peak - RSS before. Prints the
load, one JSON object and a table.

    .venv/bin/python bench/run_memory.py --runs 2 [--form safetensors|base64] [--T 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import long_context  # noqa: E402  (its Server: one checkout's `attnscope serve`)


def _child(mode: str, argv: list[str]) -> int:
    """The server process: ``before`` patches the run endpoint back to the former flow."""
    if mode == "before":
        from attnscope.service.runtime import hooked as H
        from attnscope.service.serving import run as R

        real = H.run

        class _Old:
            @staticmethod
            def run(*a, keep=None, **k):  # the whole cache first, then every hook encoded
                res = real(*a, **k)
                if keep is not None:
                    res.cache = {n: keep(n, t) for n, t in res.cache.items()}
                return res

            def __getattr__(self, name):
                return getattr(H, name)

        R.H = _Old()
    from attnscope.service.cli import main as cli_main

    return cli_main(argv)


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


class Server(long_context.Server):
    """This checkout's ``serve`` through :func:`_child` in ``mode``; ``idle``: its RSS once
    ready, before any request."""

    def __init__(self, mode: str, model_dir: Path, log: Path):
        super().__init__(sys.executable, model_dir, log, ("--request-timeout-s", "1800"),
                         launcher=[sys.executable, __file__, "--child", mode])
        self.idle = _status(self.proc.pid, "VmRSS")


def one(server: Server, ids: list, form: str) -> dict:
    """One request; ``growth``: peak - RSS just before it; ``growth_from_idle``: peak - the
    server's RSS when it became ready (what an earlier request's heap kept counts here)."""
    import httpx

    pid = server.proc.pid
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _status(pid, "VmRSS")
    body = {"token_lists": [ids], "cache": ["*"], "dtype": "float16"}
    headers = {"accept": "application/x-safetensors"}
    if form == "base64":
        body["encoding"], headers = "base64", {}
    t0 = time.perf_counter()
    nbytes, head = 0, b""
    with httpx.stream("POST", server.url + "/v1/run", json=body, headers=headers,
                      timeout=1800) as r:
        status = r.status_code
        first = time.perf_counter() - t0  # headers: the body was built (the forward done)
        for chunk in r.iter_raw():
            nbytes += len(chunk)
            if len(head) < 2000:
                head += chunk[:2000]
    wall = time.perf_counter() - t0
    peak = _status(pid, "VmHWM")
    return {"status": status, "error": None if status == 200 else head[:500].decode(errors="replace"),
            "wall_s": round(wall, 2), "headers_s": round(first, 2), "rss_before": base, "peak": peak,
            "growth": peak - base, "growth_from_idle": peak - server.idle,
            "response_bytes": nbytes,
            "growth_over_response": round((peak - base) / max(nbytes, 1), 2)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--form", choices=("safetensors", "base64"), default="safetensors")
    ap.add_argument("--modes", default="before,after")
    args = ap.parse_args()
    import numpy as np

    sys.path.insert(0, str(HERE))
    from run import build_model

    tmp = Path(tempfile.mkdtemp(prefix="attnscope_run_memory_"))
    model_dir = build_model(False, tmp / "gpt2-small")
    modes = args.modes.split(",")
    out: dict = {"load_before": os.getloadavg(), "T": args.T, "form": args.form,
                 "runs": {m: [] for m in modes}}
    servers = {m: Server(m, model_dir, tmp / f"{m}.log") for m in modes}
    rng = np.random.default_rng(0)
    try:
        for r in range(args.runs):
            order = modes[r % len(modes):] + modes[: r % len(modes)]
            for m in order:
                ids = [0] + rng.integers(1, 2048, args.T - 1).tolist()
                res = one(servers[m], ids, args.form)
                res["load"] = os.getloadavg()[0]
                out["runs"][m].append(res)
                print(m, res, file=sys.stderr, flush=True)
    finally:
        for s in servers.values():
            s.stop()
    out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    for m, runs in out["runs"].items():
        g = statistics.median(x["growth"] for x in runs)
        gi = max(x["growth_from_idle"] for x in runs)
        n = statistics.median(x["response_bytes"] for x in runs)
        w = statistics.median(x["wall_s"] for x in runs)
        print(f"{m:7s} T={args.T} every hook float16 {args.form}: response {n / 1e9:.2f} GB, "
              f"server RSS growth {g / 1e9:.2f} GB = {g / n:.2f}x the response (peak over idle, "
              f"max {gi / 1e9:.2f} GB = {gi / n:.2f}x), {w:.1f} s "
              f"(medians of {len(runs)}); load {out['load_before'][0]:.1f} -> "
              f"{out['load_after'][0]:.1f}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        raise SystemExit(_child(sys.argv[2], sys.argv[3:]))
    raise SystemExit(main())
