"""Train attnscope's bundled Llama-architecture checkpoint, offline, on 2 CPU cores.

Why: the modern attention path (rotary position embeddings, grouped-query attention, RMSNorm,
SwiGLU) needs a trained checkpoint offline, with real heads to find, as the GPT-2 path has
``service/bundled_model``. This is a ``LlamaForCausalLM``: 2 layers, d_model 128, 4 query
heads of 32 dimensions sharing 2 key/value heads, RoPE (theta 10,000, on every dimension),
RMSNorm, a SwiGLU MLP, tied embeddings.

Recipe: exactly the bundled GPT-2's (``bundled_common.py``): the same corpus (the King James
Bible from Debian's ``bible-kjv``), the same bundled 2,048-token tokenizer (its files copied
from ``service/bundled_model``), the same interleaved text / repeated-random-segment batches
(induction data), schedule, seed and evaluation.

Run (from the repository root; the committed checkpoint's command, in its record):
    .venv/bin/python training/train_bundled_llama.py --out service/bundled_llama \
        --steps 2400 --threads 1
It writes model.safetensors, config.json, generation_config.json, the tokenizer files and
``training_record.json`` (seed, command, data hash, steps, final losses, held-out perplexity,
per-head scores and the probes' token ids).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bundled_common import Corpus, add_training_args, command_line, finish, load_kjv, train

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = ROOT / "service" / "bundled_model"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="service/bundled_llama")
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-kv-head", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-mlp", type=int, default=352, help="SwiGLU hidden size (~8/3 d_model)")
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    add_training_args(ap)
    # the committed checkpoint's run: 2,400 steps on one thread (a shared, busy machine)
    ap.set_defaults(steps=2400, threads=1)
    args = ap.parse_args()

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    corpus = Corpus(load_kjv(), tok)

    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=args.d_model, intermediate_size=args.d_mlp,
        num_hidden_layers=args.n_layer, num_attention_heads=args.n_head,
        num_key_value_heads=args.n_kv_head, hidden_act="silu",
        max_position_embeddings=args.n_ctx, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        tie_word_embeddings=True, bos_token_id=corpus.eot_id, eos_token_id=corpus.eot_id,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config)
    losses = train(model, corpus, args, t0)
    finish(model, tok, corpus, losses, args, t0, out, tokenizer_from=TOKENIZER_DIR,
           extra={"command": command_line(), "architecture": "LlamaForCausalLM"})


if __name__ == "__main__":
    main()
