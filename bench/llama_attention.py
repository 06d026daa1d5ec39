#!/usr/bin/env python
"""Issue 28's benchmark: the T = 128 attention overhead on a random Llama with Llama-3.2-1B-like
shapes, against issue 11's GPT-2 target (bench/compare.py ``base64_f16``): ``/v1/attention``
base64 float16 end to end with the client's decode <= 1.10x the in-process forward.

The model: a random ``LlamaConfig`` with Llama-3.2-1B's widths (d_model 2048, 32 query heads /
8 key/value heads of d_head 64, SwiGLU MLP 8192, vocab 128256, rope theta 5e5, untied
embeddings) and ``--layers`` layers (default 4 of its 16: 16 would be ~1.2B float32 parameters,
~5 GB per process, twice over with the server; this machine's 23 GiB are shared). Saved with
``save_pretrained(safe_serialization=True)`` and the bundled 2,048-token tokenizer (ids < 2,048).

Measured as compare.py does it, in one run: a real ``attnscope serve`` of the model; per round
A = the floor, an in-process ``LlamaModel`` forward (eager, ``output_attentions=True``, the
attentions to numpy; the part of the model the service runs) of a fresh T-token text, and
B = ``/v1/attention`` of another fresh T-token text (``add_bos: false``, same T), base64
float16, to the last byte and then ``orjson.loads`` + ``wire.decode_tensor`` to numpy. A and B
alternate in order each round; the ratio is the median of the per-round B/A and, separately,
median(B) / median(A). The 1-minute load average is printed per round (2 shared cores).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/llama_attention.py --layers 4 --runs 12
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_context import Server  # noqa: E402
from run import Texts, fill_cache  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPES = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
              intermediate_size=8192, vocab_size=128256, rope_theta=500000.0,
              max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
              bos_token_id=0, eos_token_id=0)


def build(layers: int, out: Path) -> Path:
    import torch
    import transformers as tf

    from attnscope.service.config import BUNDLED_MODEL_DIR

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(num_hidden_layers=layers, **SHAPES)
    model = tf.LlamaForCausalLM(cfg).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL_DIR / name, out / name)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--no-fill", action="store_true", help="skip filling the forward cache")
    ap.add_argument("--model-dir", default=None)
    args = ap.parse_args(argv)
    import torch
    import transformers as tf

    from attnscope.client import wire

    tmp = Path(tempfile.mkdtemp(prefix="attnscope-llama-bench-"))
    try:
        model_dir = Path(args.model_dir) if args.model_dir else build(args.layers, tmp / "llama")
        full = tf.LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
        base = full.model
        del full.lm_head
        n_params = sum(p.numel() for p in full.parameters())
        torch.set_grad_enabled(False)
        texts = Texts(model_dir)
        T = args.T
        server = Server(sys.executable, model_dir, tmp / "server.log")
        body = {"encoding": "base64", "dtype": "float16", "add_bos": False}

        def floor() -> float:
            ids = torch.tensor([texts.tok(texts.make(T), add_special_tokens=False)["input_ids"]])
            assert ids.shape[1] == T
            t0 = time.perf_counter()
            with torch.inference_mode():
                o = base(input_ids=ids, output_attentions=True)
                _ = [a.numpy() for a in o.attentions]
            return time.perf_counter() - t0

        def served(c: httpx.Client) -> tuple[float, float, int]:
            t0 = time.perf_counter()
            r = c.post("/v1/attention", json={"text": texts.make(T), **body})
            t1 = time.perf_counter()
            if r.status_code != 200:
                raise RuntimeError(f"/v1/attention -> {r.status_code}: {r.text[:300]}")
            a = wire.decode_tensor(orjson.loads(r.content)["attention"]["pattern"])
            t2 = time.perf_counter()
            assert a.shape == (args.layers, SHAPES["num_attention_heads"], T, T), a.shape
            return t1 - t0, t2 - t0, len(r.content)

        rounds = []
        try:
            with httpx.Client(base_url=server.url, timeout=900) as c:
                info = c.get("/v1/model").json()
                served(c), floor()  # warm-up
                fill = None if args.no_fill else fill_cache(server.url, texts, T, 1 << 30)
                for i in range(args.runs):
                    if i % 2 == 0:
                        fa = floor()
                        lb, wd, nb = served(c)
                    else:
                        lb, wd, nb = served(c)
                        fa = floor()
                    load = os.getloadavg()[0]
                    rounds.append({"floor_s": fa, "last_byte_s": lb, "with_decode_s": wd,
                                   "bytes": nb, "load1": load})
                    print(f"round {i:2d}: floor {fa * 1e3:7.1f} ms  served last byte "
                          f"{lb * 1e3:7.1f} ms  with decode {wd * 1e3:7.1f} ms  "
                          f"= {wd / fa:.3f}x  load {load:.2f}", flush=True)
        finally:
            server.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = statistics.median
    s = {
        "model": {"layers": args.layers, **SHAPES, "params_without_lm_head": n_params,
                  "n_kv_heads_served": info.get("n_kv_heads")},
        "T": T, "runs": len(rounds), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "floor_s": med(r["floor_s"] for r in rounds),
        "last_byte_s": med(r["last_byte_s"] for r in rounds),
        "with_decode_s": med(r["with_decode_s"] for r in rounds),
        "ratio_with_decode": med(r["with_decode_s"] / r["floor_s"] for r in rounds),
        "ratio_last_byte": med(r["last_byte_s"] / r["floor_s"] for r in rounds),
        "ratio_of_medians_with_decode": med(r["with_decode_s"] for r in rounds)
        / med(r["floor_s"] for r in rounds),
        "bytes": int(med(r["bytes"] for r in rounds)),
        "load1": [round(r["load1"], 2) for r in rounds], "fill": fill,
    }
    print(json.dumps(s, indent=1, default=str))
    print(f"T={T} random Llama ({args.layers} layers, d_model 2048, 32q/8kv heads): base64 f16 "
          f"floor {s['floor_s'] * 1e3:.1f} ms, last byte {s['ratio_last_byte']:.3f}x, with decode "
          f"{s['ratio_with_decode']:.3f}x (medians {s['ratio_of_medians_with_decode']:.3f}x) "
          f"[target <= 1.10x]; load {min(s['load1']):.2f}-{max(s['load1']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
