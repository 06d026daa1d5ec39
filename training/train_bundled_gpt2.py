"""Train attnscope's bundled GPT-2-architecture checkpoint, offline, on 2 CPU cores.

Why: model weights cannot be downloaded on machines without the internet, so the project
ships its own small ``GPT2LMHeadModel`` (safetensors + its own byte-level BPE tokenizer),
which is what tests, CI and offline demos use.

Data and recipe (shared with ``train_bundled_llama.py``, in ``bundled_common.py``): the King
James Bible (public domain), from Debian's ``bible-kjv`` package (``bible -f
Gen1:1-Rev22:21``), verse references stripped. Half the optimisation steps use sequences made
of a seeded random token segment repeated 2-4 times after ``<|endoftext|>``, with the loss on
the repeats only: the usual way to grow induction heads in a 2-layer model (Olsson et al.
2022, "In-context Learning and Induction Heads").

Run:  python training/train_bundled_gpt2.py --out service/bundled_model
It writes model.safetensors, config.json, the tokenizer files and ``training_record.json``
(seed, data hash, steps, final losses, held-out perplexity, per-head scores).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bundled_common import Corpus, add_training_args, finish, load_kjv, train, train_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="service/bundled_model")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    add_training_args(ap)
    args = ap.parse_args()

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    text = load_kjv()
    tok = train_tokenizer(text, args.vocab, out)
    corpus = Corpus(text, tok)

    config = GPT2Config(
        vocab_size=len(tok), n_positions=args.n_ctx, n_embd=args.d_model,
        n_layer=args.n_layer, n_head=args.n_head, bos_token_id=corpus.eot_id,
        eos_token_id=corpus.eot_id, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    losses = train(model, corpus, args, t0)
    finish(model, tok, corpus, losses, args, t0, out)


if __name__ == "__main__":
    main()
