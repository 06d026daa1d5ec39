"""Patching-grid benchmark (issue 27): the head x position activation-patching grid
(``POST /v1/patch`` with ``hook: "z", by_position: true``, TransformerLens'
``get_act_patch_attn_head_out_by_pos``) at T = 64 on a random GPT-2-small-shaped model
(``GPT2Config()``: 12 layers, 12 heads, d_model 768, vocabulary 50257), ours through HTTP
(in-process app) against TransformerLens 4.3 in-process, in one run, alternating.

    .venv/bin/python bench/patch_grid.py                     # layers 0 and 11, 8 TL cells each
    .venv/bin/python bench/patch_grid.py --layers 11 --tl-cells 4 --runs 2

Our grid's cost per layer l is linear in the layers a cell runs (n_layers - l: each batch of
cells starts at its layer from the corrupted run's residual stream), so the full grid's time is
estimated as ``n_layers / 2 * (t(layer 0) + t(layer n_layers - 1))`` from the two extremes
measured (sum over l of (L - l) = L (L + 1) / 2). TransformerLens runs one whole forward per
cell whatever its layer (``generic_activation_patch``), so its full-grid time is its measured
seconds per cell times ``n_layers * T * n_heads``; it runs only ``--tl-cells`` sampled cells per
layer (the whole grid is 9,216 forwards), given to it as an ``index_df``, and those cells'
values are compared with ours. The prompts share ``--shared-prefix`` tokens (default T/2):
ours skips the cells there (clean = corrupted activations) and the last position (after the
metric's), so run ``--shared-prefix 0`` too for prompts that differ from the first token. Prints wall and thread-CPU seconds, the estimates, the max abs
difference, the load average before and after; writes bench/results/patch_grid-<time>.json.
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
os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, nargs="+", default=None,
                    help="layers measured (default: 0 and the last)")
    ap.add_argument("--tl-cells", type=int, default=8, help="TL cells sampled per layer")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--shared-prefix", type=int, default=None,
                    help="tokens the two prompts share at the start (default T/2; the cells "
                    "there cannot change the metric and are skipped by ours, not by TL)")
    args = ap.parse_args()
    import pandas as pd
    from fastapi.testclient import TestClient
    from transformer_lens import patching

    from attnscope.service.app import create_app
    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime
    from interventions_reference import gpt2_small_dir, tl_bridge

    load_before = os.getloadavg()
    d = gpt2_small_dir(Path(tempfile.mkdtemp()) / "gpt2small")
    settings = Settings(model=str(d), max_request_bytes=8 << 30, request_timeout_s=3600)
    rt = Runtime.load(settings)
    tl = tl_bridge(d)
    L, H, T = rt.adapter.n_layers, rt.adapter.n_heads, args.tokens
    layers = args.layers if args.layers is not None else [0, L - 1]
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(100, 2000, (T,), generator=g).tolist()
    keep = T // 2 if args.shared_prefix is None else args.shared_prefix
    corrupted = clean[:keep] + torch.randint(100, 2000, (T - keep,), generator=g).tolist()
    tgt, dis, pos = clean[-1], corrupted[-1], T - 2
    rng = np.random.default_rng(0)
    sample = {lyr: [(int(p), int(h)) for p, h in zip(rng.integers(0, T, args.tl_cells),
                                                     rng.integers(0, H, args.tl_cells))]
              for lyr in layers}
    _, cache = tl.run_with_cache(torch.tensor([clean]))

    def tl_metric(logits):
        return logits[0, pos, tgt] - logits[0, pos, dis]

    def ours(client, layer):
        r = client.post("/v1/patch", json={
            "clean_tokens": clean, "corrupted_tokens": corrupted, "hook": "z",
            "by_position": True, "patch_layers": [layer],
            "metric": {"kind": "logit_diff", "terms": [
                {"position": pos, "target": tgt, "distractor": dis}]}})
        assert r.status_code == 200, r.text
        raw = r.json()["grid"]["raw"]
        skipped.append(r.json()["grid"]["cells_skipped"])
        return np.array([[np.nan if v is None else v for v in row] for row in raw[layer]])

    def theirs(layer):
        df = pd.DataFrame([(layer, p, h) for p, h in sample[layer]],
                          columns=["layer", "pos", "head"])
        with torch.no_grad():
            return patching.get_act_patch_attn_head_out_by_pos(
                tl, torch.tensor([corrupted]), cache, tl_metric, index_axis_names=None,
                index_df=df).numpy()

    wall = {("ours", lyr): [] for lyr in layers} | {("tl", lyr): [] for lyr in layers}
    cpu = {k: [] for k in wall}
    diffs, skipped = [], []
    with TestClient(create_app(settings, runtime=rt)) as client:
        ours(client, L - 1)  # warm
        theirs(layers[0])
        for _ in range(args.runs):
            for lyr in layers:
                for name, fn in (("ours", lambda: ours(client, lyr)), ("tl", lambda: theirs(lyr))):
                    c0, t0 = time.process_time(), time.perf_counter()
                    out = fn()
                    wall[(name, lyr)].append(time.perf_counter() - t0)
                    cpu[(name, lyr)].append(time.process_time() - c0)
                    if name == "ours":
                        grid = out
                    else:
                        diffs.append(max(abs(grid[p, h] - v) for (p, h), v in
                                         zip(sample[lyr], out)))
    load_after = os.getloadavg()
    med = {f"{n}_L{lyr}": statistics.median(v) for (n, lyr), v in wall.items()}
    cmed = {f"{n}_L{lyr}": statistics.median(v) for (n, lyr), v in cpu.items()}
    tl_per_cell = statistics.mean(med[f"tl_L{lyr}"] / args.tl_cells for lyr in layers)
    res = {
        "model": "random GPT2Config() (12 layers, 12 heads, d_model 768, vocab 50257)",
        "tokens": T, "shared_prefix": keep, "cells_per_layer": T * H,
        "ours_cells_skipped_per_request": skipped[-len(layers):], "layers_measured": layers, "runs": args.runs,
        "wall_s": med, "thread_cpu_s": cmed, "tl_cells_per_layer": args.tl_cells,
        "tl_s_per_cell": tl_per_cell,
        "tl_full_grid_s_est": tl_per_cell * L * T * H,
        "max_abs_diff_sampled_cells": float(max(diffs)),
        "loadavg_before": load_before, "loadavg_after": load_after, "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    for lyr in layers:
        res[f"speedup_L{lyr}"] = tl_per_cell * T * H / med[f"ours_L{lyr}"]
    if 0 in layers and L - 1 in layers:
        res["ours_full_grid_s_est"] = L / 2 * (med["ours_L0"] + med[f"ours_L{L - 1}"])
        res["speedup_full_grid_est"] = res["tl_full_grid_s_est"] / res["ours_full_grid_s_est"]
    for k, v in res.items():
        print(f"{k:>28}: {v}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"patch_grid-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
