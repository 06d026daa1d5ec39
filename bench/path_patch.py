"""Path-patching benchmark (issue 27 item 2): every sender head x every receiver head input
(q, k, v) of a later layer on the bundled model, ``POST /v1/path-patch`` with ``grid: true``
(in-process app, through HTTP) against TransformerLens 4.3 doing the same in-process, in one
run, alternating (ours, TL, ours, TL, ...).

    .venv/bin/python bench/path_patch.py                 # 1 pair, 5 runs each
    .venv/bin/python bench/path_patch.py --pairs 8 --runs 3

TransformerLens: a TransformerBridge of the bundled directory (``no_processing``,
``use_attn_result``, ``use_split_qkv_input``), the loop a researcher writes (Wang et al.'s
three steps; ARENA's IOI path patching): per pair both runs cached once, then per sender head
one forward with every other head's ``hook_result`` and every MLP's ``hook_mlp_out`` frozen at
the base run's values (the receivers' inputs cached), then per cell one forward of the base
prompt with that receiver head's input set. The metric: mean loss over the repeated half of an
induction text (BOS + 8 random tokens twice; corrupted: another first half).

Prints wall seconds (median), thread CPU seconds, the grids' max abs difference, the machine's
load average before and after, and writes JSON to bench/results/path_patch-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pairs_of(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        seg = rng.choice(np.arange(100, 2000), 8, replace=False).tolist()
        alt = rng.choice(np.arange(100, 2000), 8, replace=False).tolist()
        out.append(([0] + seg + seg, [0] + alt + seg))
    return out


SECOND = list(range(9, 16))
METRIC = {"kind": "loss", "terms": [{"position": p} for p in SECOND]}


def ours(client, pairs) -> np.ndarray:
    r = client.post("/v1/path-patch", json={
        "pairs": [{"clean_tokens": c, "corrupted_tokens": k} for c, k in pairs],
        "grid": True, "metric": METRIC})
    assert r.status_code == 200, r.text
    raw = np.array(r.json()["grid"]["raw"], dtype=object)[0, :, 1]  # [sender head, recv, input]
    return raw.astype(float)


def tl_grid(tl, pairs, L: int, H: int) -> np.ndarray:
    """[sender head of layer 0, receiver head of layer 1, q/k/v], mean over pairs."""
    out = np.zeros((len(pairs), H, H, 3))
    with torch.no_grad():
        for j, (clean, corrupt) in enumerate(pairs):
            bt, ot = torch.tensor([clean]), torch.tensor([corrupt])
            _, cb = tl.run_with_cache(bt)
            _, co = tl.run_with_cache(ot)
            for hs in range(H):
                def freeze(name, sender=None):
                    def hook(t, hook):
                        t[:] = cb[name]
                        if sender is not None:
                            t[:, :, sender] = co[name][:, :, sender]
                        return t
                    return hook
                hooks = [(f"blocks.{lyr}.attn.hook_result",
                          freeze(f"blocks.{lyr}.attn.hook_result", hs if lyr == 0 else None))
                         for lyr in range(L)]
                hooks += [(f"blocks.{lyr}.hook_mlp_out", freeze(f"blocks.{lyr}.hook_mlp_out"))
                          for lyr in range(L)]
                with tl.hooks(fwd_hooks=hooks):
                    _, c2 = tl.run_with_cache(bt, names_filter=lambda n: n.startswith(
                        "blocks.1.hook_") and n.endswith("_input"))
                for hr in range(H):
                    for ki, k in enumerate("qkv"):
                        name = f"blocks.1.hook_{k}_input"

                        def setr(t, hook, name=name, hr=hr):
                            t[:, :, hr] = c2[name][:, :, hr]
                            return t
                        logits = tl.run_with_hooks(bt, fwd_hooks=[(name, setr)])
                        lp = torch.log_softmax(logits[0], -1)
                        out[j, hs, hr, ki] = float(-torch.stack(
                            [lp[p, clean[p + 1]] for p in SECOND]).mean())
    return out.mean(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    from fastapi.testclient import TestClient
    from transformer_lens.model_bridge import TransformerBridge

    from attnscope.service.app import create_app
    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime

    load_before = os.getloadavg()
    rt = Runtime.load(Settings(model="bundled"))
    bundled = ROOT / "service" / "bundled_model"
    tl = TransformerBridge.boot_transformers(str(bundled), device="cpu")
    tl.enable_compatibility_mode(no_processing=True, disable_warnings=True)
    tl.set_use_attn_result(True)
    tl.set_use_split_qkv_input(True)
    L, H = rt.adapter.n_layers, rt.adapter.n_heads
    pairs = pairs_of(args.pairs)
    times = {"ours": [], "tl": []}
    cpu = {"ours": [], "tl": []}
    with TestClient(create_app(Settings(model="bundled"), runtime=rt)) as client:
        a, b = ours(client, pairs), tl_grid(tl, pairs, L, H)  # warm both
        for _ in range(args.runs):
            for name, fn in (("ours", lambda: ours(client, pairs)),
                             ("tl", lambda: tl_grid(tl, pairs, L, H))):
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    load_after = os.getloadavg()
    cells = H * H * 3
    res = {
        "model": "bundled (2 layers, 4 heads, d_model 128, vocab 2048)", "tokens": 17,
        "pairs": args.pairs, "cells": cells, "runs": args.runs,
        "ours_wall_s": statistics.median(times["ours"]), "tl_wall_s": statistics.median(times["tl"]),
        "ours_cpu_s": statistics.median(cpu["ours"]), "tl_cpu_s": statistics.median(cpu["tl"]),
        "max_abs_diff": float(np.abs(a - b).max()),
        "loadavg_before": load_before, "loadavg_after": load_after, "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    res["speedup_wall"] = res["tl_wall_s"] / res["ours_wall_s"]
    for k, v in res.items():
        print(f"{k:>16}: {v}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"path_patch-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
