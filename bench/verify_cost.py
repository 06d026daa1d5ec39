"""What /v1/verify costs against the forward it checks (issue 12: "say how many forwards").

    .venv/bin/python bench/verify_cost.py [--lengths 16 128] [--runs 5] [--device cpu]

On a randomly initialised GPT-2-small-shaped model (``GPT2Config()``, vocab 2,048 with the
bundled tokenizer, built in memory) and on the bundled checkpoint: the median time of one
recorded forward (``Runtime.forward_many``, cache cleared), of verify ``from_scratch`` (the
float64 recomputation and every comparison, with the served logits as the endpoint checks them:
one hooked forward and ``W_U`` in float64; ``no_logits``: without them) and of ``recorded_qkv``,
and their ratios to the forward. ``--vocab 50257``: GPT-2's vocabulary (the logits' cost).
Timings on a shared machine are noisy: compare figures of one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from attnscope.service.analysis.verify_recorded import AttentionParams
from attnscope.service.analysis.verify import ScratchModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from attnscope.service.analysis.verify import verify_from_scratch
    from attnscope.service.analysis.verify_recorded import verify as verify_recorded
    from attnscope.service.config import BUNDLED_MODEL_DIR, Settings
    from attnscope.service.runtime import interventions as I
    from attnscope.service.runtime import Runtime
    from attnscope.service.runtime.adapters import ADAPTERS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=2048, help="the random model's vocabulary (GPT-2: 50257)")
    args = ap.parse_args()
    settings = Settings(model="bundled", device=args.device)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=args.vocab, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "eager"
    big = GPT2LMHeadModel(cfg).eval().to(args.device)
    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    runtimes = {
        "gpt2-small-random": Runtime(big, tok, ADAPTERS["gpt2"](big), {"id": "gpt2-small-random",
                                     "revision": "none", "dtype": "float32"}, settings),
        "bundled": Runtime.load(settings),
    }
    g = torch.Generator().manual_seed(1)
    print(f"{'model':<18} {'T':>5} {'forward_s':>10} {'scratch_s':>10} {'x fwd':>6} "
          f"{'no_logits_s':>11} {'x fwd':>6} {'recorded_s':>10} {'x fwd':>6}")
    for name, rt in runtimes.items():
        m = ScratchModel.of(rt.adapter)
        params = {i: AttentionParams.of(rt.adapter, i) for i in range(rt.adapter.n_layers)}
        for T in args.lengths:
            fwd, scr, rec, nol = [], [], [], []
            for r in range(args.runs + 1):  # the first run warms up
                ids = torch.randint(1, 2048, (T,), generator=g).tolist()
                tt = rt.tokenized_from_ids(ids)
                rt.cache.clear()
                t0 = time.perf_counter()
                fw = rt.forward_many([tt])[0]
                t1 = time.perf_counter()
                # as the endpoint: the served logits (one hooked forward) checked too
                v = verify_from_scratch(fw.tensors, m, tt.input_ids, "float32",
                                        logits=I.served_logits(rt, tt.input_ids))
                t2 = time.perf_counter()
                verify_recorded(fw.tensors, params)
                t3 = time.perf_counter()
                verify_from_scratch(fw.tensors, m, tt.input_ids, "float32")
                t4 = time.perf_counter()
                assert v["passed"] and v["logits"] is not None, v["message"]
                if r:
                    fwd.append(t1 - t0), scr.append(t2 - t1), rec.append(t3 - t2)
                    nol.append(t4 - t3)
            f, s, q, n = (statistics.median(x) for x in (fwd, scr, rec, nol))
            print(f"{name:<18} {T:>5} {f:>10.4f} {s:>10.4f} {s / f:>6.1f} {n:>11.4f} {n / f:>6.1f} "
                  f"{q:>10.4f} {q / f:>6.1f}", flush=True)


if __name__ == "__main__":
    main()
