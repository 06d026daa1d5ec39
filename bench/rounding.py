"""Rounded JSON: how many values land past half a unit of the last kept decimal (issue 29).

    .venv/bin/python bench/rounding.py [--tokens 1024] [--round 4] [--source model|synthetic]

The pattern ``[layer, head, query_pos, key_pos]`` of a randomly initialised GPT-2-small-shaped
model (``GPT2Config()``: 12 layers x 12 heads, vocab 50,257, seed 0; eager attention, random
token ids, one forward on the CPU) at ``--tokens`` (1024: 151M values), or ``--source
synthetic``: a seeded random pattern of that shape (softmax of normal scores per row, causal),
when the forward is too slow. Each ``[query_pos, key_pos]`` matrix is encoded the old way
(``np.round`` on the float32 array, as codecs.py did before issue 29, in the
codec's pieces) and by the codec
(``codecs.RoundedArray``: exact rounding from float64, the way every rounded tensor is sent),
the JSON text is read back, and a value counts as a violation when its decimal ``D`` is
farther than ``0.5 * 10**-round`` from the TRUE float32 value ``x`` (checked exactly:
``x * 10**round`` is exact in float64, ``D * 10**round`` is an integer), and as "long" when
its text carries more than ``round`` decimals (``0.0020999999`` for ``0.0021``). Also the
encoding time of each rule (orjson included), summed over the matrices.
"""

from __future__ import annotations

import argparse
import os
import re
import time

import numpy as np
import orjson

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def model_pattern(T: int) -> np.ndarray:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_positions=max(1024, T))
    cfg._attn_implementation = "eager"
    model = GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    return torch.stack([a[0] for a in out.attentions]).numpy()  # [L, H, T, T] float32


def synthetic_pattern(T: int, L: int = 12, H: int = 12) -> np.ndarray:
    rng = np.random.default_rng(0)
    out = np.empty((L, H, T, T), np.float32)
    mask = np.triu(np.ones((T, T), bool), 1)
    for l in range(L):
        for h in range(H):
            s = rng.standard_normal((T, T), dtype=np.float32) * 2
            s[mask] = -np.inf
            s = np.exp(s - s.max(-1, keepdims=True))
            out[l, h] = s / s.sum(-1, keepdims=True)
    return out


def check(text: bytes, x: np.ndarray, d: int) -> tuple[int, int]:
    """(violations, long texts) of the JSON ``text`` of rounded ``x`` (one matrix)."""
    D = np.asarray(orjson.loads(text), np.float64)
    scale = 10.0 ** d
    k = np.rint(D * scale)  # the decimal's last-place integer
    exact = x.astype(np.float64) * scale  # exact: 24-bit significand x 5**d (d <= 10)
    viol = int(np.count_nonzero(np.abs(exact - k) > 0.5))
    long_ = len(re.findall(rb"\.\d{%d,}|e-" % (d + 1), text))
    return viol, long_


def main() -> None:
    from attnscope.service.encoding.codecs import PIECE_BYTES, RoundedArray, array_pieces

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--round", type=int, default=4)
    ap.add_argument("--source", choices=["model", "synthetic"], default="model")
    args = ap.parse_args()
    T, d = args.tokens, args.round
    t0 = time.perf_counter()
    pat = model_pattern(T) if args.source == "model" else synthetic_pattern(T)
    print(f"source: {args.source} (GPT-2-small shape {list(pat.shape)}, {pat.size:,} values, "
          f"{time.perf_counter() - t0:.1f} s), round = {d}")
    rules = {
        "before (np.round on float32)": lambda m: b"".join(
            array_pieces(m, PIECE_BYTES, lambda x: np.round(x, d))),
        "after (codecs.RoundedArray)": lambda m: b"".join(RoundedArray(m, d).pieces()),
    }
    for name, enc in rules.items():
        viol = long_ = 0
        spent = 0.0
        for m in pat.reshape(-1, T, T):
            t = time.perf_counter()
            text = enc(m)
            spent += time.perf_counter() - t
            v, lg = check(text, m, d)
            viol += v
            long_ += lg
        print(f"{name:30s} violations {viol:>6} of {pat.size:,}   long decimals {long_:>6}   "
              f"encode {spent:.2f} s")


if __name__ == "__main__":
    main()
