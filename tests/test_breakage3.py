"""Adversarial tests of the speed changes (237787f..9a9b671): base64 spliced verbatim into the
JSON (Base64Text), two-pass sparse top-k, ForwardTensors read concurrently, the tokenize LRU,
trim_free_bytes, verify from recorded q/k/v. Every decoded tensor is compared with the
runtime's own forward or an independent numpy rule."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace as NS

import numpy as np
import orjson
import pytest
import torch
from attnscope.client import Client, wire
from attnscope.service import encoding
from conftest import SENTENCE, assert_error


def _fw(rt, text, add_bos=False):
    return rt.forward_many([rt.tokenize(text, add_bos)])[0]


# ------------------------------------------------------------------ base64 round trips
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
        fw = _fw(gpt2_runtime, text)
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


def test_base64_streamed_body_round_trips_exactly(client, gpt2_runtime):
    fw = _fw(gpt2_runtime, LONG)
    r = client.post("/v1/attention", json={"text": LONG, "encoding": "base64",
                                           "include_scores": True})
    assert r.status_code == 200, r.text
    assert "content-length" not in r.headers or int(r.headers["content-length"]) > 4 << 20
    assert len(r.content) > 4 << 20
    att = orjson.loads(r.content)["attention"]
    assert np.array_equal(wire.decode_tensor(att["pattern"]), fw.pattern.numpy())
    s, sw = wire.decode_tensor(att["scores"]), fw.scores().numpy()
    assert np.array_equal(np.isneginf(s), np.isneginf(sw))
    assert np.array_equal(s[np.isfinite(sw)], sw[np.isfinite(sw)])


def test_base64_streamed_batch_and_sparse(client, gpt2_runtime):
    texts = [LONG, LONG[:300], LONG]
    r = client.post("/v1/attention", json={"texts": texts, "encoding": "base64",
                                           "sparse": {"top_k": 7, "format": "coo"}})
    assert r.status_code == 200, r.text
    for text, res in zip(texts, r.json()["results"]):
        p = _fw(gpt2_runtime, text).pattern.numpy()
        dense = wire.sparse_to_dense(res["pattern"])
        order = np.argsort(-p, axis=-1, kind="stable")[..., :7]
        expect = np.zeros_like(p)
        np.put_along_axis(expect, order, np.take_along_axis(p, order, -1), -1)
        assert np.array_equal(dense, expect)


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


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_trajectories_and_scratch_base64(client, dtype):
    r = client.post("/v1/trajectories", json={"texts": [SENTENCE, "one two three"],
                                              "encoding": "base64", "dtype": dtype})
    assert r.status_code == 200, r.text
    rj = client.post("/v1/trajectories", json={"texts": [SENTENCE, "one two three"]})
    for a, b in zip(r.json()["results"], rj.json()["results"]):
        got = wire.decode_tensor(a["paths"]).astype(np.float32)
        want = np.asarray(b["paths"], np.float32)
        if dtype == "float32":
            assert np.array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------------ recorded tensors, concurrency
def test_recorded_tensors_read_concurrently_are_one_object_and_equal_a_batch_copy(gpt2_runtime):
    text = f"A fresh text for the lazy stacking race {threading.get_ident()} zebra quartz."
    ref = gpt2_runtime.forward_many([gpt2_runtime.tokenize(text), gpt2_runtime.tokenize("ab")])
    ref = ref[0].tensors  # a batch of 2: its rows are copies (clone), stacked serially below
    serial = {n: getattr(ref, n).clone() for n in ref._NAMES}
    gpt2_runtime.cache.clear() if hasattr(gpt2_runtime.cache, "clear") else None
    fresh = gpt2_runtime.forward_many([gpt2_runtime.tokenize(text + " again")])[0].tensors
    fresh2 = gpt2_runtime.forward_many([gpt2_runtime.tokenize(text + " again")])[0].tensors
    barrier = threading.Barrier(8)

    def grab(i):
        barrier.wait()
        return {n: getattr(fresh, n) for n in (fresh._NAMES[i % 6:] + fresh._NAMES[: i % 6])}

    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(grab, range(8)))
    for g in got:
        for n in fresh._NAMES:
            assert g[n] is got[0][n]  # stacked once
            assert torch.equal(g[n], getattr(fresh2, n))
    nb = fresh.nbytes
    assert nb == sum(t.numel() * t.element_size() for t in
                     [fresh.pattern, fresh.final_state] + [getattr(fresh, n) for n in fresh._NAMES])
    assert all(torch.equal(serial[n][:, :0], getattr(ref, n)[:, :0]) for n in ref._NAMES)


def test_concurrent_endpoints_on_a_fresh_text_equal_serial(make_client, gpt2_runtime):
    c = make_client(gpt2_runtime)
    text = "Concurrent stacking check: violet otters juggle seven brass lanterns."
    reqs = [("/v1/verify", {"text": text, "projections": True, "mode": "recorded_qkv"}),
            ("/v1/trajectories", {"text": text, "encoding": "base64"}),
            ("/v1/attention", {"text": text, "include_scores": True, "encoding": "base64"})] * 4
    barrier = threading.Barrier(len(reqs))

    def go(rq):
        barrier.wait()
        return c.post(rq[0], json=rq[1])

    with ThreadPoolExecutor(len(reqs)) as ex:
        conc = list(ex.map(go, reqs))
    serial = [c.post(p, json=b) for p, b in reqs[:3]]
    for i, r in enumerate(conc):
        assert r.status_code == 200, r.text
        a, b = r.json(), serial[i % 3].json()
        a.pop("timing", None), b.pop("timing", None)
        assert a == b


# ------------------------------------------------------------------ verify
@pytest.mark.parametrize("which", ["gpt2", "bert"])
@pytest.mark.parametrize("projections", [False, True])
def test_verify_projections_both_models(client, bert_client, which, projections):
    c = client if which == "gpt2" else bert_client
    r = c.post("/v1/verify", json={"texts": [SENTENCE, "hi there"], "projections": projections,
                                   "layers": [1, 0], "mode": "recorded_qkv"})
    assert r.status_code == 200, r.text
    for res in r.json()["results"]:
        v = res
        assert v["passed"], v["message"]
        assert v["projections"] is projections
        assert [l["layer"] for l in v["layers"]] == [1, 0]
        for l in v["layers"]:
            assert (l["qkv_max_abs_diff"] is not None) is projections
    for tol in (0, -1, 1.5):
        assert_error(c.post("/v1/verify", json={"text": "hi", "tolerance": tol}),
                     param="tolerance")
    r = c.post("/v1/verify", json={"text": "hi", "tolerance": 1e-300})
    assert r.status_code == 200


def test_verify_projections_sees_a_qkv_weight_change(gpt2_runtime, make_client):
    c = make_client(gpt2_runtime)
    text = "weight change seen by projections only"
    assert c.post("/v1/verify", json={"text": text}).json()["verification"]["passed"]
    p = gpt2_runtime.adapter.attention_params(0)
    W = p.W_q
    with torch.no_grad():
        saved = W.clone()
        W.add_(0.01)
    try:
        r1 = c.post("/v1/verify", json={"text": text, "mode": "recorded_qkv"}).json()["verification"]
        r2 = c.post("/v1/verify", json={"text": text, "projections": True,
                                        "mode": "recorded_qkv"}).json()["verification"]
        r3 = c.post("/v1/verify", json={"text": text}).json()["verification"]
    finally:
        with torch.no_grad():
            W.copy_(saved)
    assert r1["passed"]  # documented: recorded q/k/v
    assert not r2["passed"] and r2["failed_layers"] == [0]
    assert not r3["passed"] and r3["failing_layer"] == 0  # from scratch: seen by default


# ------------------------------------------------------------------ sparse top-k
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


def test_nan_from_the_model_is_refused_in_every_form(client, gpt2_runtime, monkeypatch):
    from attnscope.service.runtime.model import ForwardTensors

    text = "nan pattern row check"
    fw = _fw(gpt2_runtime, text)
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


# ------------------------------------------------------------------ tokenize cache
def test_tokenize_cache_keys_on_add_bos_and_names_the_param(client, gpt2_runtime):
    text = "cache key check: same text, with and without BOS"
    a = gpt2_runtime.tokenize(text)
    b = gpt2_runtime.tokenize(text, add_bos=True)
    assert len(b) == len(a) + 1 and b.input_ids[1:] == a.input_ids
    assert gpt2_runtime.tokenize(text) is a and gpt2_runtime.tokenize(text, True) is b
    r1 = client.post("/v1/attention", json={"texts": [text, text], "add_bos": True})
    r0 = client.post("/v1/attention", json={"texts": [text, text]})
    assert len(r1.json()["results"][1]["tokens"]) == len(b)
    assert len(r0.json()["results"][1]["tokens"]) == len(a)
    long = " the" * 300  # 300 tokens > n_ctx 256
    for _ in range(2):  # the second time after the short texts are cached
        e = assert_error(client.post("/v1/attention", json={"texts": [text, "a", "b", long]}),
                         param="texts.3")
        assert "300" in e["message"] and "256" in e["message"]
    assert_error(client.post("/v1/attention", json={"text": long}), param="text")
    # a text exactly at n_ctx: cached, then reused under another param name with add_bos
    at = " the" * 256
    assert client.post("/v1/attention", json={"text": at, "sparse": {"top_k": 1}}).status_code == 200
    assert_error(client.post("/v1/attention", json={"texts": ["a", at], "add_bos": True}),
                 param="texts.1")


def test_batch_equals_single_forwards(gpt2_runtime, bert_runtime):
    for rt, tol in ((gpt2_runtime, 1e-5), (bert_runtime, 1e-5)):
        texts = ["one two three four", "five six seven eight", "nine", "ten eleven"]
        rt.cache.clear()
        batch = rt.forward_many([rt.tokenize(t) for t in texts])
        rt.cache.clear()
        for t, fb in zip(texts, batch):
            fs = rt.forward_many([rt.tokenize(t)])[0]
            rt.cache.clear()
            for n in ("pattern", "hidden_states", "q", "k", "v", "attn_input", "attn_output"):
                x, y = getattr(fb.tensors, n), getattr(fs.tensors, n)
                assert x.shape == y.shape, n
                torch.testing.assert_close(x, y, atol=tol, rtol=tol, msg=n)


# ------------------------------------------------------------------ trim_free_bytes
def test_trim_free_bytes_setting(make_client, gpt2_runtime, monkeypatch):
    from attnscope.service.config import Settings
    from attnscope.service.runtime import memory
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="trim_free_bytes"):
        Settings(model="bundled", trim_free_bytes=-1)
    monkeypatch.setenv("ATTNSCOPE_TRIM_FREE_BYTES", "-5")
    with pytest.raises(ValidationError, match="trim_free_bytes"):
        Settings(model="bundled")
    monkeypatch.delenv("ATTNSCOPE_TRIM_FREE_BYTES")
    saved = memory.TRIM_FREE_BYTES
    try:
        make_client(gpt2_runtime, trim_free_bytes=0)
        assert memory.TRIM_FREE_BYTES == 0
        calls = []
        real = memory._libc()
        monkeypatch.setattr(memory, "_libc", lambda: NS(
            malloc_trim=lambda n: calls.append(n) or 1, mallinfo2=real.mallinfo2))
        assert memory.release_memory() is True and calls == [0]  # 0 = always
        memory.set_trim_free_bytes(1 << 62)
        assert memory.release_memory() is False and calls == [0]  # huge: never
        assert memory.release_memory(0) is True and calls == [0, 0]
        free = memory.free_heap_bytes()
        assert free is None or free >= 0
    finally:
        memory.set_trim_free_bytes(saved)


def test_negative_trim_env_is_a_startup_error(tmp_path):
    from conftest import start_server

    s = start_server(tmp_path, env={"ATTNSCOPE_TRIM_FREE_BYTES": "-1"}, wait_ready=False)
    try:
        rc = s.proc.wait(timeout=60)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert rc != 0
    assert "trim_free_bytes" in s.log.read_text().lower()


# ------------------------------------------------------------------ trajectories
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("include_final", [False, True])
def test_trajectories_equal_the_scikit_learn_pipeline(dtype, include_final):
    from attnscope.service.analysis.trajectories import trajectories
    from sklearn.decomposition import PCA
    from sklearn.preprocessing import StandardScaler

    g = torch.Generator().manual_seed(3)
    h = (torch.randn(4, 9, 24, generator=g) * 3 + 1).to(dtype)
    h[:, :, 5] = 2.0  # a constant feature (scale 1)
    before = h.clone()
    pos = [8, 0, 3]
    fin = (torch.randn(9, 24, generator=g) * 2).to(dtype)
    r = trajectories(h, include_final, 3, pos, final_state=fin)
    assert torch.equal(h, before)  # the recorded hidden states are never changed
    n = 5 if include_final else 4  # every residual state, plus the final LayerNorm's output
    x = torch.cat([h, fin[None]])[:n].reshape(n * 9, 24).to(torch.float64).numpy()
    proj = PCA(n_components=3, random_state=0).fit_transform(StandardScaler().fit_transform(x))
    paths = proj.reshape(n, 9, 3)[:, pos].transpose(1, 0, 2)
    np.testing.assert_allclose(r["paths"], paths, rtol=1e-9, atol=1e-9)
    first, last = x[pos], x[(n - 1) * 9 + np.array(pos)]
    np.testing.assert_allclose(r["distance_full"], np.linalg.norm(last - first, axis=-1),
                               rtol=1e-12)


# ------------------------------------------------------------------ heads probe memo
def test_probe_memo_is_safe_under_concurrent_heads_requests(gpt2_runtime, monkeypatch):
    """Bug: probe_tokens (run in worker threads) counted the memo's keys by iterating the
    shared dict while another thread could insert into it: 'dictionary changed size during
    iteration' -> 500. The iteration is slowed down here to make the race certain."""
    from attnscope.service.serving import heads as api_heads

    started = threading.Event()

    class SlowIterDict(dict):
        def __iter__(self):
            for k in super().__iter__():
                if threading.current_thread().name == "slow":
                    started.set()
                    threading.Event().wait(0.02)
                yield k

    memo = SlowIterDict({("induction_probe", 1000 + i, 2, 0): None for i in range(10)})
    monkeypatch.setattr(gpt2_runtime, "memo", memo)
    errors = []

    def run(probe, wait):
        try:
            if wait:
                started.wait(5)
            api_heads.probe_tokens(gpt2_runtime, probe)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    a = threading.Thread(target=run, name="slow", args=(NS(segment_length=5, repeats=2, seed=1), False))
    b = threading.Thread(target=run, args=(NS(segment_length=6, repeats=2, seed=2), True))
    a.start(), b.start()
    a.join(10), b.join(10)
    assert not errors, errors
    assert ("induction_probe", 5, 2, 1) in dict.keys(memo)
    assert ("induction_probe", 6, 2, 2) in dict.keys(memo)


# ------------------------------------------------------------------ float16 overflow
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


# ------------------------------------------------------------------ the Python client
def test_client_decodes_base64_batches_exactly(client, gpt2_runtime):
    api = Client("http://testserver", http_client=client, max_retries=0)
    texts = [SENTENCE, LONG, "x y"]
    res = api.attention(texts, encoding="base64", layout="tril", include_scores=True)
    for text, r in zip(texts, res.results):
        fw = _fw(gpt2_runtime, text)
        assert np.array_equal(r.pattern.numpy(), fw.pattern.numpy())
        s, sw = r.scores.numpy(), fw.scores().numpy()
        assert np.array_equal(np.isneginf(s), np.isneginf(sw))
        assert np.array_equal(s[np.isfinite(sw)], sw[np.isfinite(sw)])
    sp = api.attention(texts, encoding="base64", sparse={"top_k": 2, "threshold": 0.05})
    for text, r in zip(texts, sp.results):
        p = _fw(gpt2_runtime, text).pattern.numpy()
        assert np.array_equal(r.pattern.numpy(), _expect_sparse(p, 2, 0.05))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_scratch_base64_round_trip(client, dtype):
    g = np.random.default_rng(0)
    q, k, v = (g.standard_normal((5, 4)).round(3) for _ in range(3))
    body = {"q": q.tolist(), "k": k.tolist(), "v": v.tolist(), "variant": "causal"}
    js = client.post("/v1/scratch-attention", json=body).json()
    b = client.post("/v1/scratch-attention", json={**body, "encoding": "base64",
                                                   "dtype": dtype}).json()
    for name in ("weights", "scores", "output"):
        got = wire.decode_tensor(b[name])
        want = wire.decode_tensor(js[name]).astype(got.dtype)
        assert got.dtype == np.dtype(dtype) and np.array_equal(got, want), name
    big = {"q": (q * 300).tolist(), "k": (k * 300).tolist(), "v": v.tolist()}
    assert_error(client.post("/v1/scratch-attention", json={**big, "encoding": "base64",
                                                           "dtype": "float16"}), param="dtype")


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
        p = _fw(rt, text).pattern
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


def test_libc_is_published_only_with_mallinfo2_restype(monkeypatch):
    """Bug: _libc() published the CDLL in the global before setting mallinfo2's restype; a
    thread interleaving there called mallinfo2 as returning int (glibc then writes the struct
    through a garbage return-slot pointer: memory corruption). Simulated by running the other
    thread's call re-entrantly at the moment the restype is being set."""
    from attnscope.service.runtime import memory

    seen = []

    class Fn:
        restype = None

        def __call__(self):
            seen.append(self.restype)
            return memory._MallInfo2(fordblks=123)

    class FakeLib:
        interleaved = False

        def __init__(self, name):
            self.fn = Fn()

        @property
        def mallinfo2(self):
            if not FakeLib.interleaved:  # the first access: from _libc(), setting restype
                FakeLib.interleaved = True
                memory.free_heap_bytes()  # "another thread" interleaves here
            return self.fn

        def malloc_trim(self, n):
            return 0

    monkeypatch.setattr(memory, "_LIBC", None)
    monkeypatch.setattr(memory.ctypes, "CDLL", FakeLib)
    assert memory.free_heap_bytes() == 123
    assert seen and all(r is memory._MallInfo2 for r in seen), seen


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_keep_freed_memory_serves_big_blocks_from_the_heap():
    """With keep_freed_memory a 24 MiB block comes from glibc's heap, not from a fresh mmap
    (glibc's default for big blocks, which unmaps it on free so the next request faults all
    its pages in again): mmapped bytes (mallinfo2 hblkhd) do not grow while it is alive."""
    from attnscope.service.runtime import memory as M

    assert M.keep_freed_memory(M.TRIM_FREE_BYTES) is True
    try:
        mapped = lambda: M._libc().mallinfo2().hblkhd  # noqa: E731
        before = mapped()
    except AttributeError:
        pytest.skip("mallinfo2 needs glibc >= 2.33")
    a = np.ones(24 << 20, dtype=np.uint8)  # 24 MiB, below the 32 MiB threshold
    assert mapped() - before < 1 << 20
    del a
    b = np.ones(40 << 20, dtype=np.uint8)  # over the threshold: mapped, as before
    assert mapped() - before >= 40 << 20
    del b
    M.release_memory(0)  # 0: trim now; must not raise
