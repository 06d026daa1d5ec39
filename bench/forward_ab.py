"""The recorded forward of two versions of the runtime, interleaved in one process.

    .venv/bin/python bench/forward_ab.py --old-rev REV [--model bundled|gpt2-small] [--runs 40]

``Runtime._forward_batch`` of ``service/runtime/model.py`` at git revision ``REV`` (loaded from
``git show``) and of the working tree, bound to the same loaded Runtime and called alternately
through ``Runtime.forward_many`` (cache cleared before each call) on a 128-token text alone and
padded with a 77-token one; one torch thread. Prints, per case, the median wall time and the
median CPU time of the calling thread (less disturbed by other processes on a shared machine),
and new/old; then checks that both versions record bitwise-equal tensors. ``gpt2-small``: a
seeded random GPT-2-small-shaped model (vocab 2,048, the bundled tokenizer), built in memory.
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
import types
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("pattern", "hidden_states", "q", "k", "v", "attn_input", "attn_output", "final_state")


def load_old(rev: str, tmp: Path):
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:service/runtime/model.py"],
                         check=True, capture_output=True, text=True).stdout
    path = tmp / "model_old.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("model_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["model_old"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def runtime(model: str, tmp: Path):
    import shutil

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from attnscope.service.config import BUNDLED_MODEL_DIR, Settings
    from attnscope.service.runtime import Runtime

    if model == "gpt2-small":
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(vocab_size=2048, bos_token_id=0, eos_token_id=0)) \
            .save_pretrained(tmp / "gpt2-small")
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(BUNDLED_MODEL_DIR / f, tmp / "gpt2-small" / f)
        model = str(tmp / "gpt2-small")
    return Runtime.load(Settings(model=model))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-rev", required=True)
    ap.add_argument("--model", default="bundled", choices=["bundled", "gpt2-small"])
    ap.add_argument("--runs", type=int, default=40)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        old = load_old(args.old_rev, tmp)
        rt = runtime(args.model, tmp)
    versions = {"old": types.MethodType(old.Runtime._forward_batch, rt), "new": rt._forward_batch}
    words = ("the cat sat on the mat while a quick brown fox jumped over the lazy dog and "
             "everyone watched the river flow past the old mill near the bank").split()
    ids = rt.tokenize(" ".join(words[i % len(words)] for i in range(110))).input_ids[:128]
    one, short = rt.tokenized_from_ids(list(ids)), rt.tokenized_from_ids(list(ids[:77]))
    recorded = {}
    for case, items in (("T=128", [one]), ("T=128+77 padded", [one, short])):
        wall = {k: [] for k in versions}
        cpu = {k: [] for k in versions}
        for r in range(args.runs + 3):  # 3 warm-up rounds; the order alternates every round
            for name in (("old", "new") if r % 2 else ("new", "old")):
                rt._forward_batch = versions[name]
                rt.cache.clear()
                c0, t0 = time.thread_time(), time.perf_counter()
                res = rt.forward_many(items)
                dt, dc = time.perf_counter() - t0, time.thread_time() - c0
                if r >= 3:
                    wall[name].append(dt)
                    cpu[name].append(dc)
                recorded[(case, name)] = [fr.tensors for fr in res]
        w = {k: statistics.median(v) * 1e3 for k, v in wall.items()}
        c = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
        print(f"{args.model} {case}: wall median old {w['old']:.2f} ms, new {w['new']:.2f} ms "
              f"(new/old {w['new'] / w['old']:.3f}); thread CPU median old {c['old']:.2f} ms, "
              f"new {c['new']:.2f} ms (new/old {c['new'] / c['old']:.3f}); {args.runs} runs each")
        for a, b in zip(recorded[(case, "old")], recorded[(case, "new")]):
            for f in FIELDS:
                x, y = getattr(a, f), getattr(b, f)
                same = (x is None and y is None) or (
                    x is not None and y is not None and x.dtype == y.dtype and torch.equal(x, y))
                if not same:
                    print(f"  DIFFERENT: {case} {f}")
                    sys.exit(1)
        print(f"  recorded tensors bitwise equal ({len(FIELDS)} fields x {len(items)} texts)")
    del rt._forward_batch


if __name__ == "__main__":
    main()
