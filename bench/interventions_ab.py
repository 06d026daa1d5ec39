"""Intervention forwards of two versions of the runtime, interleaved in one process.

    .venv/bin/python bench/interventions_ab.py --old-rev REV [--lengths 16 64] [--runs 5]

``service/runtime/interventions.py`` at git revision ``REV`` (loaded from ``git show``; before
issue 25 item 4 it ran Hugging Face's own blocks from a cached residual stream) and of the
working tree (the hooked forward, ``hooked.run(start=, resid_pre=)``), called alternately on
the same loaded Runtime: a seeded random GPT-2-small model (``GPT2Config()``: 12 layers, 12
heads, d_model 768, vocab 50257) with the bundled tokenizer, one torch thread. Per T: the head
patching grid ``[layer, head]`` (12 batches of 12 variants, each from its layer), the
residual grid ``[layer, pos]`` (12 batches of T), with ``--per-position`` the per-position
head grid (12 batches of 12 T), the ablation scan and the recorded logits; metric the logit
difference at the last position. Prints per case the median wall and thread-CPU seconds, new/old, and
the max |new - old| of the results (float rounding: the two paths run the same operations,
the hooked one on the parameter tensors instead of the modules).

2026-12-03, ``--old-rev 27684da --lengths 16 64 --runs 3`` (load average 4-9 on 2 shared
cores: the thread CPU is the figure): new/old thread CPU 0.98-1.01 for every case (T = 64:
heads grid 9.57 -> 9.41 s, residual grid 56.1 -> 55.6 s, ablation scan 8.99 -> 8.91 s), every
result bit for bit equal (max |diff| 0).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]


def load_old(rev: str, tmp: Path):
    src = subprocess.run(["git", "-C", str(ROOT), "show",
                          f"{rev}:service/runtime/interventions.py"],
                         check=True, capture_output=True, text=True).stdout
    src = src.replace("from ..errors import", "from attnscope.service.errors import")
    path = tmp / "interventions_old.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("interventions_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["interventions_old"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def runtime(tmp: Path):
    import shutil

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from attnscope.service.config import BUNDLED_MODEL_DIR, Settings
    from attnscope.service.runtime import Runtime

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(bos_token_id=0, eos_token_id=0)).save_pretrained(tmp / "m")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL_DIR / f, tmp / "m" / f)
    return Runtime.load(Settings(model=str(tmp / "m")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-rev", required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--per-position", action="store_true",
                    help="also the per-position head grid (12 batches of 12 T variants: slow)")
    args = ap.parse_args()
    import torch

    from attnscope.service.analysis import interventions as A
    from attnscope.service.runtime import interventions as new

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        old = load_old(args.old_rev, tmp)
        rt = runtime(tmp)
    gen = torch.Generator().manual_seed(0)
    print(f"{'case':<22} {'T':>4} {'old_s':>8} {'new_s':>8} {'new/old':>8} "
          f"{'cpu old':>8} {'cpu new':>8} {'cpu n/o':>8} {'max|diff|':>10}", flush=True)
    for T in args.lengths:
        ids = torch.randint(0, 2048, (T,), generator=gen).tolist()
        ids_k = list(ids)
        ids_k[: T // 2] = torch.randint(0, 2048, (T // 2,), generator=gen).tolist()
        fc, fk = (rt.forward_many([rt.tokenized_from_ids(x)])[0].tensors for x in (ids, ids_k))
        tgt, dis, pos = ids[-1], ids_k[-1] if ids_k[-1] != ids[-1] else ids[-1] + 1, T - 1

        def metric(lg):
            return A.logit_diff(lg[:, 0], tgt, dis)

        cases = {
            "heads grid": lambda m: m.head_patch_grid(rt, fc, fk, metric, [pos]),
            "residual grid": lambda m: m.resid_patch_grid(rt, fc, fk, metric, [pos]),
            "ablation scan": lambda m: m.ablation_scan(
                rt, fk, m.ablation_value("mean", fk), metric, [pos]),
            "recorded logits": lambda m: m.recorded_logits(rt, fk),
        }
        if args.per_position:
            cases["per-position grid"] = lambda m: m.head_patch_grid(rt, fc, fk, metric, [pos],
                                                                     True)
        for name, fn in cases.items():
            wall = {"old": [], "new": []}
            cpu = {"old": [], "new": []}
            out = {}
            for i in range(args.runs):
                for tag, mod in (("old", old), ("new", new)) if i % 2 == 0 else \
                        (("new", new), ("old", old)):
                    t0, c0 = time.perf_counter(), time.thread_time()
                    out[tag] = fn(mod)
                    wall[tag].append(time.perf_counter() - t0)
                    cpu[tag].append(time.thread_time() - c0)
            w = {k: statistics.median(v) for k, v in wall.items()}
            c = {k: statistics.median(v) for k, v in cpu.items()}
            diff = float((out["new"].float() - out["old"].float()).abs().max())
            print(f"{name:<22} {T:>4} {w['old']:>8.3f} {w['new']:>8.3f} "
                  f"{w['new'] / w['old']:>8.3f} {c['old']:>8.3f} {c['new']:>8.3f} "
                  f"{c['new'] / c['old']:>8.3f} {diff:>10.2e}", flush=True)


if __name__ == "__main__":
    main()
