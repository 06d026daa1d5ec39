"""The Python client against the real app in-process (sync via starlette's TestClient, async
via httpx.ASGITransport), its numpy helpers, one test per error type, and its retry policy.

Error types the real app can produce are provoked on the real app; only transport failures
and sequences a healthy local app cannot produce (429 storms, 5xx, dropped connections) use
``httpx.MockTransport``.
"""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest
import torch

import attnscope.client as ac
from attnscope.client import AsyncClient, Client
from attnscope.service.app import create_app
from attnscope.service.config import Settings
from attnscope.service.serving.core.slot import DeviceSlot
from conftest import SENTENCE


@pytest.fixture(scope="module")
def api(client):
    """The client over the in-process app (TestClient is an httpx.Client)."""
    return Client("http://testserver", http_client=client, max_retries=0)


def _asgi_app(runtime, **settings):
    """The real app for httpx.ASGITransport, which does not run the lifespan: set its state."""
    s = Settings(**{"model": "bundled", **settings})
    app = create_app(s, runtime=runtime)
    app.state.settings = s
    app.state.slot = DeviceSlot(s.max_queue, s.max_request_bytes)
    app.state.runtime = runtime
    app.state.load_error = None
    return app


# -- results and numpy --------------------------------------------------------------------

def test_model_and_tokenize_return_schema_models(api, gpt2_runtime):
    info = api.model()
    from attnscope.schemas import ModelInfo, TokenizeResponse

    assert isinstance(info, ModelInfo) and info.n_layers == 2 and info.n_heads == 4
    # the text's own tokens (add_bos false) spell the text
    tok = api.tokenize(SENTENCE, add_bos=False)
    assert isinstance(tok, TokenizeResponse) and tok.add_bos is False
    assert "".join(t.label for t in tok.tokens.tokens) == SENTENCE
    # the default: the model's convention, BOS first for GPT-2, then the same tokens
    dflt = api.tokenize(SENTENCE)
    assert dflt.add_bos is True and dflt.tokens.tokens[0].special
    assert dflt.tokens.tokens[1:] == [t.model_copy(update={"position": t.position + 1})
                                      for t in tok.tokens.tokens]
    many = api.tokenize(["a b", "c"])
    assert [r.n_tokens for r in many.results] == [
        len(gpt2_runtime.tokenize("a b", True, "t")), len(gpt2_runtime.tokenize("c", True, "t"))]


def test_attention_numpy_matches_hugging_face(api, gpt2_runtime):
    """json and base64 give the same float32 array, equal to HF's output_attentions."""
    res = api.attention(SENTENCE)
    js = res.attention.pattern.numpy()
    b64 = api.attention(SENTENCE, encoding="base64").attention.pattern.numpy()
    assert js.dtype == np.float32 and b64.dtype == np.float32
    n = len(res.attention.tokens)
    assert js.shape == b64.shape == (2, 4, n, n)
    ids = torch.tensor([[t.id for t in res.attention.tokens]])
    with torch.no_grad():
        out = gpt2_runtime.model(ids, output_attentions=True)
    hf = torch.stack(out.attentions)[:, 0].numpy()
    np.testing.assert_allclose(js, hf, atol=1e-6)
    np.testing.assert_array_equal(b64, js)
    # head mean, float16 on the wire
    hm = api.attention(SENTENCE, layers=[1], head_mean=True, encoding="base64", dtype="float16")
    a16 = hm.attention.pattern.numpy()
    assert a16.dtype == np.float16 and a16.shape == (1, n, n)
    np.testing.assert_allclose(a16[0], hf[1].mean(0), atol=2e-3)


@pytest.mark.parametrize("form", [
    {"encoding": "base64"}, {"encoding": "base64", "dtype": "float16"}, {"layout": "tril"},
    {"layout": "tril", "encoding": "base64"}, {"binary": True},
    {"binary": True, "layout": "tril"},
])
def test_every_wire_form_decodes_to_the_same_array(api, form):
    """JSON lists are the reference; every other form's .numpy() gives the same array."""
    ref = api.attention(SENTENCE, include_scores=True)
    res = api.attention(SENTENCE, include_scores=True, **form)
    tol = 2e-3 if form.get("dtype") == "float16" else 0
    for field in ("pattern", "scores"):
        want = getattr(ref.attention, field).numpy()
        got = getattr(res.attention, field).numpy()
        assert got.shape == want.shape
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[fin], want[fin], atol=tol, rtol=tol)


def test_sparse_pattern_keeps_top_k_per_row(api):
    dense = api.attention(SENTENCE, layers=[0]).attention.pattern.numpy()
    sp = api.attention(SENTENCE, layers=[0], sparse={"top_k": 2}).attention.pattern.numpy()
    assert sp.shape == dense.shape
    assert ((sp > 0).sum(-1) <= 2).all()
    kept = sp > 0
    np.testing.assert_allclose(sp[kept], dense[kept], rtol=1e-6)
    np.testing.assert_allclose(np.sort(dense, -1)[..., -1], sp.max(-1), rtol=1e-6)


def test_masked_scores_are_neg_inf_in_both_encodings(api):
    js = api.attention("one two three", include_scores=True, layers=[0]).attention.scores.numpy()
    b64 = api.attention("one two three", include_scores=True, layers=[0],
                        encoding="base64").attention.scores.numpy()
    upper = np.triu(np.ones(js.shape[-2:], dtype=bool), k=1)
    assert np.isneginf(js[..., upper]).all() and np.isneginf(b64[..., upper]).all()
    assert np.isfinite(js[..., ~upper]).all()
    np.testing.assert_allclose(js[..., ~upper], b64[..., ~upper], rtol=1e-6)


def test_every_tensor_field_has_numpy(api):
    """Tensor fields are found from the schema, whatever the endpoint."""
    tr = api.trajectories(SENTENCE, encoding="base64").trajectories
    paths = tr.paths.numpy()
    assert paths.shape == (len(tr.positions), len(tr.states), tr.n_components)
    sa = api.scratch_attention(q=np.eye(3), k=np.eye(3), v=np.arange(6.0).reshape(3, 2),
                               variant="causal")
    w = sa.weights.numpy()
    assert w.shape[-2:] == (3, 3)
    np.testing.assert_allclose(w.reshape(3, 3).sum(-1), 1.0, atol=1e-6)
    assert np.triu(w.reshape(3, 3), 1).max() == 0
    assert isinstance(sa.output, (ac.JsonTensor, ac.EncodedTensor))


def test_json_tensor_is_still_a_list_and_serialises(api):
    res = api.attention("a b", layers=[0], head_mean=True, round=4)
    assert isinstance(res.attention.pattern, list)
    dumped = res.model_dump(mode="json")
    assert dumped["attention"]["pattern"] == [list(map(list, m)) for m in res.attention.pattern]
    assert res.model_dump_json()


def test_to_numpy_edge_cases():
    a = np.arange(6, dtype="<f4").reshape(2, 3)
    enc = {"encoding": "base64", "dtype": "float32", "shape": [2, 3],
           "data": base64.b64encode(a.tobytes()).decode()}
    np.testing.assert_array_equal(ac.to_numpy(enc), a)
    with pytest.raises(ValueError, match="shape"):
        ac.to_numpy({**enc, "shape": [4, 3]})
    with pytest.raises(ValueError, match="rectangular"):
        ac.to_numpy([[1, 2], [3]])
    assert ac.to_numpy([[0.5, None]]).tolist() == [[0.5, -np.inf]]


def test_heads_links_verify_methods(api):
    heads = api.heads(SENTENCE, probe={"enabled": False})
    assert len(heads.heads) == 8 and {h.layer for h in heads.heads} == {0, 1}
    links = api.links(SENTENCE, layer=0, head=1, top_k=2)
    assert links.layer == 0 and links.head == 1
    for q in links.links.links:
        assert all(t.key_pos < q.query_pos for t in q.links)  # exclude_self default
    assert api.verify("Then I tried", layers=[0]).verification.passed


def test_async_client_against_in_process_app(gpt2_runtime):
    app = _asgi_app(gpt2_runtime)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://app") as http:
            c = AsyncClient(http_client=http, max_retries=0)
            results = await asyncio.gather(*(c.attention(f"text {i}", layers=[0])
                                             for i in range(4)))
            info = await c.model()
            with pytest.raises(ac.OutOfRangeError):
                await c.attention("x", heads=[9])
            return results, info

    results, info = asyncio.run(go())
    assert info.n_heads == 4
    assert all(r.attention.pattern.numpy().shape[:2] == (1, 4) for r in results)


def test_local_validation_before_sending(api):
    """A request that fails its schema raises the client's own RequestValidationError (an
    AttnscopeError and a ValueError, never pydantic's), naming the field; nothing is sent."""
    import pydantic

    sent = []
    api._http.event_hooks["request"].append(sent.append)
    try:
        for call, param in [(lambda: api.attention("x", layerz=[0]), "layerz"),
                            (lambda: api.attention(""), "text"),
                            (lambda: api.attention("x", round=99), "round"),
                            (lambda: api.heads("x", thresholds={"sink": 2}), "thresholds.sink"),
                            (lambda: api.scratch_attention(q=[[1.0]], variant="sideways"),
                             "variant"),
                            (lambda: api.attention(["a"], texts=["b"]), "texts"),
                            (lambda: api.ablate("hi", heads=[[0]]), "heads.0"),
                            (lambda: api.ablate("hi there", heads=(1, 0)), "heads"),  # flat
                            (lambda: api.ablate("hi there", heads=np.array([1, 0])), "heads"),
                            (lambda: api.ablate("hi there"), None),  # neither heads nor scan
                            (lambda: api.patch("a b", "a"), None),  # no logit_diff
                            (lambda: api.patch("a b", "", metric="loss"), "corrupted_text")]:
            with pytest.raises(ac.AttnscopeError) as ei:
                call()
            e = ei.value
            assert type(e) is ac.RequestValidationError and isinstance(e, ValueError)
            assert not isinstance(e, pydantic.ValidationError)
            assert "Value error" not in e.message and "errors.pydantic" not in e.message
            if param is None:  # a model-level rule: its own message, no field
                assert e.message.startswith("invalid /v1/"), e.message
                continue
            assert e.param == param and param.split(".")[0] in e.message, (param, e.message)
    finally:
        api._http.event_hooks["request"].remove(sent.append)
    assert sent == []


def test_the_422_class_is_not_called_validation_error():
    import warnings

    import pydantic

    assert ac.UnprocessableEntityError.__name__ == "UnprocessableEntityError"
    assert "ValidationError" not in ac.__all__
    with pytest.warns(DeprecationWarning, match="UnprocessableEntityError"):
        old = ac.ValidationError
    assert old is ac.UnprocessableEntityError and old is not pydantic.ValidationError
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert issubclass(ac.OutOfRangeError, ac.UnprocessableEntityError)


def test_configuration_from_environment(monkeypatch):
    monkeypatch.setenv("ATTNSCOPE_BASE_URL", "http://example.invalid:9/")
    monkeypatch.setenv("ATTNSCOPE_API_KEY", "k-123")
    seen = {}

    def handler(request):
        seen["url"] = str(request.url)
        seen["auth"] = request.headers.get("authorization")
        return httpx.Response(200, json={"status": "ok"})

    with Client(http_client=httpx.Client(transport=httpx.MockTransport(handler))) as c:
        assert c.health() == {"status": "ok"}
    assert seen == {"url": "http://example.invalid:9/healthz", "auth": "Bearer k-123"}


# -- one test per error type: the real app ------------------------------------------------

def _raises(exc_type, etype, fn):
    with pytest.raises(exc_type) as ei:
        fn()
    e = ei.value
    assert type(e) is exc_type and e.type == etype and e.message
    assert type(e.__cause__).__name__ == "HTTPStatusError"  # httpx, or httpx2 (TestClient)
    return e


def test_error_validation_error(api):
    e = _raises(ac.UnprocessableEntityError, "validation_error",
                lambda: api.request("POST", "/v1/attention", {"text": "   "}))
    assert e.status_code == 422 and e.param == "text"


def test_error_context_length_exceeded(api):
    e = _raises(ac.ContextLengthExceededError, "context_length_exceeded",
                lambda: api.attention("word " * 400))
    assert "256" in e.message and isinstance(e, ac.UnprocessableEntityError)


def test_error_out_of_range(api):
    e = _raises(ac.OutOfRangeError, "out_of_range", lambda: api.attention("x", layers=[7]))
    assert e.param == "layers.0"


def test_error_batch_too_large(api):
    _raises(ac.BatchTooLargeError, "batch_too_large", lambda: api.attention(["a"] * 40))


def test_error_memory_limit_exceeded(make_client, gpt2_runtime):
    import copy

    rt = copy.copy(gpt2_runtime)  # the limit is read from the runtime's settings
    rt.settings = gpt2_runtime.settings.model_copy(update={"max_request_bytes": 1})
    c = Client(http_client=make_client(rt), max_retries=0)
    _raises(ac.MemoryLimitExceededError, "memory_limit_exceeded", lambda: c.attention(SENTENCE))


def test_error_payload_too_large(make_client, gpt2_runtime):
    c = Client(http_client=make_client(gpt2_runtime, max_body_bytes=1024), max_retries=0)
    e = _raises(ac.PayloadTooLargeError, "payload_too_large", lambda: c.attention("x " * 1000))
    assert e.status_code == 413


def test_error_not_found_and_method_not_allowed(api):
    _raises(ac.NotFoundError, "not_found", lambda: api.request("GET", "/v1/nope"))
    _raises(ac.MethodNotAllowedError, "method_not_allowed",
            lambda: api.request("GET", "/v1/attention"))


def test_error_unauthorized(make_client, gpt2_runtime):
    http = make_client(gpt2_runtime, api_keys="secret-1")
    with pytest.raises(ac.UnauthorizedError) as ei:
        Client(http_client=http, max_retries=0, api_key="wrong").model()
    assert ei.value.type == "unauthorized" and ei.value.status_code == 401
    assert Client(http_client=http, api_key="secret-1").model().n_layers == 2


def test_error_not_ready_is_retried_then_raised():
    """A real app whose model is not loaded: 503 not_ready, retried, then raised."""
    app = create_app(Settings(model="bundled"))  # lifespan not run: no runtime on app.state
    calls = []
    transport = httpx.ASGITransport(app=app)

    class Counting(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            calls.append(request.url.path)
            return await transport.handle_async_request(request)

    async def go():
        async with httpx.AsyncClient(transport=Counting(), base_url="http://app") as http:
            c = AsyncClient(http_client=http, max_retries=2)
            delays = []

            async def sleep(d):
                delays.append(d)
            c._sleep = sleep
            with pytest.raises(ac.NotReadyError) as ei:
                await c.attention("x")
            return ei.value, delays

    e, delays = asyncio.run(go())
    assert e.type == "not_ready" and e.status_code == 503 and len(calls) == 3
    assert len(delays) == 2 and 0.375 <= delays[0] <= 0.5 and 0.75 <= delays[1] <= 1.0


# -- one test per error type: transports that fail on purpose -----------------------------

def _mock(responses, record=None):
    """A client over MockTransport answering from ``responses`` in order (last repeats)."""
    it = iter(responses)
    last = {}

    def handler(request):
        if record is not None:
            record.append(request)
        try:
            r = next(it)
            last["r"] = r
        except StopIteration:
            r = last["r"]
        if isinstance(r, Exception):
            raise r
        return r

    c = Client("http://svc", http_client=httpx.Client(transport=httpx.MockTransport(handler)),
               max_retries=3)
    c.delays = []
    c._sleep = c.delays.append
    return c


def _env(status, etype, headers=None):
    return httpx.Response(status, headers=headers,
                          json={"error": {"type": etype, "message": f"{etype} happened",
                                          "param": None}})


def test_error_overloaded_retried_with_retry_after():
    reqs = []
    c = _mock([_env(429, "overloaded", {"Retry-After": "2"}), _env(429, "overloaded"),
               httpx.Response(200, json={"status": "ok"})], reqs)
    assert c.health() == {"status": "ok"}
    assert len(reqs) == 3 and c.delays[0] == 2.0 and 0.75 <= c.delays[1] <= 1.0
    c = _mock([_env(429, "overloaded", {"retry-after-ms": "150"})])
    with pytest.raises(ac.OverloadedError) as ei:
        c.health()
    assert ei.value.type == "overloaded" and c.delays == [0.15] * 3


def test_retry_after_http_date_and_cap():
    from email.utils import formatdate
    import time

    c = _mock([_env(503, "not_ready", {"Retry-After": formatdate(time.time() + 3, usegmt=True)}),
               _env(503, "not_ready", {"Retry-After": "3600"}),
               httpx.Response(200, json={})])
    c.health()
    assert 1.0 <= c.delays[0] <= 3.01  # HTTP date honoured
    assert c.delays[1] <= 1.0  # over 60 s: ignored, backoff used


def test_error_internal_error_retried_then_raised():
    reqs = []
    c = _mock([_env(500, "internal_error")], reqs)
    with pytest.raises(ac.InternalServerError) as ei:
        c.model()
    assert ei.value.type == "internal_error" and len(reqs) == 4
    # exponential backoff: 0.5, 1, 2 s (minus <= 25 % jitter)
    for d, base in zip(c.delays, [0.5, 1.0, 2.0]):
        assert 0.75 * base <= d <= base


def test_error_non_finite_values_not_retried():
    reqs = []
    c = _mock([_env(500, "non_finite_values")], reqs)
    with pytest.raises(ac.NonFiniteValuesError):
        c.model()
    assert len(reqs) == 1


def test_error_gateway_timeout():
    c = _mock([_env(504, "timeout")])
    with pytest.raises(ac.GatewayTimeoutError) as ei:
        c.model()
    assert ei.value.type == "timeout" and len(c.delays) == 3


def test_error_request_timeout_408_retried():
    c = _mock([httpx.Response(408, text="slow"), httpx.Response(200, json={"status": "ok"})])
    assert c.health() == {"status": "ok"} and len(c.delays) == 1


def test_error_not_acceptable_and_unknown_types_fall_back_by_status():
    with pytest.raises(ac.NotAcceptableError):
        _mock([_env(406, "not_acceptable")]).health()
    with pytest.raises(ac.UnprocessableEntityError) as ei:
        _mock([_env(422, "brand_new_problem")]).health()
    assert ei.value.type == "brand_new_problem"
    with pytest.raises(ac.BadRequestError):
        _mock([httpx.Response(400, text="no envelope")]).health()


def test_error_connection_refused_retried_then_raised():
    reqs = []
    c = _mock([httpx.ConnectError("refused")], reqs)
    with pytest.raises(ac.APIConnectionError) as ei:
        c.model()
    assert len(reqs) == 4 and isinstance(ei.value.__cause__, httpx.ConnectError)
    c = _mock([httpx.ConnectError("refused"), httpx.Response(200, json={"status": "ok"})])
    assert c.health() == {"status": "ok"}


def test_error_read_timeout():
    c = _mock([httpx.ReadTimeout("slow")])
    with pytest.raises(ac.APITimeoutError) as ei:
        c.model()
    assert isinstance(ei.value, ac.APIConnectionError)
    assert isinstance(ei.value.__cause__, httpx.ReadTimeout)


def test_error_response_not_fitting_schema():
    c = _mock([httpx.Response(200, json={"id": "x"})])
    with pytest.raises(ac.APIResponseValidationError):
        c.model()


def test_connection_error_against_closed_port():
    from conftest import free_port

    with Client(f"http://127.0.0.1:{free_port()}", max_retries=1) as c:
        c._sleep = lambda d: None
        with pytest.raises(ac.APIConnectionError) as ei:
            c.model()
    assert isinstance(ei.value.__cause__, httpx.ConnectError)


def test_batch_in_process_timeouts_recorded_connection_loss_stops(gpt2_runtime, tmp_path):
    """run_batch over the real app; a transport that times out on one text and then loses the
    connection: the timeout is a recorded failure, the connection loss stops the run and
    leaves the remaining ids for the next run."""
    import json

    from attnscope.client.batch import run_batch

    app_transport = httpx.ASGITransport(app=_asgi_app(gpt2_runtime))
    state = {"down": False}

    async def handler(request):
        text = json.loads(request.content)["text"]
        if text == "slow":
            raise httpx.ReadTimeout("slow", request=request)
        if text == "down" or state["down"]:
            state["down"] = True
            raise httpx.ConnectError("refused", request=request)
        return await app_transport.handle_async_request(request)

    lines = [json.dumps({"id": i, "text": t}) for i, t in
             enumerate(["a b", "slow", "c d", "word " * 300])]
    out, fails = str(tmp_path / "o.jsonl"), str(tmp_path / "f.jsonl")

    async def go(lines, transport):
        async with httpx.AsyncClient(transport=transport) as http:
            c = AsyncClient("http://app", http_client=http, max_retries=0)
            return await run_batch(c, lines, out, fails, {"tokenize": {}}, concurrency=1,
                                   progress=False)

    s = asyncio.run(go(lines, httpx.MockTransport(handler)))
    assert (s.done, s.failed, s.stopped) == (2, 2, None)
    assert s.failed_types == {"client_timeout": 1, "context_length_exceeded": 1}
    more = lines + [json.dumps({"id": 9, "text": "down"}), json.dumps({"id": 10, "text": "x"})]
    s = asyncio.run(go(more, httpx.MockTransport(handler)))
    assert s.skipped == 4 and s.done == 0 and s.failed == 0
    assert s.stopped and "connection failure" in s.stopped
    state["down"] = False
    s = asyncio.run(go(more, app_transport))
    assert (s.done, s.skipped) == (2, 4)
    ids = [json.loads(l)["id"] for p in (out, fails) for l in open(p)]
    assert sorted(ids) == [0, 1, 2, 3, 9, 10]


# ------------------------------------------------------------------ the Python client
LONG = "The" + " cat sat on the mat." * 31  # 249 tokens: > 4 MB of base64 with scores


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


def _fw(rt, text, add_bos=False):
    return rt.forward_many([rt.tokenize(text, add_bos)])[0]


@pytest.mark.regression
def test_client_decodes_base64_batches_exactly(client, gpt2_runtime):
    api = Client("http://testserver", http_client=client, max_retries=0)
    texts = [SENTENCE, LONG, "x y"]
    res = api.attention(texts, encoding="base64", layout="tril", include_scores=True)
    assert res.add_bos is True  # the reference on the tokens the response reports: BOS first
    for text, r in zip(texts, res.results):
        fw = _fw(gpt2_runtime, text, True)
        assert [t.id for t in r.tokens] == list(fw.tokens.input_ids)
        assert np.array_equal(r.pattern.numpy(), fw.pattern.numpy())
        s, sw = r.scores.numpy(), fw.scores().numpy()
        assert np.array_equal(np.isneginf(s), np.isneginf(sw))
        assert np.array_equal(s[np.isfinite(sw)], sw[np.isfinite(sw)])
    sp = api.attention(texts, encoding="base64", sparse={"top_k": 2, "threshold": 0.05})
    for text, r in zip(texts, sp.results):
        p = _fw(gpt2_runtime, text, True).pattern.numpy()
        assert np.array_equal(r.pattern.numpy(), _expect_sparse(p, 2, 0.05))


def test_head_pairs_from_arrays_are_plain_ints():
    import torch

    from attnscope.client._client import _head_pairs

    for heads in (np.array([[1, 0], [1, 3]]), torch.tensor([[1, 0], [1, 3]]),
                  [np.array([1, 0]), (1, 3)]):
        got = _head_pairs(heads)
        assert got == [[1, 0], [1, 3]] and all(type(x) is int for h in got for x in h), got
