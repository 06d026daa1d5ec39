#!/usr/bin/env python
"""Issue 11's T = 128 targets for several servers in one run (before / after a change).

For each server (``--server NAME=PYTHON``: each python runs ``attnscope serve`` from its own
checkout, e.g. ``before=/work/main/.venv/bin/python``), on GPT-2-small shapes (a random
``GPT2Config()`` model, bench/run.py ``build_model``):

* ``base64_f16``: ``/v1/attention`` base64 float16 end to end with the client's decode
  (``orjson.loads`` + ``wire.decode_tensor`` of the server's own checkout), each request
  paired with an in-process floor forward (``GPT2Model`` with ``output_attentions=True``, as
  bench/run.py) run just before it;
  at steady state: each server's forward cache is first filled with T-token texts
  (bench/run.py ``fill_cache``), so every new forward replaces an evicted one;
* ``analyses``: attention + heads + links + trajectories of one fresh text in sequence vs
  ``/v1/attention`` of another fresh text alone (target: <= 1.2x), and ``/v1/verify`` of
  that text on its own. ``heads`` is sent with ``add_bos: false``, the other three's tokens:
  its default (true) prepends BOS, i.e. another text and another forward.

Rounds alternate between the servers (their order rotated each round), so the machine's
drifting load hits each alike. Ratios: the median of the per-request ratios to the paired
floor, and median / median. Prints one JSON object and a table.

    .venv/bin/python bench/compare.py --server before=/work/main/.venv/bin/python \\
        --server after=.venv/bin/python --runs 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_context import Server, checkout_wire  # noqa: E402
from run import Texts, build_model, fill_cache, floor_once  # noqa: E402


B64 = {"encoding": "base64", "dtype": "float16"}
#: the four analyses of one text (the target), in order; verify is measured on its own
FOUR = {
    "attention": ("/v1/attention", B64),
    "heads": ("/v1/heads", {"add_bos": False}),
    "links": ("/v1/links", {"layer": 0}),
    "trajectories": ("/v1/trajectories", {}),
}
VERIFY = ("/v1/verify", {})


def _post(c: httpx.Client, path: str, body: dict) -> httpx.Response:
    r = c.post(path, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{path} -> {r.status_code}: {r.text[:300]}")
    return r


def base64_round(c: httpx.Client, base, texts: Texts, T: int, wire) -> dict:
    fl = floor_once(base, texts, T)
    t0 = time.perf_counter()
    r = _post(c, "/v1/attention", {"text": texts.make(T), **B64})
    t1 = time.perf_counter()
    a = wire.decode_tensor(orjson.loads(r.content)["attention"]["pattern"])
    t2 = time.perf_counter()
    assert a.shape[-1] == T
    return {"floor_s": fl, "last_byte_s": t1 - t0, "with_decode_s": t2 - t0,
            "bytes": len(r.content)}


def analyses_round(c: httpx.Client, texts: Texts, T: int) -> dict:
    t0 = time.perf_counter()
    _post(c, "/v1/attention", {"text": texts.make(T), **B64}).content
    alone = time.perf_counter() - t0
    text = texts.make(T)
    per = {}
    t0 = time.perf_counter()
    for name, (path, opts) in FOUR.items():
        t1 = time.perf_counter()
        _post(c, path, {"text": text, **opts}).content
        per[name] = time.perf_counter() - t1
    seq = time.perf_counter() - t0
    t1 = time.perf_counter()
    _post(c, VERIFY[0], {"text": text, **VERIFY[1]}).content
    per["verify"] = time.perf_counter() - t1
    return {"alone_s": alone, "four_s": seq, "per_s": per}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", action="append", required=True, help="NAME=PYTHON")
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--runs", type=int, default=10, help="rounds per section")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--no-fill", action="store_true", help="skip filling the caches")
    args = ap.parse_args(argv)
    import torch
    from transformers import GPT2LMHeadModel

    tmp = Path(tempfile.mkdtemp(prefix="attnscope-compare-"))
    model_dir = Path(args.model_dir) if args.model_dir else build_model(False, tmp / "gpt2-small")
    base = GPT2LMHeadModel.from_pretrained(model_dir, attn_implementation="eager").eval().transformer
    torch.set_grad_enabled(False)
    texts = Texts(model_dir)
    T = args.T
    servers, wires = {}, {}
    for spec in args.server:
        name, python = spec.split("=", 1)
        servers[name] = Server(python, model_dir, tmp / f"{name}.log")
        wires[name] = checkout_wire(python)
    names = list(servers)
    b64: dict = {n: [] for n in names}
    an: dict = {n: [] for n in names}
    fills = {}
    try:
        clients = {n: httpx.Client(base_url=s.url, timeout=900) for n, s in servers.items()}
        for n, c in clients.items():  # warm-up: every endpoint once
            text = texts.make(T)
            for path, opts in [*FOUR.values(), VERIFY]:
                _post(c, path, {"text": text, **opts})
            if not args.no_fill:
                fills[n] = fill_cache(servers[n].url, texts, T, 1 << 30)
        for r in range(args.runs):
            order = names[r % len(names):] + names[: r % len(names)]
            for n in order:
                b64[n].append(base64_round(clients[n], base, texts, T, wires[n]))
            for n in order:
                an[n].append(analyses_round(clients[n], texts, T))
    finally:
        for s in servers.values():
            s.stop()
    med = statistics.median
    summary: dict = {}
    for n in names:
        rs = b64[n]
        a = an[n]
        summary[n] = {
            "base64_f16": {
                "floor_s": round(med(x["floor_s"] for x in rs), 4),
                "last_byte_s": round(med(x["last_byte_s"] for x in rs), 4),
                "with_decode_s": round(med(x["with_decode_s"] for x in rs), 4),
                "ratio_with_decode": round(med(x["with_decode_s"] / x["floor_s"] for x in rs), 3),
                "ratio_last_byte": round(med(x["last_byte_s"] / x["floor_s"] for x in rs), 3),
                "ratio_of_medians_with_decode": round(
                    med(x["with_decode_s"] for x in rs) / med(x["floor_s"] for x in rs), 3),
                "bytes": int(med(x["bytes"] for x in rs)), "runs": len(rs)},
            "analyses": {
                "alone_s": round(med(x["alone_s"] for x in a), 4),
                "four_s": round(med(x["four_s"] for x in a), 4),
                "ratio": round(med(x["four_s"] / x["alone_s"] for x in a), 3),
                "ratio_of_medians": round(med(x["four_s"] for x in a) / med(x["alone_s"] for x in a), 3),
                "per_s": {k: round(med(x["per_s"][k] for x in a), 4) for k in a[0]["per_s"]},
                "runs": len(a)},
            "fill": fills.get(n),
        }
    print(json.dumps({"T": T, "summary": summary}, indent=1, default=str))
    for n, v in summary.items():
        b, a = v["base64_f16"], v["analyses"]
        print(f"{n:8s} T={T} base64 f16: floor {b['floor_s'] * 1e3:.1f} ms, last byte "
              f"{b['ratio_last_byte']}x, with decode {b['ratio_with_decode']}x "
              f"(medians {b['ratio_of_medians_with_decode']}x)  [target <= 1.10x]")
        print(f"{n:8s} T={T} attention+heads+links+trajectories {a['four_s'] * 1e3:.1f} ms vs "
              f"one alone {a['alone_s'] * 1e3:.1f} ms = {a['ratio']}x (medians "
              f"{a['ratio_of_medians']}x) [target <= 1.2x]; per analysis: "
              + ", ".join(f"{k} {s * 1e3:.1f} ms" for k, s in a["per_s"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
