"""Train attnscope's bundled GPT-2-architecture checkpoint, offline, on 2 CPU cores.

Why: model weights cannot be downloaded on machines without the internet, so the project
ships its own small ``GPT2LMHeadModel`` (safetensors + its own byte-level BPE tokenizer),
which is what tests, CI and offline demos use.

Data: the King James Bible (public domain), from Debian's ``bible-kjv`` package
(``bible -f Gen1:1-Rev22:21``), verse references stripped. Half the optimisation steps use
sequences made of a seeded random token segment repeated 2-4 times after ``<|endoftext|>``,
with the loss on the repeats only: the usual way to grow induction heads in a 2-layer model
(Olsson et al. 2022, "In-context Learning and Induction Heads").

Run:  python training/train_bundled_gpt2.py --out service/bundled_model
It writes model.safetensors, config.json, the tokenizer files and ``training_record.json``
(seed, data hash, steps, final losses, held-out perplexity, per-head scores).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

EOT = "<|endoftext|>"


def load_kjv() -> str:
    raw = subprocess.run(
        ["bible", "-f", "Gen1:1-Rev22:21"], check=True, capture_output=True, text=True
    ).stdout
    lines = []
    for line in raw.splitlines():
        line = re.sub(r"^\S+\d+:\d+\s+", "", line).strip()
        if line:
            lines.append(line)
    return "\n".join(lines) + "\n"


def train_tokenizer(text: str, vocab_size: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GPT2TokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    hf = GPT2TokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=EOT,
        add_prefix_space=False, model_max_length=None,
    )
    return hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="service/bundled_model")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--text-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-repeats", type=int, default=4, help="copies of the random segment: 2..this")
    ap.add_argument("--max-segment", type=int, default=40, help="random segment length: 8..this")
    args = ap.parse_args()

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    text = load_kjv()
    data_sha = hashlib.sha256(text.encode()).hexdigest()
    tok = train_tokenizer(text, args.vocab, out)
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    n_hold = len(ids) // 50
    train_ids, hold_ids = ids[:-n_hold], ids[-n_hold:]
    eot_id = tok.convert_tokens_to_ids(EOT)
    print(f"data: {len(text)} chars, {len(ids)} tokens, sha256 {data_sha[:12]}", flush=True)

    config = GPT2Config(
        vocab_size=len(tok), n_positions=args.n_ctx, n_embd=args.d_model,
        n_layer=args.n_layer, n_head=args.n_head, bos_token_id=eot_id, eos_token_id=eot_id,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    warm = 100

    def lr_at(step: int) -> float:
        if step < warm:
            return args.lr * (step + 1) / warm
        p = (step - warm) / max(1, args.steps - warm)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    def text_batch():
        T = args.text_len
        starts = torch.randint(0, len(train_ids) - T - 1, (args.batch,), generator=gen)
        x = torch.stack([train_ids[s : s + T] for s in starts.tolist()])
        labels = x.clone()
        return x, labels

    def repeat_batch():
        seg = int(torch.randint(8, args.max_segment + 1, (1,), generator=gen))
        reps = int(torch.randint(2, args.max_repeats + 1, (1,), generator=gen))
        reps = min(reps, (args.n_ctx - 1) // seg)
        body = torch.randint(0, len(tok), (args.batch, seg), generator=gen)
        body[body == eot_id] = 0
        x = torch.cat([torch.full((args.batch, 1), eot_id)] + [body] * reps, dim=1)
        labels = x.clone()
        labels[:, : 1 + seg] = -100  # loss on the repeats only
        return x, labels

    model.train()
    losses = {"text": [], "repeat": []}
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        kind = "repeat" if step % 2 else "text"
        x, labels = repeat_batch() if kind == "repeat" else text_batch()
        loss = model(input_ids=x, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses[kind].append(loss.item())
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step} {kind} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)

    model.eval()
    model.set_attn_implementation("eager")  # sdpa returns no attention weights
    record = evaluate(model, tok, hold_ids, eot_id, args)
    record.update(
        seed=args.seed, steps=args.steps, args=vars(args), seconds=round(time.time() - t0, 1),
        data={"source": "Debian bible-kjv: `bible -f Gen1:1-Rev22:21`, verse refs stripped",
              "license": "public domain (King James Version)", "chars": len(text),
              "tokens": len(ids), "sha256": data_sha},
        final_loss={k: round(sum(v[-50:]) / len(v[-50:]), 4) for k, v in losses.items()},
        torch=torch.__version__,
    )
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "training_record.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


@torch.no_grad()
def evaluate(model, tok, hold_ids, eot_id, args) -> dict:
    T = args.text_len
    nll, n = 0.0, 0
    for s in range(0, len(hold_ids) - T - 1, T):
        x = hold_ids[s : s + T][None]
        nll += model(input_ids=x, labels=x).loss.item() * (T - 1)
        n += T - 1
    ppl = math.exp(nll / n)
    # previous-token score on held-out text: mean attention on the sub-diagonal
    x = hold_ids[:T][None]
    att = torch.stack(model(input_ids=x, output_attentions=True).attentions)[:, 0]
    prev = att.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)
    # induction probe: BOS + random segment of 25 tokens repeated 4 times
    g = torch.Generator().manual_seed(0)
    seg = 25
    body = torch.randint(0, len(tok), (seg,), generator=g)
    body[body == eot_id] = 0
    x = torch.cat([torch.tensor([eot_id])] + [body] * 4)[None]
    att = torch.stack(model(input_ids=x, output_attentions=True).attentions)[:, 0]
    q = torch.arange(1 + seg, x.shape[1])
    ind = att[:, :, q, q - seg + 1].mean(-1)
    return {
        "heldout_perplexity": round(ppl, 2),
        "previous_token_score": [[round(v, 3) for v in row] for row in prev.tolist()],
        "induction_probe_score": [[round(v, 3) for v in row] for row in ind.tolist()],
    }


if __name__ == "__main__":
    main()
