"""Mean-ablation benchmark (issue 27): every head of a random GPT-2-small-shaped model
(``GPT2Config()``: 12 layers x 12 heads, d_model 768, vocabulary 50257) mean-ablated alone,
the mean of each head's z taken over a dataset of 64 reference prompts, the metric the mean
next-token loss of the text; ``POST /v1/ablate`` (``scan: true, method: "mean",
reference_token_lists``; in-process app through HTTP) against TransformerLens 4.3 in-process
doing the same (one ``run_with_cache`` of the 64 prompts for the means, then one
``run_with_hooks`` per head), in one run, alternating.

    .venv/bin/python bench/mean_ablation.py                  # 64 prompts of 32 tokens, 2 runs
    .venv/bin/python bench/mean_ablation.py --prompts 64 --tokens 32 --runs 3

Prints wall and thread-CPU seconds (median), the grids' max abs difference, the load average
before and after; writes bench/results/mean_ablation-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app
    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime
    from interventions_reference import gpt2_small_dir, tl_bridge

    load_before = os.getloadavg()
    d = gpt2_small_dir(Path(tempfile.mkdtemp()) / "gpt2small")
    settings = Settings(model=str(d), max_batch=max(32, args.prompts),
                        max_request_bytes=8 << 30, request_timeout_s=3600)
    rt = Runtime.load(settings)
    tl = tl_bridge(d)
    L, H, T = rt.adapter.n_layers, rt.adapter.n_heads, args.tokens
    g = torch.Generator().manual_seed(0)
    text = torch.randint(100, 2000, (T,), generator=g).tolist()
    refs = torch.randint(100, 2000, (args.prompts, T), generator=g)
    nxt = torch.tensor(text[1:])

    def ours(client):
        r = client.post("/v1/ablate", json={
            "tokens": text, "scan": True, "method": "mean", "scan_metric": "loss",
            "reference_token_lists": refs.tolist()})
        assert r.status_code == 200, r.text
        return np.array(r.json()["scan"]["grid"], dtype=float)

    def theirs():
        with torch.no_grad():
            _, cache = tl.run_with_cache(refs, names_filter=lambda n: n.endswith("attn.hook_z"))
            means = {lyr: cache[f"blocks.{lyr}.attn.hook_z"].mean((0, 1)) for lyr in range(L)}
            out = np.empty((L, H))
            for lyr in range(L):
                for h in range(H):
                    def hook(z, hook, lyr=lyr, h=h):
                        z[:, :, h] = means[lyr][h]
                        return z
                    lg = tl.run_with_hooks(torch.tensor([text]),
                                           fwd_hooks=[(f"blocks.{lyr}.attn.hook_z", hook)])
                    lp = torch.log_softmax(lg[0, :-1], -1)
                    out[lyr, h] = float(-lp[torch.arange(T - 1), nxt].mean())
        return out

    wall = {"ours": [], "tl": []}
    cpu = {"ours": [], "tl": []}
    with TestClient(create_app(settings, runtime=rt)) as client:
        a, b = ours(client), theirs()  # warm both
        for _ in range(args.runs):
            for name, fn in (("ours", lambda: ours(client)), ("tl", theirs)):
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    load_after = os.getloadavg()
    res = {
        "model": "random GPT2Config() (12 layers, 12 heads, d_model 768, vocab 50257)",
        "tokens": T, "reference_prompts": args.prompts, "heads": L * H, "runs": args.runs,
        "ours_wall_s": statistics.median(wall["ours"]), "tl_wall_s": statistics.median(wall["tl"]),
        "ours_cpu_s": statistics.median(cpu["ours"]), "tl_cpu_s": statistics.median(cpu["tl"]),
        "max_abs_diff": float(np.abs(a - b).max()),
        "loadavg_before": load_before, "loadavg_after": load_after, "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    res["ours_over_tl_wall"] = res["ours_wall_s"] / res["tl_wall_s"]
    res["ours_over_tl_cpu"] = res["ours_cpu_s"] / res["tl_cpu_s"]
    for k, v in res.items():
        print(f"{k:>20}: {v}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"mean_ablation-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(
        json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
