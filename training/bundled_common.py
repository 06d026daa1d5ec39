"""What the bundled checkpoints' recipes share: the corpus, the tokenizer, the two kinds of
batch, the learning-rate schedule, the training loop, the evaluation and the record.

Used by ``train_bundled_gpt2.py`` (GPT-2) and ``train_bundled_llama.py`` (Llama); the
architecture is the only thing each script chooses.

Data: the King James Bible (public domain), from Debian's ``bible-kjv`` package
(``bible -f Gen1:1-Rev22:21``), verse references stripped. Half the optimisation steps use
sequences made of a seeded random token segment repeated 2-4 times after ``<|endoftext|>``,
with the loss on the repeats only: the usual way to grow induction heads in a 2-layer model
(Olsson et al. 2022, "In-context Learning and Induction Heads").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

EOT = "<|endoftext|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
#: the induction probe: BOS + this many random tokens (torch.Generator seed 0), 4 copies
PROBE_SEGMENT, PROBE_COPIES, PROBE_SEED = 25, 4, 0


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


def add_training_args(ap: argparse.ArgumentParser) -> None:
    """The options every recipe has (defaults: the bundled GPT-2's)."""
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--text-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-repeats", type=int, default=4, help="copies of the random segment: 2..this")
    ap.add_argument("--max-segment", type=int, default=40, help="random segment length: 8..this")


class Corpus:
    """The tokenized KJV: ``ids`` [n_tokens], the last 2% held out (``hold_ids``)."""

    def __init__(self, text: str, tok):
        self.text = text
        self.sha256 = hashlib.sha256(text.encode()).hexdigest()
        self.ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
        n_hold = len(self.ids) // 50
        self.train_ids, self.hold_ids = self.ids[:-n_hold], self.ids[-n_hold:]
        self.eot_id = tok.convert_tokens_to_ids(EOT)
        self.vocab = len(tok)
        print(f"data: {len(text)} chars, {len(self.ids)} tokens, sha256 {self.sha256[:12]}",
              flush=True)

    def record(self) -> dict:
        return {"source": "Debian bible-kjv: `bible -f Gen1:1-Rev22:21`, verse refs stripped",
                "license": "public domain (King James Version)", "chars": len(self.text),
                "tokens": len(self.ids), "sha256": self.sha256}


def train(model, corpus: Corpus, args, t0: float) -> dict:
    """AdamW (betas 0.9/0.95, weight decay 0.01), 100 warm-up steps then cosine to 0.1 lr,
    gradients clipped at 1; even steps a batch of text, odd steps a batch of repeated random
    segments. Returns the losses per kind."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    warm = 100
    train_ids, eot_id = corpus.train_ids, corpus.eot_id

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
        body = torch.randint(0, corpus.vocab, (args.batch, seg), generator=gen)
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
        if step % 100 in (0, 1) or step == args.steps - 1:
            print(f"step {step} {kind} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
    return losses


def induction_probe_ids(vocab: int, eot_id: int) -> torch.Tensor:
    """BOS + a random segment of PROBE_SEGMENT tokens (Generator seed PROBE_SEED) repeated
    PROBE_COPIES times: [1 + PROBE_SEGMENT * PROBE_COPIES] token ids."""
    g = torch.Generator().manual_seed(PROBE_SEED)
    body = torch.randint(0, vocab, (PROBE_SEGMENT,), generator=g)
    body[body == eot_id] = 0
    return torch.cat([torch.tensor([eot_id])] + [body] * PROBE_COPIES)


def previous_token_score(attentions) -> torch.Tensor:
    """[layer, head] = mean over query_pos of the weight on key_pos = query_pos - 1 (the
    previous token). ``attentions``: eager patterns, a tuple of [1, head, query_pos, key_pos]
    per layer."""
    att = torch.stack(attentions)[:, 0]  # [layer, head, query_pos, key_pos]
    return att.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)


def induction_score(attentions, seg: int = PROBE_SEGMENT) -> torch.Tensor:
    """On the induction probe (a segment of ``seg`` tokens repeated after BOS): [layer, head] =
    mean over the repeated query positions q of the weight on key_pos q - seg + 1, the token
    after the current token's previous occurrence (Olsson et al. 2022)."""
    att = torch.stack(attentions)[:, 0]  # [layer, head, query_pos, key_pos]
    q = torch.arange(1 + seg, att.shape[-1])
    return att[:, :, q, q - seg + 1].mean(-1)


@torch.no_grad()
def evaluate(model, corpus: Corpus, args) -> dict:
    """Held-out perplexity (windows of text_len) and the per-head scores, [layer][head]:
    previous-token on the first text_len held-out tokens, induction on the probe, and
    previous-token on the probe (random tokens: no prose statistics to lean on)."""
    T = args.text_len
    hold_ids = corpus.hold_ids
    nll, n = 0.0, 0
    for s in range(0, len(hold_ids) - T - 1, T):
        x = hold_ids[s : s + T][None]
        nll += model(input_ids=x, labels=x).loss.item() * (T - 1)
        n += T - 1
    ppl = math.exp(nll / n)
    x = hold_ids[:T][None]
    prev = previous_token_score(model(input_ids=x, output_attentions=True).attentions)
    x = induction_probe_ids(corpus.vocab, corpus.eot_id)[None]
    att = model(input_ids=x, output_attentions=True).attentions
    ind = induction_score(att)
    prev_probe = previous_token_score(att)
    return {
        "heldout_perplexity": round(ppl, 2),
        "previous_token_score": [[round(v, 3) for v in row] for row in prev.tolist()],
        "induction_probe_score": [[round(v, 3) for v in row] for row in ind.tolist()],
        "previous_token_probe_score": [[round(v, 3) for v in row] for row in prev_probe.tolist()],
    }


def finish(model, tok, corpus: Corpus, losses: dict, args, t0: float, out: Path,
           extra: dict | None = None, tokenizer_from: Path | None = None) -> dict:
    """Evaluate (eager attention), save the model (safetensors), the tokenizer (``tok`` saved,
    or the files of ``tokenizer_from`` copied byte for byte) and ``training_record.json``;
    returns the record."""
    model.eval()
    model.set_attn_implementation("eager")  # sdpa returns no attention weights
    record = evaluate(model, corpus, args)
    record.update(
        seed=args.seed, steps=args.steps, args=vars(args), seconds=round(time.time() - t0, 1),
        data=corpus.record(),
        final_loss={k: round(sum(v[-50:]) / len(v[-50:]), 4) for k, v in losses.items()},
        torch=torch.__version__,
    )
    record["probes"] = {
        "previous_token_ids": corpus.hold_ids[: args.text_len].tolist(),
        "induction_ids": induction_probe_ids(corpus.vocab, corpus.eot_id).tolist(),
        "induction_segment": PROBE_SEGMENT,
    }
    record.update(extra or {})
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer_from is None:
        tok.save_pretrained(out)
    else:
        for name in TOKENIZER_FILES:
            shutil.copyfile(Path(tokenizer_from) / name, out / name)
    (out / "training_record.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return record


def command_line() -> str:
    """The command that ran this script, as typed from the repository root."""
    return " ".join([".venv/bin/python", *sys.argv])
