#!/usr/bin/env python
"""Long contexts end to end (issue 17): /v1/attention at T = 1024 on GPT-2-small shapes,
sparse top-16 (JSON) and 'tril' float16 (base64), with the client's decode, against the
in-process forward (Hugging Face, ``output_attentions``) of a fresh text of the same length.

The floor is ``GPT2Model`` (what the service runs, as bench/run.py); ``--floor lm_head`` times
``GPT2LMHeadModel`` instead, as this script did before: its LM head (logits for every position,
1024 x 50257) adds ~25% to the forward at T = 1024, so its ratios are that much lower.

Several servers in one run (``--server NAME=PYTHON``: each python runs ``attnscope serve``
from its own checkout, e.g. ``before=/work/main/.venv/bin/python``, and its responses are
decoded by that checkout's ``wire.py``); requests alternate
between them and each is paired with a floor forward run just before it, so the machine's
drifting load hits every server alike (their order rotated each round). Ratios: the median
of the per-request ratios to the paired floor, and median / median. Prints one JSON object and
a table.

    .venv/bin/python bench/long_context.py --server before=/work/main/.venv/bin/python \\
        --server after=.venv/bin/python --runs 3
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
from run import Texts, build_model, floor_once  # noqa: E402

from attnscope.client import wire  # noqa: E402

FORMS = {
    "sparse_top16_json": {"sparse": {"top_k": 16}},
    "tril_float16_base64": {"layout": "tril", "encoding": "base64", "dtype": "float16"},
}
#: the same two requests in their binary wire forms (``--binary``): sparse parts as base64 in
#: JSON, and the tril float16 pattern in a safetensors response (the client's ``binary=True``)
BINARY_FORMS = {
    "sparse_top16_base64": {"sparse": {"top_k": 16}, "encoding": "base64"},
    "tril_float16_safetensors": {"layout": "tril", "dtype": "float16", "_binary": True},
}


class Server:
    """``attnscope serve`` of the checkout whose ``python`` (``<root>/.venv/bin/python``) is
    given, on a free loopback port, started and ready (``/readyz`` 200); ``extra``: more
    ``serve`` arguments; ``launcher``: the command before ``serve`` (default ``python -m
    attnscope.service.cli``; e.g. a bench script's own child entry point)."""

    def __init__(self, python: str, model_dir: Path | str, log: Path,
                 extra: tuple[str, ...] = ("--request-timeout-s", "900"),
                 launcher: list[str] | None = None):
        import socket
        import subprocess

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [*(launcher or [python, "-m", "attnscope.service.cli"]), "serve", "--host", "127.0.0.1", "--port",
             str(self.port), "--model", str(model_dir), *extra, "--log-level", "warning"],
            stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=str(Path(python).parents[2]))
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(log.read_text()[-2000:])
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server not ready")

    def stop(self):
        import subprocess

        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def checkout_wire(python: str):
    """The client decoders (``wire.py``, numpy only) of the checkout whose ``python`` this is
    (``<root>/.venv/bin/python``), so each server's responses are decoded by its own client:
    a before/after run measures the client's decode too. This checkout's when it has none."""
    import importlib.util

    root = Path(python).parents[2]
    path = root / "clients" / "python" / "attnscope" / "client" / "wire.py"
    if not path.is_file():
        return wire
    spec = importlib.util.spec_from_file_location(f"wire_{abs(hash(str(root)))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


#: requests send ``add_bos: false``: the floor's T tokens exactly (with the GPT-2 default of a
#: prepended BOS a T = 1024 text is 1025 tokens, over n_ctx: a 422)


def decode(body: bytes, T: int, w=wire, binary: bool = False):
    if binary:  # the client's binary=True: safetensors, tensors as views of the body
        return w.decode_binary_response(body)["attention"]["pattern"]
    # the checkout's wire.loads where it has one (big base64 texts not parsed as JSON strings)
    p = getattr(w, "loads", orjson.loads)(body)["attention"]["pattern"]
    return w.sparse_to_dense(p) if p.get("encoding") == "sparse" else w.decode_tensor(p)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", action="append", required=True, help="NAME=PYTHON")
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--floor", choices=("model", "lm_head"), default="model",
                    help="the in-process forward: GPT2Model (default) or GPT2LMHeadModel")
    ap.add_argument("--binary", action="store_true",
                    help="also the binary wire forms (sparse base64, tril float16 safetensors)")
    args = ap.parse_args(argv)
    forms = {**FORMS, **(BINARY_FORMS if args.binary else {})}
    import torch
    from transformers import GPT2LMHeadModel

    tmp = Path(tempfile.mkdtemp(prefix="attnscope-long-"))
    model_dir = Path(args.model_dir) if args.model_dir else build_model(False, tmp / "gpt2-small")
    base = GPT2LMHeadModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    if args.floor == "model":
        base = base.transformer
    torch.set_grad_enabled(False)
    texts = Texts(model_dir)
    servers, wires = {}, {}
    for spec in args.server:
        name, python = spec.split("=", 1)
        servers[name] = Server(python, model_dir, tmp / f"{name}.log")
        wires[name] = checkout_wire(python)
    T = args.T
    res: dict = {n: {f: [] for f in forms} for n in servers}
    try:
        clients = {n: httpx.Client(base_url=s.url, timeout=900) for n, s in servers.items()}
        for n, c in clients.items():  # warm-up
            assert c.post("/v1/attention", json={"text": texts.make(T), "add_bos": False, **FORMS[
                "tril_float16_base64"]}).status_code == 200
        names = list(clients)
        for r in range(args.runs):
            order = names[r % len(names):] + names[: r % len(names)]  # rotated each round
            for form, opts in forms.items():
                opts = dict(opts)
                binary = opts.pop("_binary", False)
                headers = {"accept": wire.SAFETENSORS} if binary else {}
                for n in order:
                    c = clients[n]
                    fl = floor_once(base, texts, T)
                    t0 = time.perf_counter()
                    resp = c.post("/v1/attention", json={"text": texts.make(T), "add_bos": False, **opts},
                                  headers=headers)
                    t1 = time.perf_counter()
                    assert resp.status_code == 200, resp.text[:300]
                    arr = decode(resp.content, T, wires[n], binary)
                    t2 = time.perf_counter()
                    assert arr.shape[-1] == T
                    res[n][form].append({"floor_s": fl, "last_byte_s": t1 - t0,
                                         "with_decode_s": t2 - t0, "bytes": len(resp.content)})
                    del resp, arr
    finally:
        for s in servers.values():
            s.stop()
    summary: dict = {}
    for n, forms in res.items():
        for form, runs in forms.items():
            med = lambda k: statistics.median(x[k] for x in runs)  # noqa: E731
            ratio = statistics.median(x["with_decode_s"] / x["floor_s"] for x in runs)
            ratio_last = statistics.median(x["last_byte_s"] / x["floor_s"] for x in runs)
            summary.setdefault(n, {})[form] = {
                "floor_s": round(med("floor_s"), 3), "last_byte_s": round(med("last_byte_s"), 3),
                "with_decode_s": round(med("with_decode_s"), 3),
                "ratio_with_decode": round(ratio, 2), "ratio_last_byte": round(ratio_last, 2),
                "ratio_of_medians_with_decode": round(med("with_decode_s") / med("floor_s"), 2),
                "ratio_of_medians_last_byte": round(med("last_byte_s") / med("floor_s"), 2),
                "ratios_with_decode": [round(x["with_decode_s"] / x["floor_s"], 2) for x in runs],
                "each": [{k: round(x[k], 3) for k in ("floor_s", "last_byte_s", "with_decode_s")}
                         for x in runs],
                "bytes": int(med("bytes")), "runs": len(runs)}
    print(json.dumps({"T": T, "floor": args.floor, "summary": summary}, indent=1))
    for n, forms in summary.items():
        for form, v in forms.items():
            print(f"{n:8s} {form:24s} floor {v['floor_s']:.2f} s  last byte {v['last_byte_s']:.2f} s"
                  f" ({v['ratio_last_byte']}x; medians {v['ratio_of_medians_last_byte']}x)  with "
                  f"decode {v['with_decode_s']:.2f} s ({v['ratio_with_decode']}x; medians "
                  f"{v['ratio_of_medians_with_decode']}x)  {v['bytes'] / 2**20:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
