"""The chunked encoders write exactly the bytes of the implementation they replaced (issue 17).

``tests/encoding_v0.py`` is a frozen copy of ``service/encoding.py`` before the rewrite (eager
forms, per-row serialisation). For several shapes and every wire form, the new one-shot
``dumps`` and the streamed ``iter_json`` (with pieces small enough to split every array, row
and base64 text) must equal ``encoding_v0.dumps`` of the old form byte for byte; safetensors
files too. An independent check: tril JSON against plain ``orjson.dumps`` of Python lists.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import orjson
import pytest
import torch

import encoding_v0 as v0
from attnscope.service import encoding as enc

SHAPES = [(1, 1, 1, 1), (2, 3, 5, 5), (2, 4, 17, 17), (3, 33, 33), (1, 2, 64, 64), (70, 70)]


def _pattern(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=g) * 3 - 1
    T = shape[-1]
    x = x.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(x, -1), x  # pattern (causal), scores with -inf


def _forms():
    for fmt in ("flat", "coo"):
        for k, thr in ((1, None), (3, None), (None, 0.05), (4, 0.1), (None, 5e-324)):
            yield f"sparse-{fmt}-{k}-{thr}", dict(sparse=NS(top_k=k, threshold=thr, format=fmt))
    yield "json", {}
    yield "json-round3", dict(round_=3)
    yield "tril", dict(layout="tril")
    yield "tril-round4", dict(layout="tril", round_=4)


def _same_json(new, old, chunk):
    want = v0.dumps(old)
    assert enc.dumps(new) == want
    for c in (chunk, 1 << 20):
        got = b"".join(bytes(p) for p in enc.iter_json(new, c))
        assert got == want, c


@pytest.mark.parametrize("shape", SHAPES)
def test_every_form_same_bytes_as_v0(shape):
    pattern, scores = _pattern(shape, sum(shape))
    for name, kw in _forms():
        for encoding in ("json", "base64"):
            for dtype in ("float32", "float16"):
                if encoding == "json" and dtype == "float16":
                    continue
                args = (encoding, dtype, kw.get("round_"), "p")
                extra = {k: v for k, v in kw.items() if k != "round_"}
                new = enc.encode_tensor(pattern, *args, **extra)
                old = v0.encode_tensor(pattern, *args, **extra)
                body_new = {"model": {"id": "m"}, "results": [{"pattern": new, "n": 1}] * 2}
                body_old = {"model": {"id": "m"}, "results": [{"pattern": old, "n": 1}] * 2}
                _same_json(body_new, body_old, 64)
                if "sparse" not in kw:  # scores: masked -inf (null in JSON / -inf in base64)
                    new = enc.encode_tensor(scores, *args, allow_neg_inf=True, **extra)
                    old = v0.encode_tensor(scores, *args, allow_neg_inf=True, **extra)
                    _same_json({"s": new}, {"s": old}, 100)
            # binary: the whole safetensors file
            new = enc.encode_tensor(pattern, "binary", "float16", None, "p", **{
                k: v for k, v in kw.items() if k != "round_"})
            old = v0.encode_tensor(pattern, "binary", "float16", None, "p", **{
                k: v for k, v in kw.items() if k != "round_"})
            assert b"".join(map(bytes, enc.safetensors_parts({"x": new, "t": [1, 2]}))) == \
                b"".join(map(bytes, v0.safetensors_parts({"x": old, "t": [1, 2]})))


def test_tril_json_equals_plain_python_lists():
    pattern, _ = _pattern((2, 3, 9, 9), 1)
    a = np.round(pattern.numpy().astype(np.float64), 4)  # exact rounding (issue 29)
    got = enc.encode_tensor(pattern, "json", round_=4, layout="tril")
    data = orjson.loads(b"".join(enc.iter_json(got, 16)))["data"]
    assert [len(r) for r in data[1][2]] == list(range(1, 10))
    for i in range(2):
        for j in range(3):
            for q in range(9):  # the rounded decimals, written as their shortest repr
                assert np.array_equal(np.asarray(data[i][j][q]), a[i, j, q, : q + 1])


def test_mixed_bodies_same_bytes_as_v0():
    rng = np.random.default_rng(0)
    big = rng.random((3, 700), dtype=np.float32)
    body = {
        "tokens": [{"label": f"t{i}", "id": i, "offsets": [i, i + 1]} for i in range(1000)],
        "a": [big, "x" * 300, {1: big[0], "k": None}, list(range(5000))],
        "nested": [[rng.random((2, 40))] * 3] * 300,
        "s": "é\x00\"" * 400,
        "b64": v0._b64(big),
    }
    want = v0.dumps(body)
    body["b64"] = enc._b64(big)
    assert enc.dumps(body) == want
    for c in (50, 333, 4096, 1 << 20):
        assert b"".join(bytes(p) for p in enc.iter_json(body, c)) == want


def test_pieces_are_bounded():
    """No piece of a streamed body is much bigger than the chunk (memory holds ~one chunk)."""
    pattern, _ = _pattern((2, 4, 64, 64), 3)
    for kw in ({}, {"round_": 2}, {"layout": "tril"},
               {"sparse": NS(top_k=None, threshold=5e-324, format="coo")}):
        body = {"p": enc.encode_tensor(pattern, "json", **kw),
                "b": enc.encode_tensor(pattern, "base64")}
        sizes = [len(p) for p in enc.responses._pieces(body, 4096)]
        assert max(sizes) < 16 * 4096, (kw, max(sizes))  # JSON of <= 4096 bytes of float32


# ------------------------------------------------------------------ fast paths (issue 17 perf)
def _causal(shape, seed, scale):
    g = torch.Generator().manual_seed(seed)
    T = shape[-1]
    s = torch.randn(shape, generator=g) * scale
    return torch.softmax(s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1),
                                       float("-inf")), -1)


def _topk_cases(T):
    p = _causal((2, 3, T, T), T, 3.0)
    yield "causal", p
    q = p.clone()
    q[..., T // 3:, :] = torch.round(q[..., T // 3:, :] * 40) / 40  # ties across the k-th value
    yield "quantised", q
    r = p.clone()
    r[0, 0, T // 2:, :] = 0  # rows without a positive value
    r[1, 2, T - 3, :] = 1.0 / T  # one dense row: positive weights above the diagonal
    yield "zero-and-dense-rows", r
    yield "underflow", _causal((2, 3, T, T), T + 1, 80.0)  # exact zeros inside the triangle
    yield "dense", torch.softmax(torch.randn(2, T, T, generator=torch.Generator().manual_seed(T)), -1)
    yield "one-matrix", _causal((T, T), T + 2, 3.0)


@pytest.mark.parametrize("T", [131, 300])
def test_sparse_top_k_fast_path_same_bytes_as_v0(T):
    """The causal top-k (``codecs._top_k_causal``: np.partition over the causal part, torch.topk
    for rows with ties, too few positive weights or weights above the diagonal) writes what
    torch.topk over every row wrote, tie choices included: several blocks of 128 query rows,
    k below and above a block's height, with and without a threshold."""
    n_fast = 0
    for name, p in _topk_cases(T):
        rows = p.reshape(-1, T).contiguous()
        for k in ((1, 16, 129, T - 1) if T < 200 else (16, 129)):
            vals, keys = enc.codecs._top_k_causal(rows, list(p.shape), k, None, "p")
            v_ref, k_ref = enc.codecs._top_k_torch(rows, k, "p")
            n_fast += 1
            if name != "quantised":  # a quantised row's tied entries may be others
                assert np.array_equal(keys, k_ref) and np.array_equal(vals, v_ref), (name, k)
            for thr in (None, 0.01):
                for fmt in ("flat", "coo"):
                    o = NS(top_k=k, threshold=thr, format=fmt)
                    for encoding in ("json", "base64", "binary"):
                        new = enc.encode_sparse(p, o, encoding)
                        try:
                            old = v0.encode_sparse(p, o, encoding)
                        except TypeError:  # v0: an empty 'coo' base64 array (fixed since)
                            continue
                        if encoding == "binary":
                            assert b"".join(map(bytes, enc.safetensors_parts({"x": new}))) == \
                                b"".join(map(bytes, v0.safetensors_parts({"x": old}))), name
                        else:
                            assert enc.dumps(new) == v0.dumps(old), (name, k, thr, fmt, encoding)
    assert n_fast


def test_sparse_top_k_fast_path_is_taken():
    """The fast path is the one measured: on a causal pattern nearly every row skips topk."""
    p = _causal((2, 3, 300, 300), 1, 3.0)
    rows = p.reshape(-1, 300)
    calls = []
    real = enc.codecs._top_k_torch

    def spy(r, k, name):
        calls.append(r.shape[0])
        return real(r, k, name)

    enc.codecs._top_k_torch = spy
    try:
        enc.codecs._top_k_causal(rows, list(p.shape), 16, None, "p")
    finally:
        enc.codecs._top_k_torch = real
    assert calls == [6 * 15]  # the rows q < 15 of each matrix: fewer than 16 positive weights


@pytest.mark.parametrize("T", [1, 4, 7, 64, 129])
def test_tril_base64_lazy_pieces_same_bytes_as_v0(monkeypatch, T):
    """'tril' base64 is packed lazily (``codecs.TrilBase64``): one matrix per group here, so
    groups end on every byte offset mod 3 (the base64 carry), for float16 and float32."""
    monkeypatch.setattr(enc.codecs, "_TRIL_MIN_ROWS", 1)
    pattern, scores = _pattern((2, 3, T, T), T)
    for t, neg in ((pattern, False), (scores, True), (pattern * 70000, False)):
        for dtype in ("float16", "float32"):
            for encoding in ("base64", "binary"):
                def run(mod):
                    try:
                        x = mod.encode_tensor(t, encoding, dtype, None, "p", allow_neg_inf=neg,
                                              layout="tril")
                    except Exception as exc:  # noqa: BLE001 - the same refusal
                        return type(exc).__name__, str(exc)
                    return x
                new, old = run(enc), run(v0)
                if isinstance(old, tuple):
                    assert new == old
                    continue
                if encoding == "binary":
                    assert b"".join(map(bytes, enc.safetensors_parts({"x": new}))) == \
                        b"".join(map(bytes, v0.safetensors_parts({"x": old})))
                    continue
                want = v0.dumps({"x": old})
                assert enc.dumps({"x": new}) == want
                for c in (4, 50, 1000, 1 << 20):
                    assert b"".join(bytes(p) for p in enc.iter_json({"x": new}, c)) == want, c
