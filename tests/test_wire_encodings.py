"""Wire encodings of /v1/attention (issue 6): tril, sparse, binary (safetensors), streamed JSON,
the memory check. Every decoded tensor is compared with the runtime's own forward (Hugging
Face's output_attentions) or an independent numpy computation; binary responses are also read
with the ``safetensors`` library."""

from __future__ import annotations

import base64
from types import SimpleNamespace as NS

import numpy as np
import orjson
import pytest
import torch

from attnscope.client import Client, wire
from attnscope.service import encoding
from conftest import SENTENCE

SAFETENSORS = "application/x-safetensors"




@pytest.fixture(scope="module")
def reference(gpt2_runtime):
    # on the tokens the responses report: add_bos null, BOS first for GPT-2
    tt = gpt2_runtime.tokenize(SENTENCE, add_bos=True)
    fw = gpt2_runtime.forward_many([tt])[0]
    return fw.pattern.numpy(), fw.scores().numpy()


def post(client, body, accept=None):
    headers = {"accept": accept} if accept else {}
    return client.post("/v1/attention", json={"text": SENTENCE, **body}, headers=headers)


@pytest.mark.parametrize("encoding,dtype,tol", [("json", "float32", 1e-7),
                                                ("base64", "float32", 0), ("base64", "float16", 1e-3)])
def test_tril_round_trips_pattern_and_scores(client, reference, encoding, dtype, tol):
    pattern, scores = reference
    r = post(client, {"layout": "tril", "encoding": encoding, "dtype": dtype, "include_scores": True})
    assert r.status_code == 200, r.text
    att = r.json()["attention"]
    T = pattern.shape[-1]
    if encoding == "json":
        assert att["pattern"]["encoding"] == "tril"
        assert [len(row) for row in att["pattern"]["data"][0][0]] == list(range(1, T + 1))
    else:
        assert att["pattern"]["layout"] == "tril"
    p = wire.decode_tensor(att["pattern"]).astype(np.float32)
    s = wire.decode_tensor(att["scores"]).astype(np.float32)
    np.testing.assert_allclose(p, pattern, atol=tol, rtol=tol)
    finite = np.isfinite(scores)
    assert (np.isneginf(s) == ~finite).all()
    np.testing.assert_allclose(s[finite], scores[finite], atol=max(tol, 1e-6) * 50, rtol=tol or 1e-6)


def test_tril_is_smaller_and_rejected_for_encoders(client, bert_client):
    full = post(client, {"encoding": "base64"})
    tril = post(client, {"encoding": "base64", "layout": "tril"})
    assert len(tril.content) < 0.65 * len(full.content)
    r = bert_client.post("/v1/attention", json={"text": SENTENCE, "layout": "tril"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "layout"


@pytest.mark.parametrize("sparse", [{"top_k": 3}, {"threshold": 0.1, "format": "coo"},
                                    {"top_k": 5, "threshold": 0.05}])
@pytest.mark.parametrize("encoding", ["json", "base64"])
def test_sparse_keeps_what_it_says(client, reference, sparse, encoding):
    pattern, _ = reference
    r = post(client, {"sparse": sparse, "encoding": encoding})
    assert r.status_code == 200, r.text
    sp = r.json()["attention"]["pattern"]
    assert sp["encoding"] == "sparse" and sp["format"] == sparse.get("format", "flat")
    dense = wire.sparse_to_dense(sp)
    # independent rule in numpy: per row, top-k (or all) non-zero entries, then threshold
    expect = np.zeros_like(pattern)
    k = sparse.get("top_k") or pattern.shape[-1]
    order = np.argsort(-pattern, axis=-1, kind="stable")[..., :k]
    kept = np.take_along_axis(pattern, order, -1)
    ok = kept > 0
    if "threshold" in sparse:
        ok &= kept >= sparse["threshold"]
    np.put_along_axis(expect, order, np.where(ok, kept, 0), -1)
    np.testing.assert_allclose(dense, expect, atol=1e-7)
    parts = wire.sparse_parts(sp)
    assert parts["values"].size == sp["nnz"] == int((expect > 0).sum())
    np.testing.assert_allclose(parts["row_mass"], expect.sum(-1), atol=1e-5)
    assert sp["min_row_mass"] == pytest.approx(float(expect.sum(-1).min()), abs=1e-5)
    if sp["format"] == "flat":
        assert (np.diff(parts["indices"]) > 0).all()  # row-major order
    else:
        assert parts["indices"].shape == (sp["nnz"], 4)


def test_sparse_options_validated(client):
    r = post(client, {"sparse": {}})
    assert r.status_code == 422 and "top_k" in r.json()["error"]["message"]
    r = post(client, {"sparse": {"threshold": 1.5}})
    assert r.status_code == 422 and r.json()["error"]["param"] == "sparse.threshold"


@pytest.mark.parametrize("body", [{"include_scores": True}, {"layout": "tril", "dtype": "float16"},
                                  {"sparse": {"top_k": 2}}, {"texts": [SENTENCE, "In the beginning"]}])
def test_binary_response_decodes(client, reference, body):
    from safetensors.numpy import load

    if "texts" in body:
        r = client.post("/v1/attention", json=body, headers={"accept": SAFETENSORS})
    else:
        r = post(client, body, SAFETENSORS)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == SAFETENSORS
    assert int(r.headers["content-length"]) == len(r.content)
    lib = load(r.content)  # the reference reader
    meta, arrays = wire.read_safetensors(r.content)
    assert set(lib) == set(arrays)
    for k in lib:
        np.testing.assert_array_equal(lib[k], arrays[k])
    decoded = wire.decode_binary_response(r.content)
    js = client.post("/v1/attention", json={**({"text": SENTENCE} if "texts" not in body else {}), **body}).json()
    pattern, scores = reference
    if "texts" in body:
        assert [x["tokens"] for x in decoded["results"]] == [x["tokens"] for x in js["results"]]
        np.testing.assert_allclose(decoded["results"][0]["pattern"], pattern, atol=0)
        return
    att = decoded["attention"]
    assert att["tokens"] == js["attention"]["tokens"]
    if "sparse" in body:
        np.testing.assert_allclose(wire.sparse_to_dense(att["pattern"]),
                                   wire.sparse_to_dense(js["attention"]["pattern"]), atol=0)
    else:
        np.testing.assert_allclose(att["pattern"].astype(np.float32), pattern,
                                   atol=1e-3 if body.get("dtype") == "float16" else 0)
    if body.get("include_scores"):
        assert np.isneginf(att["scores"]).sum() == np.isneginf(scores).sum()


@pytest.mark.parametrize("accept,binary", [
    ("application/json", False), ("*/*", False), (None, False),
    (SAFETENSORS, True), (f"application/json;q=0.5, {SAFETENSORS}", True),
    (f"{SAFETENSORS};q=0.2, application/json", False),
])
def test_accept_negotiation(client, accept, binary):
    r = post(client, {"layers": [0]}, accept)
    assert r.status_code == 200
    assert (r.headers["content-type"] == SAFETENSORS) is binary


def test_accept_nothing_we_produce_is_406(client):
    r = post(client, {}, "text/html")
    assert r.status_code == 406
    assert r.json()["error"]["type"] == "not_acceptable"


def test_streamed_json_equals_one_shot(monkeypatch):
    from attnscope.service.encoding import responses as encoding  # where CHUNK_BYTES lives

    monkeypatch.setattr(encoding, "CHUNK_BYTES", 64)
    rng = np.random.default_rng(0)
    body = {"a": rng.random((3, 4, 5), dtype=np.float32), "s": "x\"y\\" * 50 + "\x00é",
            "tokens": [{"label": f"t{i}", "n": i} for i in range(600)], "n": None,
            "v": rng.random(300).astype(np.float32), "nested": [{"b": rng.random((2, 40))}]}
    chunks = list(encoding.iter_json(body))
    assert len(chunks) > 3
    assert b"".join(chunks) == encoding.dumps(body)
    assert orjson.loads(b"".join(chunks))["s"] == body["s"]


def test_large_json_is_streamed_and_correct(client, make_client, gpt2_runtime, monkeypatch, reference):
    from attnscope.service.encoding import responses as encoding

    monkeypatch.setattr(encoding, "STREAM_MIN_BYTES", 1000)
    monkeypatch.setattr(encoding, "CHUNK_BYTES", 512)
    r = post(client, {"include_scores": True})
    assert r.status_code == 200
    assert "content-length" not in r.headers  # chunked
    np.testing.assert_allclose(np.array(r.json()["attention"]["pattern"]), reference[0], atol=1e-7)


def test_recorded_bytes_estimate_is_exact(gpt2_runtime):
    from attnscope.service.runtime.results import recorded_bytes

    a = gpt2_runtime.adapter
    for text in (SENTENCE, "In the beginning God created the heaven and the earth. " * 3):
        fw = gpt2_runtime.forward_many([gpt2_runtime.tokenize(text)])[0]
        assert recorded_bytes(a.n_layers, a.n_heads, a.d_model, fw.n_tokens, 4) == fw.tensors.nbytes


def test_memory_limit_refuses_before_forward(client, gpt2_runtime, monkeypatch):
    monkeypatch.setattr(gpt2_runtime.settings, "max_request_bytes", 200_000)
    c = client
    before = gpt2_runtime.forward_count
    text = "a fresh text never seen by the cache, with quite a few tokens in it " * 3
    r = c.post("/v1/attention", json={"text": text})
    assert r.status_code == 422, r.text[:300]
    err = r.json()["error"]
    assert err["type"] == "memory_limit_exceeded"
    assert "200000" in err["message"] and "estimated" in err["message"]
    assert gpt2_runtime.forward_count == before
    # a smaller answer (sparse) of a short text passes the same limit
    r = c.post("/v1/attention", json={"text": "short", "sparse": {"top_k": 1}})
    assert r.status_code == 200, r.text[:300]


# ------------------------------------------------------------------ base64 round trips
def _fw(rt, text, add_bos=False):
    return rt.forward_many([rt.tokenize(text, add_bos)])[0]


@pytest.mark.regression
@pytest.mark.parametrize("body", [
    {"dtype": "float32"},
    {"dtype": "float16"},
    {"dtype": "float32", "layout": "tril", "include_scores": True},
    {"dtype": "float32", "layers": [1], "heads": [3, 0]},
    {"dtype": "float32", "head_mean": True},
])
def test_base64_attention_round_trip_exact(client, gpt2_runtime, body):
    texts = [SENTENCE, "a b", "x"]
    r = client.post("/v1/attention", json={"texts": texts, "encoding": "base64", **body})
    assert r.status_code == 200, r.text
    for text, res in zip(texts, r.json()["results"]):
        # the reference on the tokens the response reports (BOS first by default)
        fw = _fw(gpt2_runtime, text, True)
        assert [t["id"] for t in res["tokens"]] == list(fw.tokens.input_ids)
        p = fw.pattern
        if "layers" in body:
            p = p[body["layers"]][:, body["heads"]]
        if body.get("head_mean"):
            p = p.mean(1)
        want = p.numpy()
        got = wire.decode_tensor(res["pattern"])
        if body["dtype"] == "float16":
            want = p.to(torch.float16).numpy()
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got, want)
        if body.get("include_scores"):
            s = wire.decode_tensor(res["scores"])
            sw = fw.scores().numpy()
            tri = np.tril(np.ones(sw.shape[-2:], bool))
            assert np.array_equal(s[..., tri], sw[..., tri])


LONG = "The" + " cat sat on the mat." * 31  # 249 tokens: > 4 MB of base64 with scores


@pytest.mark.regression
def test_base64_streamed_body_round_trips_exactly(client, gpt2_runtime):
    fw = _fw(gpt2_runtime, LONG, True)  # the tokens the response reports: BOS first
    r = client.post("/v1/attention", json={"text": LONG, "encoding": "base64",
                                           "include_scores": True})
    assert r.status_code == 200, r.text
    assert "content-length" not in r.headers or int(r.headers["content-length"]) > 4 << 20
    assert len(r.content) > 4 << 20
    att = orjson.loads(r.content)["attention"]
    assert [t["id"] for t in att["tokens"]] == list(fw.tokens.input_ids)
    assert np.array_equal(wire.decode_tensor(att["pattern"]), fw.pattern.numpy())
    s, sw = wire.decode_tensor(att["scores"]), fw.scores().numpy()
    assert np.array_equal(np.isneginf(s), np.isneginf(sw))
    assert np.array_equal(s[np.isfinite(sw)], sw[np.isfinite(sw)])


# ------------------------------------------------------------------ sparse top-k
@pytest.mark.regression
def test_nan_from_the_model_is_refused_in_every_form(client, gpt2_runtime, monkeypatch):
    from attnscope.service.runtime.results import ForwardTensors

    text = "nan pattern row check"
    fw = _fw(gpt2_runtime, text, True)  # the forward the requests run: BOS first by default
    orig = ForwardTensors.__init__
    pat = fw.pattern.clone()
    pat[1, 2, -1, 0] = float("nan")  # last row, first key: small, never in the top-1 otherwise

    def fake(self, pattern, *a, **k):
        orig(self, pat if pattern.shape == pat.shape else pattern, *a, **k)

    gpt2_runtime.cache.clear() if hasattr(gpt2_runtime.cache, "clear") else None
    monkeypatch.setattr(ForwardTensors, "__init__", fake)
    try:
        for body in ({"sparse": {"top_k": 1}, "encoding": "base64"},
                     {"sparse": {"top_k": 2, "threshold": 0.9}},
                     {"sparse": {"top_k": 500}}, {"encoding": "base64"},
                     {"layout": "tril", "encoding": "base64"}, {"texts": ["x", text]}):
            r = client.post("/v1/attention", json={"text": text, **body} if "texts" not in body
                            else body)
            assert r.status_code == 500, (body, r.status_code)  # NonFiniteValues: by design
            assert r.json()["error"]["type"] == "non_finite_values", body
    finally:
        monkeypatch.undo()
        gpt2_runtime.cache.clear() if hasattr(gpt2_runtime.cache, "clear") else None


# ------------------------------------------------------------------ float16 overflow
@pytest.mark.regression
@pytest.mark.parametrize("kw", [{"encoding": "base64"}, {"encoding": "binary"},
                                {"encoding": "base64", "layout": "tril"},
                                {"encoding": "base64", "allow_neg_inf": True}])
def test_float16_cast_never_sends_inf_silently(kw):
    """Bug: a finite value beyond 65504 became inf in a float16 base64/binary tensor
    (model scores, trajectory paths) without an error; scratch-attention checked it, the
    shared encoder did not."""
    from attnscope.service.errors import InvalidRequest

    x = torch.zeros(1, 3, 3)
    x[0, 2, 1] = 7e4
    with pytest.raises(InvalidRequest) as e:
        encoding.encode_tensor(x, dtype="float16", name="attention.scores", **kw)
    assert e.value.param == "dtype" and "7e+04" in str(e.value)
    ok = torch.tensor([[0.0, float("-inf")], [65504.0, -3.0]])  # masked -inf stays allowed
    got = encoding.encode_tensor(ok, "base64", "float16", allow_neg_inf=True)
    assert np.array_equal(wire.decode_tensor(orjson.loads(encoding.dumps(got))),
                          ok.numpy().astype(np.float16))
    assert encoding.encode_tensor(x, "base64", "float32")["dtype"] == "float32"
    neg = torch.tensor([[0.0, float("-inf")], [-7e4, 1.0]])  # masked -inf AND an overflow
    with pytest.raises(InvalidRequest):
        encoding.encode_tensor(neg, "base64", "float16", allow_neg_inf=True)


@pytest.mark.regression
def test_iter_json_equals_dumps_with_big_base64():
    big = encoding._b64(np.arange(600_000, dtype=np.float32))  # 3.2 MB of base64
    body = {"a": [{"data": big, "x": np.ones((3, 2), np.float32)}, "s" * 10],
            "long": list(range(300)), "arr": np.arange(400_000, dtype=np.float32).reshape(2, -1),
            "small": encoding._b64(np.zeros(3, np.float16))}
    streamed = b"".join(bytes(c) for c in encoding.iter_json(body))
    assert streamed == encoding.dumps(body)
    back = orjson.loads(streamed)
    assert np.array_equal(wire.decode_tensor({"encoding": "base64", "dtype": "float32",
                                              "shape": [600_000], "data": back["a"][0]["data"]}),
                          np.arange(600_000, dtype=np.float32))


@pytest.mark.parametrize("v,ok", [(65504.0, True), (65519.99, True), (65520.0, False),
                                  (-65519.99, True), (-65520.0, False)])
def test_float16_tril_boundary(v, ok):
    """'tril' float16 skips the checked cast when every value fits (codecs._fits_wire): the
    boundary is where float16 rounds to inf (65520 rounds up, to even), as the checked path."""
    from attnscope.service.errors import InvalidRequest

    x = torch.zeros(2, 3, 3)
    x[1, 2, 1] = v
    for enc_ in ("base64", "binary"):
        if not ok:
            with pytest.raises(InvalidRequest):
                encoding.encode_tensor(x, enc_, "float16", layout="tril")
            continue
        got = encoding.encode_tensor(x, enc_, "float16", layout="tril")
        if enc_ == "base64":
            dec = wire.decode_tensor(orjson.loads(encoding.dumps(got)))
            assert np.array_equal(dec, x.numpy().astype(np.float16)) and np.isfinite(dec).all()


@pytest.mark.regression
def test_sparse_coo_with_nothing_kept():
    """Bug: a 'coo' sparse tensor keeping no entry (threshold above every weight) in base64
    raised TypeError (memoryview of an empty [0, ndim] array): a 500."""
    x = torch.softmax(torch.randn(2, 5, 5), -1)
    for fmt in ("coo", "flat"):
        for enc_ in ("base64", "json"):
            sp = encoding.encode_sparse(x, NS(top_k=2, threshold=0.999, format=fmt), enc_)
            back = orjson.loads(encoding.dumps(sp))
            assert back["nnz"] == 0
            assert np.array_equal(wire.sparse_to_dense(back), np.zeros((2, 5, 5), np.float32))


@pytest.mark.parametrize("mmap_bytes", [None, 0])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("T", [1, 2, 5, 33])
def test_client_tril_decode_against_a_reference(monkeypatch, dtype, T, mmap_bytes):
    """wire.py unpacks 'tril' row by row: equal to an independent index-based unpacking for
    the tensor's own fill and explicit ones (0, -0.0, -inf, NaN, a number); big outputs come
    from an anonymous mmap (forced here with ``mmap_bytes`` 0) and are ordinary writable
    arrays."""
    if mmap_bytes is not None:
        monkeypatch.setattr(wire, "_MMAP_BYTES", mmap_bytes)
    rng = np.random.default_rng(T)
    n = T * (T + 1) // 2
    packed = rng.standard_normal(2 * 3 * n).astype(dtype)
    iq, ik = np.tril_indices(T)
    for own in ("0", "-inf"):
        value = {"encoding": "base64", "dtype": dtype, "shape": [2, 3, T, T], "layout": "tril",
                 "fill": own, "data": base64.b64encode(packed.tobytes()).decode()}
        for fill in (None, 0.0, -0.0, -np.inf, np.nan, 2.5):
            f = (0.0 if own == "0" else -np.inf) if fill is None else fill
            want = np.full((2, 3, T, T), f, dtype)
            want[..., iq, ik] = packed.reshape(2, 3, n)
            got = wire.decode_tensor(value, fill=fill)
            assert got.dtype == want.dtype and got.view(np.uint8).tobytes() == \
                want.view(np.uint8).tobytes(), (own, fill)
            assert got.flags.writeable
    sp = {"encoding": "sparse", "format": "flat", "shape": [2, 3, T, T],
          "indices": [0, 2 * 3 * T * T - 1], "values": [0.5, 0.25], "row_mass": [0] * 6 * T}
    for fill in (0.0, -np.inf, 3.0):
        want = np.full(2 * 3 * T * T, fill, np.float32)
        want[[0, -1]] = [0.5, 0.25]
        got = wire.sparse_to_dense(sp, fill=fill)
        assert np.array_equal(got, want.reshape(2, 3, T, T)) and got.flags.writeable


def test_client_base64_with_line_breaks_still_decodes():
    """The validating base64 decoder is only the fast path: text with line breaks (not what
    the service sends) decodes as before."""
    a = np.arange(12, dtype=np.float32)
    text = base64.encodebytes(a.tobytes()).decode()  # MIME: a newline every 76 characters
    assert "\n" in text
    got = wire.decode_tensor({"encoding": "base64", "dtype": "float32", "shape": [12],
                              "data": text})
    assert np.array_equal(got, a)


def test_array_bytes_equals_its_recursive_definition(client):
    """The iterative size walk that decides streaming counts exactly what the recursive
    definition counts, on hand-made bodies (every kind of leaf: arrays, lazy wire forms,
    strings, bytes, scalars and their subclasses, long scalar lists, tuples) and on real
    bodies of four endpoints."""
    from attnscope.service.encoding import responses as R
    from attnscope.service.encoding.codecs import LAZY

    def recursive(obj):  # the definition the walk replaced
        if isinstance(obj, (np.ndarray, *LAZY)):
            return obj.nbytes
        if isinstance(obj, (str, bytes)):
            return len(obj)
        if isinstance(obj, dict):
            return sum(recursive(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            if len(obj) >= 4096 and isinstance(obj[0], R._SCALARS):
                return 24 * len(obj)
            return sum(recursive(v) for v in obj)
        return 8

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    lazy = encoding.encode_tensor(np.tril(np.ones((1, 4, 4), np.float32)), "base64", "float16",
                                  layout="tril")["data"]
    bodies = [
        {}, [], "", 1, 2.5, True, None, np.float64(3.0), np.int32(2), a, lazy, b"xyz",
        {"a": 1, "b": [1, 2.0, None, "four", {"c": a}], "d": (a, lazy), "e": np.float32(1)},
        {"long": list(range(5000)), "long_floats": [0.5] * 4096, "short": list(range(4095))},
        [[1, [2, [3, [4, "deep"]]]], {"x": {"y": {"z": [a, a]}}}],
        {"mixed": [1, "s", b"b", np.bool_(True), (1, 2, (3,))]},
    ]
    for path, extra in (("/v1/heads", {"add_bos": False}), ("/v1/links", {"layer": 0}),
                        ("/v1/trajectories", {}), ("/v1/attention", {"round": 3})):
        r = client.post(path, json={"text": SENTENCE, **extra})
        assert r.status_code == 200, r.text
        bodies.append(orjson.loads(r.content))
    for b in bodies:
        assert R._array_bytes(b) == recursive(b), repr(b)[:200]
    # hand-computed: two scalars; a 5000-int list; a dict holding a 4096-scalar list
    assert R._array_bytes({"a": 1, "b": 2}) == 16
    assert R._array_bytes(list(range(5000))) == 24 * 5000
    assert R._array_bytes({"x": [0.5] * 4096, "s": "abc"}) == 24 * 4096 + 3


def _texts(x):
    """``wire.loads``' memoryviews as str (to compare with a JSON parser's result)."""
    if isinstance(x, memoryview):
        return str(x, "ascii")
    if isinstance(x, dict):
        return {k: _texts(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_texts(v) for v in x]
    return x


def test_loads_cuts_big_base64_texts_out_and_equals_a_json_parser(client, monkeypatch):
    """``wire.loads`` (the client's JSON parse, issue 25: a T = 1024 'tril' float16 pattern is
    ~200 MB of base64 that a JSON parser validates and copies into a str): the service's big
    base64 texts come back as views of the body; everything else, and every body where a
    ``"data":"`` is not such a text (inside another string, escaped, after whitespace, short),
    equals ``orjson.loads``."""
    monkeypatch.setattr(wire, "BIG_BASE64", 8)
    r = client.post("/v1/attention", json={"text": SENTENCE, "encoding": "base64",
                                           "dtype": "float16", "layout": "tril"})
    assert r.status_code == 200, r.text[:300]
    ref = orjson.loads(r.content)
    got = wire.loads(r.content)
    pat = got["attention"]["pattern"]
    assert isinstance(pat["data"], memoryview) and pat["data"].readonly
    assert _texts(got) == ref
    assert wire.loads(r.content, as_text=True) == ref
    assert np.array_equal(wire.decode_tensor(pat), wire.decode_tensor(ref["attention"]["pattern"]))
    b64 = base64.b64encode(bytes(range(48))).decode()
    for body in [
        {"a": 'x", "data":"' + b64, "data": b64},  # a "data":" inside a string: escaped quotes
        {"data": b64 + "\n" + b64},  # an escaped text: parsed as JSON
        {"data": "\\" + b64},
        [{"data": b64}, {"z": [1, 2, {"data": b64}]}, None, "data"],
        {"data": "short"}, {"data": ""}, {"data": 5}, {"x": {"data": None}},
    ]:
        raw = orjson.dumps(body)
        assert _texts(wire.loads(raw)) == body, raw[:80]
        assert wire.loads(raw, as_text=True) == body
    pretty = orjson.dumps({"data": b64}, option=orjson.OPT_INDENT_2)
    assert wire.loads(pretty) == {"data": b64}  # after whitespace: parsed as JSON, a str
    typed = Client("http://testserver", http_client=client, max_retries=0).attention(
        SENTENCE, encoding="base64", dtype="float16", layout="tril")
    assert np.array_equal(typed.attention.pattern.numpy(),
                          wire.decode_tensor(ref["attention"]["pattern"]))
