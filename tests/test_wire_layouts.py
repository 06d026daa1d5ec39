"""Layouts of /v1/attention tensors on the wire: sparse (top_k / threshold, flat and coo, row_mass)
and the lower triangle (tril), each compared with the dense pattern or an independent numpy rule,
in JSON, base64 and safetensors; bad sparse/tril options are 422 envelopes.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import orjson
import pytest
import torch

from attnscope.client import wire
from attnscope.service import encoding

from conftest import SENTENCE, assert_error as _err


ST = "application/x-safetensors"
TEXT = "The cat sat on the mat."
TEXTS = [TEXT, "Hi", "A much longer sentence about nothing in particular here."]


def _expected_sparse(p: np.ndarray, top_k, thr) -> np.ndarray:
    """Reference: per row the top_k largest (ties: lower key first), >= thr, never zeros."""
    out = np.zeros_like(p)
    for idx in np.ndindex(p.shape[:-1]):
        row = p[idx]
        keep = row > 0
        if thr is not None:
            keep &= row >= thr
        if top_k is not None:
            m = np.zeros_like(keep)
            m[np.argsort(-row, kind="stable")[:top_k]] = True
            keep &= m
        out[idx] = np.where(keep, row, 0)
    return out


@pytest.fixture(scope="module")
def dense(client):
    """Dense float32 pattern [L, H, T, T] of each of TEXTS (json, full precision)."""
    out = []
    for t in TEXTS:
        r = client.post("/v1/attention", json={"text": t})
        assert r.status_code == 200, r.text
        out.append(np.asarray(r.json()["attention"]["pattern"], dtype=np.float32))
    return out


@pytest.mark.regression
@pytest.mark.parametrize("top_k,thr", [(1, None), (3, None), (65536, None), (None, 0.1),
                                       (None, 1.0), (None, 1e-45), (2, 0.2), (65536, 0.05)])
@pytest.mark.parametrize("fmt", ["flat", "coo"])
@pytest.mark.parametrize("enc,accept", [("json", None), ("base64", None), ("json", ST)])
def test_sparse_equals_dense_and_row_mass(client, dense, top_k, thr, fmt, enc, accept):
    sp = {k: v for k, v in (("top_k", top_k), ("threshold", thr)) if v is not None}
    sp["format"] = fmt
    body = {"texts": TEXTS[:2], "sparse": sp, "encoding": enc, "head_mean": top_k == 2,
            "include_scores": True}
    r = client.post("/v1/attention", json=body, headers={"accept": accept} if accept else {})
    assert r.status_code == 200, r.text
    if accept:
        assert r.headers["content-type"] == ST
        results = wire.decode_binary_response(r.content)["results"]
    else:
        results = r.json()["results"]
    for i, res in enumerate(results):
        ref = dense[i].mean(1) if body["head_mean"] else dense[i]
        exp = _expected_sparse(ref, top_k, thr)
        parts = wire.sparse_parts(res["pattern"])
        got = wire.sparse_to_dense({**res["pattern"], **{k: parts[k] for k in
                                                         ("indices", "values")}})
        np.testing.assert_allclose(got, exp, atol=1e-6)
        np.testing.assert_allclose(np.asarray(parts["row_mass"]), exp.sum(-1), atol=1e-5)
        assert res["pattern"]["nnz"] == int((exp > 0).sum())
        scores = res["scores"] if accept else wire.decode_tensor(res["scores"])
        assert scores.shape == ref.shape  # scores stay dense


def _good(c, headers=None):
    r = c.post("/v1/attention", json={"text": "hello world", "layers": [0]}, headers=headers or {})
    assert r.status_code == 200, r.text


@pytest.mark.regression
@pytest.mark.parametrize("sp,param", [
    ({"top_k": 0}, "sparse.top_k"), ({"top_k": -1}, "sparse.top_k"),
    ({"top_k": 65537}, "sparse.top_k"), ({"top_k": True}, "sparse.top_k"),
    ({"top_k": "3"}, "sparse.top_k"), ({"threshold": 0}, "sparse.threshold"),
    ({"threshold": 1.5}, "sparse.threshold"), ({"threshold": -0.1}, "sparse.threshold"),
    ({"threshold": "NaN"}, "sparse.threshold"), ({"threshold": "Infinity"}, "sparse.threshold"),
    ({}, "sparse"), ({"top_k": 1, "format": "csr"}, "sparse.format"),
])
def test_sparse_bad_options_are_422(client, sp, param):
    e = _err(client.post("/v1/attention", json={"text": TEXT, "sparse": sp}), 422,
             "validation_error", param)
    assert param.split(".")[-1] in e["message"]
    _good(client)


@pytest.mark.regression
def test_sparse_literal_nan_threshold_is_422(client):
    r = client.post("/v1/attention", content=b'{"text": "hi", "sparse": {"threshold": NaN}}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    _good(client)


@pytest.mark.regression
@pytest.mark.parametrize("enc,dtype,accept", [("json", "float32", None), ("base64", "float16", None),
                                              ("base64", "float32", ST), ("json", "float16", ST)])
def test_tril_equals_dense(client, dense, enc, dtype, accept):
    body = {"texts": TEXTS, "layout": "tril", "encoding": enc, "dtype": dtype,
            "include_scores": True, "round": 6}
    r = client.post("/v1/attention", json=body, headers={"accept": accept} if accept else {})
    assert r.status_code == 200, r.text
    results = (wire.decode_binary_response(r.content) if accept else r.json())["results"]
    tol = 1e-3 if dtype == "float16" and (enc != "json" or accept) else 1e-6
    for i, res in enumerate(results):
        p = res["pattern"] if accept else wire.decode_tensor(res["pattern"])
        np.testing.assert_allclose(p.astype(np.float32), dense[i], atol=tol)
        s = res["scores"] if accept else wire.decode_tensor(res["scores"])
        T = s.shape[-1]
        assert np.isneginf(s[..., np.triu(np.ones((T, T), bool), 1)]).all()
        assert np.isfinite(s[..., np.tril(np.ones((T, T), bool))]).all()


@pytest.mark.regression
@pytest.mark.parametrize("extra", [{}, {"encoding": "base64"}, {"sparse": {"top_k": 2}},
                                   {"texts": TEXTS, "text": None}])
def test_tril_on_encoder_is_422(bert_client, extra):
    body = {"text": TEXT, "layout": "tril", **extra}
    body = {k: v for k, v in body.items() if v is not None}
    e = _err(bert_client.post("/v1/attention", json=body), 422, "validation_error", "layout")
    assert "causal" in e["message"]
    r = bert_client.post("/v1/attention", json={"text": TEXT, "layers": [0]})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ base64 round trips
LONG = "The" + " cat sat on the mat." * 31  # 249 tokens: > 4 MB of base64 with scores


def _fw(rt, text, add_bos=None):
    """The runtime's forward on the tokens the response reports: ``add_bos`` None is the
    request default, the model's convention (GPT-2: BOS first; encoders: their framing)."""
    return rt.forward_many([rt.tokenize(text, rt.default_add_bos if add_bos is None else add_bos)])[0]


@pytest.mark.regression
def test_base64_streamed_batch_and_sparse(client, gpt2_runtime):
    texts = [LONG, LONG[:300], LONG]
    r = client.post("/v1/attention", json={"texts": texts, "encoding": "base64",
                                           "sparse": {"top_k": 7, "format": "coo"}})
    assert r.status_code == 200, r.text
    for text, res in zip(texts, r.json()["results"]):
        fw = _fw(gpt2_runtime, text)
        assert [t["id"] for t in res["tokens"]] == list(fw.tokens.input_ids)
        p = fw.pattern.numpy()
        dense = wire.sparse_to_dense(res["pattern"])
        order = np.argsort(-p, axis=-1, kind="stable")[..., :7]
        expect = np.zeros_like(p)
        np.put_along_axis(expect, order, np.take_along_axis(p, order, -1), -1)
        assert np.array_equal(dense, expect)


def _expect_sparse(p: np.ndarray, k: int, thr: float | None) -> np.ndarray:
    """Independent rule (encode_sparse docstring): per row the k largest, ties to the lower
    key_pos, zeros never kept, then the threshold."""
    order = np.argsort(-p, axis=-1, kind="stable")[..., :k]
    kept = np.take_along_axis(p, order, -1)
    ok = kept > 0
    if thr is not None:
        ok &= kept >= thr
    out = np.zeros_like(p)
    np.put_along_axis(out, order, np.where(ok, kept, 0), -1)
    return out


@pytest.mark.regression
def test_binary_response_with_sparse_parts(client, gpt2_runtime):
    r = client.post("/v1/attention", json={"text": SENTENCE, "sparse": {"top_k": 3},
                                           "include_scores": True},
                    headers={"accept": "application/x-safetensors"})
    assert r.status_code == 200, r.text
    body = wire.decode_binary_response(r.content)
    fw = _fw(gpt2_runtime, SENTENCE)
    att = body["attention"]
    p = fw.pattern.numpy()
    assert np.array_equal(wire.sparse_to_dense(att["pattern"]), _expect_sparse(p, 3, None))
    s, sw = att["scores"], fw.scores().numpy()
    assert np.array_equal(np.isneginf(s), np.isneginf(sw))
    assert np.array_equal(s[np.isfinite(sw)], sw[np.isfinite(sw)])


@pytest.mark.regression
def test_bert_sparse_and_base64(bert_client, bert_runtime):
    r = bert_client.post("/v1/attention", json={"text": SENTENCE, "encoding": "base64",
                                                "sparse": {"top_k": 4, "threshold": 0.01}})
    assert r.status_code == 200, r.text
    p = _fw(bert_runtime, SENTENCE).pattern.numpy()
    dense = wire.sparse_to_dense(r.json()["attention"]["pattern"])
    order = np.argsort(-p, axis=-1, kind="stable")[..., :4]
    kept = np.take_along_axis(p, order, -1)
    expect = np.zeros_like(p)
    np.put_along_axis(expect, order, np.where(kept >= 0.01, kept, 0), -1)
    assert np.array_equal(dense, expect)
    r = bert_client.post("/v1/attention", json={"text": SENTENCE, "encoding": "base64"})
    assert np.array_equal(wire.decode_tensor(r.json()["attention"]["pattern"]), p)


# ------------------------------------------------------------------ sparse top-k
@pytest.mark.regression
@pytest.mark.parametrize("K,k", [(40, 2), (41, 3), (64, 4), (203, 5), (1024, 16), (40, 39),
                                 (7, 7), (9, 12), (2, 1)])
def test_sparse_top_k_with_ties_keeps_a_true_top_k(K, k):
    """Among entries exactly equal to a row's k-th largest weight, which ones are kept is
    torch.topk's choice (documented in encode_sparse; a rule such as 'lower key_pos first'
    cost +50% of the encode at T = 1024). What is checked: every kept entry is the pattern's
    own value at its own key, the kept values are exactly the k largest (as a multiset, zeros
    and sub-threshold values dropped), nothing kept is smaller than anything dropped, and
    row_mass is the kept mass. Ties: uniform rows, quantised rows, ties at the top."""
    g = torch.Generator().manual_seed(K)
    x = torch.rand(6, K, generator=g)
    x[0] = 1.0 / K  # all tied
    x[1] = torch.randint(0, 3, (K,), generator=g).float() / 4  # many ties incl. zeros
    x[2, K // 2:] = x[2].max()  # ties at the top in the second half only
    x[3] = torch.where(torch.rand(K, generator=g) < 0.5, 0.25, 0.0)
    x = x.reshape(2, 3, K)
    p = x.numpy()
    for thr in (None, 0.2):
        sp = encoding.encode_sparse(x, NS(top_k=k, threshold=thr, format="flat"), "base64")
        sp = orjson.loads(encoding.dumps(sp))
        got = wire.sparse_to_dense(sp)
        exp = _expect_sparse(p, k, thr)  # one valid choice among ties (lower key_pos)
        kept = got != 0
        assert np.array_equal(got[kept], p[kept])  # own values at own keys
        assert np.array_equal(np.sort(got, -1), np.sort(exp, -1))  # the same multiset per row
        dropped_max = np.where(kept, -np.inf, p).max(-1)
        kept_min = np.where(kept, p, np.inf).min(-1)
        assert np.all((kept_min >= dropped_max) | ~kept.any(-1))
        mass = wire.decode_tensor(sp["row_mass"])
        np.testing.assert_allclose(mass, exp.astype(np.float64).sum(-1), rtol=1e-6)


@pytest.mark.regression
@pytest.mark.parametrize("K", [12, 64, 1023])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_sparse_top_k_refuses_nan_inf_anywhere_in_the_row(K, bad):
    x = torch.rand(3, K)
    x[1, K // 3] = bad  # a small row elsewhere
    x[2, :] = 0.0
    x[2, -1] = bad
    for k in (1, 2, K - 1, K, K + 5):
        for thr in (None, 0.5):
            with pytest.raises(encoding.NonFiniteValues):
                encoding.encode_sparse(x, NS(top_k=k, threshold=thr, format="coo"), "json")


@pytest.mark.regression
@pytest.mark.parametrize("which", ["gpt2", "bert"])
@pytest.mark.parametrize("sel", [{}, {"head_mean": True}, {"layers": [1], "heads": [2, 0]},
                                 {"layers": [0], "head_mean": True}])
@pytest.mark.parametrize("sparse", [{"top_k": 1}, {"top_k": 3, "threshold": 0.2},
                                    {"top_k": 10_000}, {"threshold": 0.3, "format": "coo"}])
def test_sparse_selections_both_models(client, bert_client, gpt2_runtime, bert_runtime,
                                       which, sel, sparse):
    c, rt = (client, gpt2_runtime) if which == "gpt2" else (bert_client, bert_runtime)
    texts = ["a b c d e f g", "Seven tokens here, maybe more or less."]  # T odd / not % 4
    r = c.post("/v1/attention", json={"texts": texts, "encoding": "base64", "sparse": sparse,
                                      **sel})
    if sparse.get("top_k", 0) > 1000:
        assert r.status_code in (200, 422), r.text
        if r.status_code == 422:
            return
    assert r.status_code == 200, r.text
    for text, res in zip(texts, r.json()["results"]):
        fw = _fw(rt, text)
        assert [t["id"] for t in res["tokens"]] == list(fw.tokens.input_ids)
        p = fw.pattern
        if "layers" in sel:
            p = p[sel["layers"]]
        if "heads" in sel:
            p = p[:, sel["heads"]]
        if sel.get("head_mean"):
            p = p.mean(1)
        exp = _expect_sparse(p.numpy(), sparse.get("top_k") or p.shape[-1],
                             sparse.get("threshold"))
        assert np.array_equal(wire.sparse_to_dense(res["pattern"]), exp)
        parts = wire.sparse_parts(res["pattern"])
        np.testing.assert_allclose(parts["row_mass"], exp.astype(np.float64).sum(-1), rtol=1e-6)
