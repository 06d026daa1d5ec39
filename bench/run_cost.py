#!/usr/bin/env python
"""/v1/run end to end against the bare in-process forward (issue 25's targets), on a random
GPT-2-small-shaped model (``GPT2Config()``: exactly GPT-2 small's cost) served by a real
``attnscope serve`` on 127.0.0.1:

* ``resid_post_T128``: ``client.run`` caching every ``blocks.*.hook_resid_post`` at T = 128
  (safetensors, the client's decode to numpy included) / the bare forward
  (``GPT2LMHeadModel(ids, use_cache=False)`` in this process, logits at the last position
  only, as the run computes them) — target <= 1.2x;
* ``everything_T1024`` (``--big``): every hook at T = 1024, streamed; the server's peak RSS
  growth during the request against the response's size (streaming means the body is not held
  twice) and the time against the forward.

Each request is paired with a floor forward run just before it (the machine's drifting load
hits both alike); ratios are medians of the per-pair ratios. Prints the machine's load, one
JSON object and a table.

    .venv/bin/python bench/run_cost.py --runs 7 [--big]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_context import Server  # noqa: E402
from run import build_model  # noqa: E402

from attnscope.client import Client  # noqa: E402


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--big", action="store_true", help="also every hook at T = 1024")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    import numpy as np
    import torch
    from transformers import GPT2LMHeadModel

    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="attnscope_run_cost_"))
    model_dir = build_model(False, tmp / "gpt2-small")
    model = GPT2LMHeadModel.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    server = Server(sys.executable, model_dir, tmp / "server.log")
    rng = np.random.default_rng(0)
    out: dict = {"load_before": os.getloadavg()}
    try:
        c = Client(server.url, timeout=900, max_retries=0)

        def floor(T):
            ids = torch.tensor([[0] + rng.integers(1, 2048, T - 1).tolist()])
            t0 = time.perf_counter()
            with torch.inference_mode():
                h = model.transformer(input_ids=ids, use_cache=False).last_hidden_state
                model.lm_head(h[:, -1:])
            return time.perf_counter() - t0

        def run_once(T, cache):
            ids = [[0] + rng.integers(1, 2048, T - 1).tolist()]
            t0 = time.perf_counter()
            res = c.run(tokens=ids, cache=cache)
            arrays = [np.asarray(v).sum() for v in res.cache.values()]  # touch every byte
            del arrays
            return time.perf_counter() - t0

        floor(128), run_once(128, ["blocks.*.hook_resid_post"])  # warm-up
        pairs = []
        for _ in range(args.runs):
            f = floor(128)
            r = run_once(128, ["blocks.*.hook_resid_post"])
            pairs.append((f, r))
        out["resid_post_T128"] = {
            "floor_s": statistics.median(p[0] for p in pairs),
            "run_s": statistics.median(p[1] for p in pairs),
            "ratio_median_of_pairs": statistics.median(p[1] / p[0] for p in pairs),
            "target": 1.2,
        }
        if args.big:
            f = floor(1024)
            base = _rss(server.proc.pid)
            peak = [base]
            done = threading.Event()

            def watch():
                while not done.is_set():
                    peak[0] = max(peak[0], _rss(server.proc.pid))
                    time.sleep(0.05)
            t = threading.Thread(target=watch, daemon=True)
            t.start()
            ids = [[0] + rng.integers(1, 2048, 1023).tolist()]
            t0 = time.perf_counter()
            import httpx

            nbytes, head = 0, b""
            with httpx.stream("POST", server.url + "/v1/run", timeout=1800,
                              json={"token_lists": ids, "cache": ["*"], "dtype": "float16"},
                              headers={"accept": "application/x-safetensors"}) as r:
                status = r.status_code
                for chunk in r.iter_raw():
                    nbytes += len(chunk)
                    if len(head) < 2000:
                        head += chunk[:2000]
            wall = time.perf_counter() - t0
            done.set()
            t.join()
            out["everything_T1024"] = {
                "status": status, "error": head.decode(errors="replace") if status != 200 else None,
                "floor_s": f, "run_s": wall, "ratio": wall / f, "response_bytes": nbytes,
                "server_rss_growth_bytes": peak[0] - base,
                "rss_growth_over_response": (peak[0] - base) / max(nbytes, 1),
            }
    finally:
        server.stop()
    out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    r = out["resid_post_T128"]
    print(f"\nT=128 cache blocks.*.hook_resid_post: run {r['run_s'] * 1e3:.0f} ms, forward "
          f"{r['floor_s'] * 1e3:.0f} ms, ratio {r['ratio_median_of_pairs']:.2f}x (target 1.2x); "
          f"load {out['load_before']} -> {out['load_after']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
