"""The recorded forward (``Runtime._forward_batch``) of git revision ``--old-rev`` against the
working tree's, interleaved in one process (issue 25 item 4: one forward path).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/recorded_forward.py --old-rev 312eb41^
        [--model bundled gpt2-small] [--lengths 128 1024] [--runs 5] [--threads 1]

The old ``_forward_batch`` is ``service/runtime/model.py`` at ``--old-rev`` (``git show``,
executed as a module of ``attnscope.service.runtime`` so its relative imports resolve to the
working tree's package), bound to the same loaded Runtime; at ``312eb41^`` (before issue 25 item
4) that is the forward through Hugging Face's modules with the in-place attention (one padded
batch).
The new one is the working tree's (a causal LM: service/runtime/hooked.py ``record``).

Models: ``bundled`` (the bundled GPT-2: 2 layers, d_model 128, n_ctx 256, so its lengths are
capped at 256), ``bundled-llama`` (the bundled Llama), ``family:<name>`` (tests/families.py's
random checkpoints: llama, mistral, qwen2, gemma, gemma2, gpt_neox; n_ctx 256), ``gpt2-small`` (a seeded random ``GPT2Config()``: 12 layers x 12 heads,
d_model 768, vocab 50257, n_ctx 1024; the bundled tokenizer). Cases per length T: one text of
T tokens; a batch of 4 texts of T tokens (equal lengths: the new path forwards them together);
a batch of 4 texts of T, T-8, T-16, T-24 tokens (old: one padded forward; new: one forward per
length). Each round runs both versions, the order alternating; the first round is a warm-up.
Prints per case the median wall time and the median CPU time of the calling thread, new/old,
the largest difference between the two versions' recorded tensors (0 = bit for bit) and, for a
batch, between the new path's batch and each text forwarded alone; and the machine's load
average before and after.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
#: the random checkpoints of tests/families.py (tiny: 2 layers, d_model 64), as "family:<name>"
FAMILY_CHOICES = [f"family:{f}" for f in
                  ("llama", "mistral", "qwen2", "gemma", "gemma2", "gpt_neox")]
FIELDS = ("pattern", "hidden_states", "q", "k", "v", "attn_input", "attn_output", "final_state")


def load_old(rev: str, tmp: Path):
    """``service/runtime/model.py`` at ``rev`` as ``attnscope.service.runtime._model_old``."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:service/runtime/model.py"],
                         check=True, capture_output=True, text=True).stdout
    path = tmp / "model_old.py"
    path.write_text(src)
    name = "attnscope.service.runtime._model_old"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "attnscope.service.runtime"
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def runtime(model: str, tmp: Path):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from attnscope.service.config import BUNDLED_MODEL_DIR, Settings
    from attnscope.service.runtime import Runtime

    if model == "gpt2-small":
        torch.manual_seed(0)
        path = tmp / "gpt2-small"
        GPT2LMHeadModel(GPT2Config(bos_token_id=0, eos_token_id=0)).save_pretrained(path)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(BUNDLED_MODEL_DIR / f, path / f)
        model = str(path)
    elif model.startswith("family:"):
        sys.path.insert(0, str(ROOT / "tests"))
        from families import family_checkpoint

        model = str(family_checkpoint(model.split(":", 1)[1], tmp))
    return Runtime.load(Settings(model=model, forward_batch_size=8))


def texts(rt, T: int, n: int, step: int) -> list[tuple[int, ...]]:
    """``n`` token-id tuples of ``T``, ``T - step``, ... tokens (distinct texts)."""
    words = ("the cat sat on the mat while a quick brown fox jumped over the lazy dog and "
             "everyone watched the river flow past the old mill near the bank").split()
    out = []
    for j in range(n):
        text = " ".join(words[(i * (j + 3)) % len(words)] for i in range(T + 8))
        ids = rt.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) >= T, (len(ids), T)
        out.append(tuple(ids[: T - j * step]))
    return out


def max_diff(a, b) -> float:
    import torch

    worst = 0.0
    for x, y in zip(a, b):
        for f in FIELDS:
            u, v = getattr(x, f), getattr(y, f)
            if u is None or v is None:
                assert u is None and v is None, f
                continue
            assert u.shape == v.shape and u.dtype == v.dtype, (f, u.shape, v.shape)
            if not torch.equal(u, v):
                worst = max(worst, float((u - v).abs().max()))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-rev", required=True,
                    help="e.g. 312eb41^: the last revision recording through HF's modules")
    ap.add_argument("--model", nargs="+", default=["bundled", "gpt2-small"],
                    choices=["bundled", "bundled-llama", "gpt2-small", *FAMILY_CHOICES])
    ap.add_argument("--lengths", nargs="+", type=int, default=[128, 1024])
    ap.add_argument("--runs", type=int, default=5, help="timed rounds per case (after 1 warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--cases", nargs="+", default=["one", "4 equal", "4 mixed"],
                    choices=["one", "4 equal", "4 mixed"])
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), old = {args.old_rev}, new = the working tree",
          flush=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        old = load_old(args.old_rev, tmp)
        for model in args.model:
            rt = runtime(model, tmp)
            versions = {"old": types.MethodType(old.Runtime._forward_batch, rt),
                        "new": rt._forward_batch}
            n_ctx = rt.adapter.n_ctx
            for T0 in args.lengths:
                T = min(T0, n_ctx)
                for case in args.cases:
                    batch = (texts(rt, T, 1, 0) if case == "one" else
                             texts(rt, T, 4, 0 if case == "4 equal" else 8))
                    wall = {k: [] for k in versions}
                    cpu = {k: [] for k in versions}
                    got = {}
                    for r in range(args.runs + 1):
                        for name in (("old", "new") if r % 2 else ("new", "old")):
                            got.pop(name, None)
                            gc.collect()
                            c0, t0 = time.thread_time(), time.perf_counter()
                            res = versions[name](batch)
                            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
                            if r:
                                wall[name].append(dt)
                                cpu[name].append(dc)
                            got[name] = res
                            del res
                    diff = max_diff(got["old"], got["new"])
                    del got
                    # the new path's batch against each text forwarded alone (new path)
                    alone = 0.0
                    if len(batch) > 1:
                        together = versions["new"](batch)
                        for x, t in zip(batch, together):
                            alone = max(alone, max_diff(versions["new"]([x]), [t]))
                        del together
                    w = {k: statistics.median(v) * 1e3 for k, v in wall.items()}
                    c = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
                    lens = ",".join(str(len(x)) for x in batch)
                    print(f"{model} T={lens} ({case}): wall old {w['old']:.1f} ms, new "
                          f"{w['new']:.1f} ms, new/old {w['new'] / w['old']:.3f}; thread CPU "
                          f"old {c['old']:.1f} ms, new {c['new']:.1f} ms, new/old "
                          f"{c['new'] / c['old']:.3f}; max |new - old| {diff:.3g}"
                          + (f", max |new batch - new alone| {alone:.3g}; " if len(batch) > 1
                             else "; ") +
                          f"{args.runs} runs; load {os.getloadavg()[0]:.2f}", flush=True)
            del rt, versions
            gc.collect()
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
