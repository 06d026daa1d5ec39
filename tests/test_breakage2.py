"""Regression tests, round 2: wire forms of /v1/attention, Accept negotiation, the memory limit
of an app built around an existing Runtime, API keys, X-Request-ID and CORS preflights.

Each hostile request must get a 4xx envelope naming the field (or a documented 200), never a
500, and the next good request must succeed. Decoding uses the numpy decoders of
clients/python/attnscope/client/wire.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import assert_error as _err

from attnscope.client import wire

TEXT = "The cat sat on the mat."
TEXTS = [TEXT, "Hi", "A much longer sentence about nothing in particular here."]
ST = "application/x-safetensors"


def _good(c, headers=None):
    r = c.post("/v1/attention", json={"text": "hello world", "layers": [0]}, headers=headers or {})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def dense(client):
    """Dense float32 pattern [L, H, T, T] of each of TEXTS (json, full precision)."""
    out = []
    for t in TEXTS:
        r = client.post("/v1/attention", json={"text": t})
        assert r.status_code == 200, r.text
        out.append(np.asarray(r.json()["attention"]["pattern"], dtype=np.float32))
    return out


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


def test_sparse_literal_nan_threshold_is_422(client):
    r = client.post("/v1/attention", content=b'{"text": "hi", "sparse": {"threshold": NaN}}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    _good(client)


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


@pytest.mark.parametrize("extra", [{}, {"encoding": "base64"}, {"sparse": {"top_k": 2}},
                                   {"texts": TEXTS, "text": None}])
def test_tril_on_encoder_is_422(bert_client, extra):
    body = {"text": TEXT, "layout": "tril", **extra}
    body = {k: v for k, v in body.items() if v is not None}
    e = _err(bert_client.post("/v1/attention", json=body), 422, "validation_error", "layout")
    assert "causal" in e["message"]
    r = bert_client.post("/v1/attention", json={"text": TEXT, "layers": [0]})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ Accept negotiation
@pytest.mark.parametrize("accept,binary", [
    ("", False), (" ", False), (",", False), (";", False), (" , ; ", False),
    ("*/*", False), ("application/*", False), (ST, True), (ST.upper(), True),
    (f"{ST};q=0.5, application/json", False), (f"{ST};Q=1, application/json;q=0.9", True),
    (f"{ST} ; q=0.8 , */* ; q=0.1", True), (f"{ST};q=2, application/json", False),
    (f"{ST}, text/html", True), ("text/html, */*;q=0.1", False),
])
def test_accept_negotiation(client, accept, binary):
    r = client.post("/v1/attention", json={"text": TEXT, "layers": [0]}, headers={"accept": accept})
    assert r.status_code == 200, (accept, r.text)
    assert r.headers["content-type"].startswith(ST if binary else "application/json")


@pytest.mark.parametrize("accept", [
    "text/html", "garbage", "text/*", "*/*;q=0", "application/json;q=0",
    "application/json;q=-1", f"{ST};q=0", f"{ST};q=abc", f"{ST};q=nan", f"{ST};q=inf",
    "application/json;q=NaN", "x" * 10000,
])
def test_accept_refused_is_406(client, accept):
    e = _err(client.post("/v1/attention", json={"text": TEXT}, headers={"accept": accept}), 406,
             "not_acceptable", "Accept")
    assert len(e["message"]) < 400
    _good(client)


@pytest.mark.parametrize("path,body", [
    ("/v1/tokenize", {"text": TEXT}), ("/v1/heads", {"text": TEXT, "probe": {"enabled": False}}),
    ("/v1/links", {"text": TEXT, "layer": 0}), ("/v1/trajectories", {"text": TEXT}),
    ("/v1/verify", {"text": TEXT}), ("/v1/scratch-attention", {"text": TEXT}),
])
@pytest.mark.parametrize("accept", ["", " ", "text/html", ST, f"{ST};q=abc", "*/*"])
def test_accept_on_other_endpoints_never_500(client, path, body, accept):
    """Endpoints without a binary form answer JSON (today whatever Accept says) or a 406
    envelope; never a 500, never a safetensors body."""
    r = client.post(path, json=body, headers={"accept": accept})
    assert r.status_code in (200, 406), r.text
    assert r.headers["content-type"].startswith("application/json")
    if r.status_code == 406:
        _err(r, 406, "not_acceptable", "Accept")


# ------------------------------------------------------------------ memory limit
def _estimate(c, path, body) -> int:
    e = _err(c.post(path, json=body), 422, "memory_limit_exceeded")
    assert "max_request_bytes = 1)" in e["message"]
    return int(re.search(r"\((\d+) bytes\) of memory", e["message"]).group(1))


@pytest.mark.parametrize("path,body", [
    ("/v1/attention", {"text": TEXT}),
    ("/v1/attention", {"texts": TEXTS, "include_scores": True, "encoding": "base64"}),
    ("/v1/attention", {"texts": TEXTS, "layout": "tril", "dtype": "float16",
                       "encoding": "base64"}),
    ("/v1/attention", {"text": TEXT, "sparse": {"top_k": 2}}),
    ("/v1/heads", {"texts": TEXTS}), ("/v1/links", {"texts": TEXTS, "layer": 1}),
    ("/v1/trajectories", {"text": TEXT}), ("/v1/verify", {"texts": TEXTS}),
])
def test_memory_limit_of_the_app_exactly_at_and_over(make_client, gpt2_runtime, path, body):
    """``make_client(runtime, max_request_bytes=...)`` is honoured (it once read only the
    Runtime's own settings): at the estimate 200, one byte less 422 naming both numbers."""
    est = _estimate(make_client(gpt2_runtime, max_request_bytes=1), path, body)
    assert est > 0
    ok = make_client(gpt2_runtime, max_request_bytes=est)
    assert ok.post(path, json=body).status_code == 200
    over = make_client(gpt2_runtime, max_request_bytes=est - 1)
    e = _err(over.post(path, json=body), 422, "memory_limit_exceeded",
             "texts" if "texts" in body or path == "/v1/heads" else "text")
    assert f"({est} bytes)" in e["message"] and f"max_request_bytes = {est - 1}" in e["message"]
    assert over.post("/v1/tokenize", json={"text": TEXT}).status_code == 200  # no forward
    assert ok.post(path, json=body).status_code == 200  # the next good request


def test_memory_limit_zero_means_none(make_client, gpt2_runtime):
    c = make_client(gpt2_runtime, max_request_bytes=0)
    assert c.post("/v1/attention", json={"texts": TEXTS}).status_code == 200


# ------------------------------------------------------------------ API keys
KEYS = ["k1", "ключ", "a,b", " sp ", "x" * 5000]


@pytest.mark.parametrize("header,status", [
    (None, 401), ("", 401), (" ", 401), ("Bearer", 401), ("Bearer ", 401), ("Bearer k1", 200),
    ("bearer k1", 200), ("BEARER k1", 200), ("Bearer  k1 ", 200), ("Basic k1", 401),
    ("Basic azE6", 401), ("Token k1", 401), ("k1", 401), ("Bearer\tk1", 401),
    ("Bearer ключ".encode(), 200), ("Bearer a,b", 200), ("Bearer a", 401), ("Bearer sp", 200),
    ("Bearer " + "x" * 5000, 200), ("Bearer " + "x" * 50000, 401), ("Bearer k", 401),
])
def test_api_key_forms(make_client, gpt2_runtime, header, status):
    c = make_client(gpt2_runtime, api_keys=KEYS)
    h = [] if header is None else [("authorization", header)]
    r = c.post("/v1/tokenize", json={"text": TEXT}, headers=h)
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        _err(r, 401, "unauthorized", "Authorization")
        assert r.headers["www-authenticate"].startswith("Bearer")
    _good(c, {"authorization": "Bearer k1"})


@pytest.mark.parametrize("pair", [("Bearer k1", "Bearer bad"), ("Bearer bad", "Bearer k1"),
                                  ("Bearer k1", "Bearer k1")])
def test_two_authorization_headers_are_401(make_client, gpt2_runtime, pair):
    c = make_client(gpt2_runtime, api_keys=["k1"])
    r = c.post("/v1/tokenize", json={"text": TEXT},
               headers=[("authorization", pair[0]), ("authorization", pair[1])])
    e = _err(r, 401, "unauthorized", "Authorization")
    assert "exactly one" in e["message"]
    _good(c, {"authorization": "Bearer k1"})


@pytest.mark.parametrize("keys", [["", "  "], [" "], "", " , ,"])
def test_blank_keys_configure_no_auth(make_client, gpt2_runtime, keys):
    c = make_client(gpt2_runtime, api_keys=keys)
    assert c.post("/v1/tokenize", json={"text": TEXT}).status_code == 200


def test_keys_leave_health_open(make_client, gpt2_runtime):
    c = make_client(gpt2_runtime, api_keys=["k1"])
    for p in ("/healthz", "/readyz", "/metrics"):
        assert c.get(p).status_code == 200
    _err(c.get("/v1/model"), 401, "unauthorized")


# ------------------------------------------------------------------ X-Request-ID
@pytest.mark.parametrize("rid", [b"a\nb", b"a\r\nX-Evil: 1", "é".encode(), b"x" * 200,
                                 b"x" * 100000, b"", b" ", b"-abc", b"a b", b"a\x00b", b'"}{"'])
def test_unsafe_request_id_is_replaced(client, rid):
    r = client.post("/v1/tokenize", json={"text": TEXT}, headers=[("x-request-id", rid)])
    assert r.status_code == 200
    got = r.headers.get_list("x-request-id") if hasattr(r.headers, "get_list") else \
        [r.headers["x-request-id"]]
    assert len(got) == 1 and re.fullmatch(r"[0-9a-f]{32}", got[0]), got
    assert "X-Evil" not in r.headers and "x-evil" not in r.headers


def test_sane_request_id_is_echoed(client):
    r = client.post("/v1/tokenize", json={"text": TEXT}, headers={"x-request-id": "run-7:a.b_c"})
    assert r.headers["x-request-id"] == "run-7:a.b_c"


# ------------------------------------------------------------------ CORS
@pytest.mark.parametrize("hdrs,status,param", [
    ({"origin": "https://lab.example", "access-control-request-method": "POST",
      "access-control-request-headers": "authorization, content-type, x-request-id"}, 200, None),
    ({"origin": "https://evil.example", "access-control-request-method": "POST"}, 400, "Origin"),
    ({"origin": "null", "access-control-request-method": "POST"}, 400, "Origin"),
    ({"origin": "https://lab.example", "access-control-request-method": "DELETE"}, 400,
     "Access-Control-Request-Method"),
    ({"origin": "https://lab.example", "access-control-request-method": "POST",
      "access-control-request-headers": "x-evil"}, 400, "Access-Control-Request-Headers"),
])
@pytest.mark.parametrize("path", ["/v1/attention", "/healthz", "/nope"])
def test_cors_preflight(make_client, gpt2_runtime, hdrs, status, param, path):
    c = make_client(gpt2_runtime, cors_origins=["https://lab.example"], api_keys=["k1"])
    r = c.options(path, headers=hdrs)
    if status == 200:
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "https://lab.example"
    else:
        e = _err(r, 400, "validation_error", param)
        assert "CORS" in e["message"] and "https://lab.example" not in e["message"]  # issue 17: refusals never list the allowed origins
    _good(c, {"authorization": "Bearer k1", "origin": "https://lab.example"})


def test_cors_headers_on_errors(make_client, gpt2_runtime):
    c = make_client(gpt2_runtime, cors_origins=["https://lab.example"], api_keys=["k1"])
    r = c.post("/v1/attention", json={"text": TEXT}, headers={"origin": "https://lab.example"})
    _err(r, 401, "unauthorized")
    assert r.headers["access-control-allow-origin"] == "https://lab.example"
    r = c.post("/v1/attention", json={"text": TEXT}, headers={
        "origin": "https://lab.example", "authorization": "Bearer k1", "accept": "text/html"})
    _err(r, 406, "not_acceptable", "Accept")
    assert "X-Request-ID" in r.headers["access-control-expose-headers"]


def test_heads_memory_message_names_the_probe(make_client, gpt2_runtime):
    """/v1/heads runs the induction probe as a second forward: the 422 counts it and says so;
    without the probe the count is the user's own texts."""
    c = make_client(gpt2_runtime, max_request_bytes=1)
    e = _err(c.post("/v1/heads", json={"text": TEXT}), 422, "memory_limit_exceeded")
    assert "2 texts, one of them the induction probe" in e["message"]
    e = _err(c.post("/v1/heads", json={"text": TEXT, "probe": {"enabled": False}}), 422,
             "memory_limit_exceeded")
    assert "1 text," in e["message"] and "probe" not in e["message"]
