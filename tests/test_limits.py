"""Request limits and validation: the memory limit (max_request_bytes, exactly at and over the
estimate), index lists (repeats, giant lists, out of range) and no type coercion across JSON
types. Each bad request is a 4xx envelope naming the field and the limit; the service keeps serving.
"""

from __future__ import annotations

import re

import pytest

from asgi_gone import GoneClient
from conftest import assert_error as _err


# --- no coercion across JSON types (pydantic strict mode on every request model) ---------

def _still_serving(client):
    r = client.post("/v1/attention", json={"text": "hello world", "layers": [0]})
    assert r.status_code == 200, r.text


@pytest.mark.regression
@pytest.mark.parametrize("path,body,param", [
    ("/v1/tokenize", {"text": "hi", "add_bos": "yes"}, "add_bos"),
    ("/v1/attention", {"text": "hi", "add_bos": 1}, "add_bos"),
    ("/v1/attention", {"text": "hi", "layers": [True]}, "layers.0"),
    ("/v1/attention", {"text": "hi", "layers": [0.5]}, "layers.0"),
    ("/v1/attention", {"text": "hi", "heads": ["0"]}, "heads.0"),
    ("/v1/attention", {"text": "hi", "round": True}, "round"),
    ("/v1/attention", {"text": "hi", "sparse": {"top_k": True}}, "sparse.top_k"),
    ("/v1/links", {"text": "hi there", "layer": True}, "layer"),
    ("/v1/links", {"text": "hi there", "layer": "1"}, "layer"),
    ("/v1/links", {"text": "hi there", "layer": 1.5}, "layer"),
    ("/v1/heads", {"text": "hi there", "thresholds": {"sink": "0.5"}}, "thresholds.sink"),
    ("/v1/heads", {"text": "hi there", "probe": {"enabled": "false"}}, "probe.enabled"),
    ("/v1/trajectories", {"text": "hi there", "n_components": 2.5}, "n_components"),
    ("/v1/verify", {"text": "hi there", "tolerance": True}, "tolerance"),
    ("/v1/scratch-attention", {"q": [[True, False]], "k": [[1, 0]], "v": [[1, 0]]}, "q.0.0"),
])
def test_no_type_coercion(client, path, body, param):
    e = _err(client.post(path, json=body), param=param)
    assert e["type"] == "validation_error"
    _still_serving(client)


def test_integral_numbers_are_integers(client):
    """JSON Schema's ``integer`` (what the OpenAPI says) is any number with a zero fractional
    part: ``1.0`` is the index 1, as schemathesis generates it."""
    r = client.post("/v1/attention", json={"text": "hi", "layers": [1.0], "round": 3.0})
    assert r.status_code == 200, r.text
    assert r.json()["attention"]["layers"] == [1]
    r = client.post("/v1/links", json={"text": "hi there", "layer": 1e0})
    assert r.status_code == 200, r.text


@pytest.mark.regression
def test_ints_still_accepted_for_floats(client):
    r = client.post("/v1/verify", json={"text": "hi there", "tolerance": 1})
    assert r.status_code == 200, r.text
    r = client.post("/v1/scratch-attention", json={"q": [[1, 0]], "k": [[1, 0]], "v": [[1, 0]]})
    assert r.status_code == 200, r.text


# --- repeated indices multiplied the work and the response (a 300 kB body ran for minutes) -

TEXT = "The cat sat on the mat. The cat sat on the mat."


@pytest.mark.regression
@pytest.mark.parametrize("path,body,param", [
    ("/v1/attention", {"text": TEXT, "layers": [0, 1, 0]}, "layers.2"),
    ("/v1/attention", {"text": TEXT, "heads": [3, 3]}, "heads.1"),
    ("/v1/verify", {"text": TEXT, "layers": [1, 1]}, "layers.1"),
    ("/v1/links", {"text": TEXT, "layer": 0, "ignore": [0, 2, 0]}, "ignore.2"),
    ("/v1/trajectories", {"text": TEXT, "positions": [1, 1]}, "positions.1"),
])
def test_repeated_indices_rejected(client, path, body, param):
    e = _err(client.post(path, json=body), param=param)
    assert "repeats" in e["message"] and "once" in e["message"]


@pytest.mark.regression
@pytest.mark.parametrize("path,body", [
    ("/v1/attention", {"text": TEXT, "layers": [0] * 200_000}),
    ("/v1/verify", {"text": TEXT, "layers": [0] * 200_000}),
    ("/v1/links", {"text": TEXT, "layer": 0, "ignore": [0] * 200_000}),
    ("/v1/trajectories", {"text": TEXT, "positions": [0] * 200_000}),
])
def test_giant_index_lists_fail_fast(client, gpt2_runtime, path, body):
    forwards = gpt2_runtime.forward_count
    _err(client.post(path, json=body))
    assert gpt2_runtime.forward_count == forwards  # refused before any forward
    _still_serving(client)


class _Untouchable:
    """An index the check must never look at (any use of it raises)."""

    def __index__(self):
        raise AssertionError("check_indices looked past limit + 1 entries")

    __int__ = __index__

    def __eq__(self, other):
        raise AssertionError("check_indices looked past limit + 1 entries")

    __lt__ = __le__ = __gt__ = __ge__ = __eq__
    __hash__ = object.__hash__


@pytest.mark.regression
@pytest.mark.parametrize("head", [[0, 1, 0, 2], [0, 1, 2, 3], [0, 99, 1, 2]])
def test_index_checks_read_at_most_limit_plus_one_entries(head):
    """O(limit) for any length (a 3.9 MB list was checked element by element, 1.1 s of
    event-loop time): entries after the first limit + 1 are never read. Planted fault: a check
    that reads the whole list touches an _Untouchable and fails."""
    from attnscope.service.errors import InvalidRequest, OutOfRange
    from attnscope.service.serving.core.checks import check_indices

    values = head + [_Untouchable()] * 100_000
    with pytest.raises((InvalidRequest, OutOfRange)):
        check_indices(values, 3, "layers", "layer")
    with pytest.raises(AssertionError, match="looked past"):  # the probe itself works
        check_indices([_Untouchable()], 3, "layers", "layer")


@pytest.mark.regression
def test_ignore_out_of_range_names_first_offender(client):
    # the texts' own tokens (add_bos false): "a" is one token
    e = _err(client.post("/v1/links", json={"texts": ["a b c d e f", "a"], "layer": 0,
                                            "ignore": [0, 3, 5], "add_bos": False}),
             type_="out_of_range")
    assert e["param"] == "ignore.1" and "texts.1 has 1 token (valid positions 0..0)" in e["message"]


# ------------------------------------------------------------------ memory limit
SHORT_TEXT = "The cat sat on the mat."
TEXTS = [SHORT_TEXT, "Hi", "A much longer sentence about nothing in particular here."]


def _estimate(c, path, body) -> int:
    e = _err(c.post(path, json=body), 422, "memory_limit_exceeded")
    assert "max_request_bytes = 1)" in e["message"]
    return int(re.search(r"\((\d+) bytes\) of memory", e["message"]).group(1))


@pytest.mark.regression
@pytest.mark.parametrize("path,body", [
    ("/v1/attention", {"text": SHORT_TEXT}),
    ("/v1/attention", {"texts": TEXTS, "include_scores": True, "encoding": "base64"}),
    ("/v1/attention", {"texts": TEXTS, "layout": "tril", "dtype": "float16",
                       "encoding": "base64"}),
    ("/v1/attention", {"text": SHORT_TEXT, "sparse": {"top_k": 2}}),
    ("/v1/heads", {"texts": TEXTS}), ("/v1/links", {"texts": TEXTS, "layer": 1}),
    ("/v1/trajectories", {"text": SHORT_TEXT}), ("/v1/verify", {"texts": TEXTS}),
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
    assert over.post("/v1/tokenize", json={"text": SHORT_TEXT}).status_code == 200  # no forward
    assert ok.post(path, json=body).status_code == 200  # the next good request


@pytest.mark.regression
def test_memory_limit_zero_means_none(make_client, gpt2_runtime):
    c = make_client(gpt2_runtime, max_request_bytes=0)
    assert c.post("/v1/attention", json={"texts": TEXTS}).status_code == 200


@pytest.mark.regression
def test_heads_memory_message_names_the_probe(make_client, gpt2_runtime):
    """/v1/heads runs the induction probe as a second forward: the 422 counts it and says so;
    without the probe the count is the user's own texts."""
    c = make_client(gpt2_runtime, max_request_bytes=1)
    e = _err(c.post("/v1/heads", json={"text": SHORT_TEXT}), 422, "memory_limit_exceeded")
    assert "2 texts, one of them the induction probe" in e["message"]
    e = _err(c.post("/v1/heads", json={"text": SHORT_TEXT, "probe": {"enabled": False}}), 422,
             "memory_limit_exceeded")
    assert "1 text," in e["message"] and "probe" not in e["message"]


# ------------------------------------------------ bounded cost of refusing a body (issue 17)
# A 3.8 MB body of 1.9 million invalid list elements made pydantic build one error each (27 s,
# +2.2 GB, the one-at-a-time body parser blocked for everyone); 400k unknown keys one each.

def _arrays_without_max_items(schema: dict) -> list[str]:
    """Paths of the arrays in a JSON schema that have no ``maxItems``."""
    out: list[str] = []

    def walk(x, path):
        if isinstance(x, dict):
            if x.get("type") == "array" and "maxItems" not in x:
                out.append(path or "/")
            for k, v in x.items():
                walk(v, f"{path}/{k}")
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{path}/{i}")

    walk(schema, "")
    return out


def _request_models() -> list[type]:
    import attnscope.schemas  # noqa: F401 - every schema module imported
    from attnscope.schemas.common import StrictModel

    seen, todo = [], [StrictModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.append(sub)
                todo.append(sub)
    return [m for m in seen if m.__module__.startswith("attnscope.schemas")]


@pytest.mark.regression
def test_every_list_in_a_request_schema_has_a_max_length():
    models = _request_models()
    assert len(models) >= 15
    unbounded = {m.__name__: p for m in models if (p := _arrays_without_max_items(
        m.model_json_schema()))}
    assert unbounded == {}


def test_planted_fault_an_unbounded_request_list_is_seen():
    from pydantic import BaseModel

    class Unbounded(BaseModel):  # not a StrictModel: the walk above never sees it
        xs: list[list[int]] | None = None

    assert _arrays_without_max_items(Unbounded.model_json_schema()) == [
        "/properties/xs/anyOf/0", "/properties/xs/anyOf/0/items"]


def _keys(n: int) -> dict:
    return {f"{i}k": 0 for i in range(n)}  # no field starts with a digit


HUGE = 200_000  # invalid elements / unknown keys per body: one error each before the fix
BAD_BODIES = {
    # name: (path, body, param, words in the message)
    "texts of ints": ("/v1/attention", {"texts": [5] * HUGE}, "texts",
                      "at most 4096 items after validation, not 200000"),
    "texts of ints within the limit": ("/v1/attention", {"texts": [5] * 4000}, "texts.0",
                                       "valid string"),
    "scratch row of strings": ("/v1/scratch-attention",
                               {"q": [[""] * HUGE], "k": [[1]], "v": [[1]]}, "q.0.0",
                               "valid number"),
    "scratch rows of strings": ("/v1/scratch-attention",
                                {"q": [[""] * 1000] * 512, "k": [[1]], "v": [[1]]}, "q.0.0",
                                "valid number"),
    "scratch too many rows": ("/v1/scratch-attention",
                              {"q": [[""]] * HUGE, "k": [[1]], "v": [[1]]}, "q",
                              "at most 512 items"),
    "layers of strings": ("/v1/attention", {"text": TEXT, "layers": ["0"] * 1000}, "layers.0",
                          "valid integer"),
    "positions too long": ("/v1/predictions", {"text": TEXT, "positions": [-1] * HUGE},
                           "positions", "at most 131072 items"),
    "ignore of negatives": ("/v1/links", {"text": TEXT, "layer": 0, "ignore": [-1] * 100_000},
                            "ignore.0", "greater than or equal to 0"),
    "ablate pairs": ("/v1/ablate", {"text": TEXT, "heads": [[0]] * 10_000}, "heads.0",
                     "at least 2 items"),
    "ablate pairs too many": ("/v1/ablate", {"text": TEXT, "heads": [[0, 0]] * 20_000}, "heads",
                              "at most 16384 items"),
    "reference texts": ("/v1/ablate", {"text": TEXT, "heads": [[0, 0]], "method": "mean",
                                       "reference_texts": [1] * HUGE}, "reference_texts",
                        "at most 4096 items"),
    "unknown keys": ("/v1/attention", {"text": TEXT, **_keys(HUGE)}, "0k",
                     # 14: the 12 before issue 25 item 1 and the token-id twins tokens, token_lists
                     f"the object has {HUGE + 1} keys, AttentionRequest has 14 fields"),
    "unknown keys in thresholds": ("/v1/heads", {"text": TEXT, "thresholds": _keys(HUGE)},
                                   "thresholds.0k",
                                   f"the object has {HUGE} keys, HeadThresholds has 7 fields"),
}


@pytest.mark.regression
@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_a_body_of_many_invalid_elements_costs_one_error(client, name):
    """One error, at the first problem or at the list's length, named with the limit; the
    request model gives exactly one error (so do the client's local checks, which use it)."""
    import orjson
    from pydantic import ValidationError

    from attnscope import schemas

    path, body, param, words = BAD_BODIES[name]
    e = _err(client.post(path, content=orjson.dumps(body),
                         headers={"content-type": "application/json"}), 422, "validation_error",
             param)
    assert words in e["message"] and "more problem" not in e["message"], e
    model = {"/v1/attention": schemas.AttentionRequest, "/v1/heads": schemas.HeadsRequest,
             "/v1/links": schemas.LinksRequest, "/v1/predictions": schemas.PredictionsRequest,
             "/v1/ablate": schemas.AblateRequest,
             "/v1/scratch-attention": schemas.ScratchAttentionRequest}[path]
    with pytest.raises(ValidationError) as exc:
        model.model_validate(body)
    assert exc.value.error_count() == 1
    _still_serving(client)


@pytest.mark.regression
def test_lists_at_their_limit_are_valid():
    from pydantic import ValidationError

    from attnscope import schemas
    from attnscope.schemas.common import MAX_INDICES, MAX_TEXTS

    assert len(schemas.AttentionRequest(texts=["a"] * MAX_TEXTS).texts) == MAX_TEXTS
    assert len(schemas.AttentionRequest(text="a", layers=list(range(MAX_INDICES))).layers) == \
        MAX_INDICES
    with pytest.raises(ValidationError, match=f"at most {MAX_TEXTS} items"):
        schemas.AttentionRequest(texts=["a"] * (MAX_TEXTS + 1))
    r = schemas.HeadsRequest(text="a", thresholds={"sink": 0.1, "self": 0.2})
    assert r.thresholds.sink == 0.1 and r.thresholds.self == 0.2


def test_the_client_refuses_an_overlong_list_before_sending():
    """The Python client validates with the same request models: nothing is sent."""
    import httpx

    from attnscope.client import Client, RequestValidationError

    def handler(request):
        raise AssertionError("the client sent the request")

    with Client(http_client=httpx.Client(transport=httpx.MockTransport(handler)),
                max_retries=0) as c:
        with pytest.raises(RequestValidationError) as exc:
            c.attention(texts=["a"] * 5000)
    assert exc.value.param == "texts" and "at most 4096 items" in str(exc.value)


# --- device time (issue 29 item 6): estimated and limited, cancelled at the deadline -------
# or when the client goes away; the device slot and the memory budget are freed at once

SEG = [1210, 45, 1600, 388, 1777, 90, 1402, 633]
PAIR = {"clean_tokens": [0] + SEG + SEG, "corrupted_tokens": [0] + SEG[::-1] + SEG}
LOSS = {"kind": "loss", "terms": [{"position": 10}]}


def test_forward_flops_is_the_hand_count():
    """One GPT-2-small layer at T tokens: 4 projections d x d and the MLP d x 4d per token,
    the scores and weighted values T x T x d, each multiply-add 2 operations."""
    from attnscope.service.serving.core.estimates import forward_flops

    T, d, m = 128, 768, 3072
    hand = 12 * (2 * T * (4 * d * d + 2 * d * m) + 2 * 2 * T * T * d)
    assert forward_flops(T, 12, d, m) == hand
    assert forward_flops(T, 12, d, m, rows=3, layers=4) == 3 * hand / 3
    assert forward_flops(T, 12, d, m, logit_positions=2, d_vocab=100) == hand + 2 * 2 * d * 100


@pytest.mark.parametrize("path,body,param", [
    ("/v1/path-patch", {"pairs": [PAIR] * 8, "grid": True, "metric": LOSS}, "pairs"),
    ("/v1/logit-lens", {"texts": ["a b c d e f"] * 4}, "texts"),
    ("/v1/attention", {"texts": ["one two three four five"] * 3}, "texts"),
])
def test_device_limit_is_a_named_422_and_the_service_keeps_serving(make_client, gpt2_runtime,
                                                                    path, body, param):
    """Over max_request_flops: 422 device_limit_exceeded naming the limit and the estimate,
    before any forward; with the limit off the same request is served."""
    c = make_client(gpt2_runtime, max_request_flops=1e5)
    before = gpt2_runtime.forward_count
    r = c.post(path, json=body)
    err = _err(r, 422, "device_limit_exceeded", param)
    assert "max_request_flops" in err["message"] and "estimated" in err["message"]
    assert gpt2_runtime.forward_count == before  # refused before any forward
    assert c.app.state.slot.depth == 0 and c.app.state.engine.budget.in_use == 0
    ok = make_client(gpt2_runtime, max_request_flops=0).post(path, json=body)
    assert ok.status_code == 200, ok.text[:300]


def test_device_estimate_grows_with_the_work(make_client, gpt2_runtime):
    """The estimate named in the refusal: 8 pairs cost 8x one pair (path-patch grid), and 4
    texts 4x one (logit lens), so the limit counts pairs x cells and texts x layers."""
    c = make_client(gpt2_runtime, max_request_flops=1e3)

    def estimate(path, body):
        m = re.search(r"\(([0-9.e+]+) floating-point operations\)",
                      c.post(path, json=body).json()["error"]["message"])
        return float(m.group(1))

    one = estimate("/v1/path-patch", {"pairs": [PAIR], "grid": True, "metric": LOSS})
    eight = estimate("/v1/path-patch", {"pairs": [PAIR] * 8, "grid": True, "metric": LOSS})
    assert eight == pytest.approx(8 * one, rel=1e-3)
    one = estimate("/v1/logit-lens", {"text": "a b c d e f"})
    four = estimate("/v1/logit-lens", {"texts": ["a b c d e f"] * 4})
    assert four == pytest.approx(4 * one, rel=1e-3)


def _spin_app(gpt2_runtime, **settings):
    """The real app with one more endpoint from the table: a job that runs torch ops until it
    is cancelled (``python`` true: a pure-Python loop calling ``checkpoint``). ``started`` is
    set once the job has the device; without cancellation it would never end."""
    import threading

    import torch
    from pydantic import BaseModel

    from attnscope.service.app import create_app
    from attnscope.service.config import Settings
    from attnscope.service.serving.core.cancel import checkpoint
    from attnscope.service.serving.core.engine import Plan
    from attnscope.service.serving.core.table import Endpoint, default_table

    class SpinRequest(BaseModel):
        python: bool = False
        matmul: bool = False

    class SpinResponse(BaseModel):
        done: bool

    started = threading.Event()
    ended: list = []

    def plan(rt, req, items):
        def job(_):
            started.set()
            try:
                x = torch.ones(4)
                m = torch.ones(64, 64)
                while True:
                    if req.python:
                        checkpoint()
                    elif req.matmul:
                        m = (m @ m) * 0.0 + 1.0
                    else:
                        x = x * 1.0
            except BaseException as exc:
                ended.append(type(exc).__name__)
                raise
        return Plan([], job, response_bytes=1 << 20)

    spin = Endpoint(path="/v1/spin", name="spin", request=SpinRequest, response=SpinResponse,
                    summary="spin", description="spin", plan=plan, tokenize=False, order=999)
    app = create_app(Settings(model="bundled", **settings), runtime=gpt2_runtime,
                     endpoints=[*default_table(), spin])
    return app, started, ended


@pytest.mark.parametrize("python", [False, True])
def test_a_job_past_its_deadline_is_stopped_and_frees_the_device(gpt2_runtime, python):
    """A job that never ends by itself (torch ops forever, or a Python loop with
    checkpoints) gets its 504 at request_timeout_s and is stopped there: the device slot,
    the memory budget and the abandoned set empty, and the next request is served. Before
    (issue 29) it ran to completion on the device thread (here: forever)."""
    from fastapi.testclient import TestClient

    app, started, ended = _spin_app(gpt2_runtime, request_timeout_s=0.5)
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/spin", json={"python": python})
        err = _err(r, 504, "timeout")
        assert "request_timeout_s" in err["message"]
        assert started.is_set() and ended == ["JobCancelled"]
        # the in-process client returns once the handler has ended: nothing is left behind
        assert app.state.slot.depth == 0 and app.state.engine.budget.in_use == 0
        assert not app.state.abandoned and not app.state.jobs
        _still_serving(c)


def test_a_job_queued_past_its_deadline_never_starts(gpt2_runtime):
    """The device is held until the queued request's 504 was sent; then its path-patch job
    gets the device and stops at its first check: no hooked forward of it runs."""
    import threading

    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app
    from attnscope.service.config import Settings
    from attnscope.service.runtime import hooked as H

    app = create_app(Settings(model="bundled", request_timeout_s=0.2), runtime=gpt2_runtime)
    released = threading.Event()
    calls = []
    run = H.run

    def counted(*a, **kw):
        calls.append(1)
        return run(*a, **kw)

    H.run = counted
    try:
        with TestClient(app, raise_server_exceptions=False) as c:
            held = c.portal.start_task_soon(app.state.slot.run, released.wait, 300)
            try:
                while app.state.slot.depth < 1:
                    threading.Event().wait(0.01)
                holder = threading.Thread(target=lambda: (
                    app.state.__dict__.setdefault("_r", []).append(c.post(
                        "/v1/path-patch", json={"pairs": [PAIR] * 4, "grid": True,
                                                "metric": LOSS}))))
                holder.start()
                while not app.state.abandoned:  # its 504 was sent while the device was held
                    threading.Event().wait(0.01)
            finally:
                released.set()
            holder.join()
            held.result(timeout=300)
            r = app.state._r[0]
            _err(r, 504, "timeout")
            assert calls == []  # stopped before its first hooked forward
            assert app.state.slot.depth == 0 and app.state.engine.budget.in_use == 0
            _still_serving(c)
    finally:
        H.run = run


def test_a_client_that_goes_away_stops_its_job(gpt2_runtime):
    """The ASGI conversation of a client that disconnects once its job has the device (the
    server's receive() says http.disconnect): the job stops, the device and budget are free,
    nothing is answered (499 in the access log)."""
    import asyncio

    app, started, ended = _spin_app(gpt2_runtime, request_timeout_s=0)

    async def main():
        async with app.router.lifespan_context(app):
            gc = GoneClient("/v1/spin", b'{"python": false}')
            task = asyncio.create_task(gc(app))
            while not started.is_set():
                await asyncio.sleep(0.01)
            gc.gone.set()
            await task
            assert ended == ["JobCancelled"]
            assert app.state.slot.depth == 0 and app.state.engine.budget.in_use == 0
            assert not app.state.jobs
            return gc

    gc = asyncio.run(main())
    # whatever the app tried to answer went to a client that was gone: never a 200
    assert 200 not in gc.statuses()


# --- /v1/tokenize is admitted (issue 29 item 9): its estimate against the memory limits -----

def test_tokenize_is_admitted_by_the_memory_limits(make_client, gpt2_runtime):
    """A tokenize request bigger than max_request_bytes is a named 422, and one that finds the
    memory budget held by others waits budget_wait_s and gets 429 with Retry-After; a small
    one is served. Before: tokenize took neither limit."""
    text = "word " * 2000  # 10,000 bytes -> an upper bound of 10,001 tokens
    c = make_client(gpt2_runtime, max_request_bytes=1 << 20)
    err = _err(c.post("/v1/tokenize", json={"text": text}), 422, "memory_limit_exceeded", "text")
    assert "max_request_bytes" in err["message"]
    assert c.post("/v1/tokenize", json={"text": "word word"}).status_code == 200

    c = make_client(gpt2_runtime, memory_budget_bytes=64 << 20, budget_wait_s=0)
    budget = c.app.state.engine.budget
    held = c.portal.call(budget.acquire, budget.total)  # everything held by a request in flight
    try:
        r = c.post("/v1/tokenize", json={"text": text})
        _err(r, 429, "overloaded")
        assert r.headers["retry-after"]
    finally:
        c.portal.call(held.release)
    r = c.post("/v1/tokenize", json={"text": "word word"})
    assert r.status_code == 200 and budget.in_use == 0


def test_the_counted_work_of_a_forward_is_its_estimate(gpt2_runtime):
    """The torch mode counts the FLOP of every matrix product a job runs (from the shapes
    of each call); for a recorded forward that count equals the closed formula the estimates
    use (forward_flops: projections, MLP, scores and weighted values), exactly."""
    from attnscope.service.serving.core import cancel
    from attnscope.service.serving.core.engine import model_dims
    from attnscope.service.serving.core.estimates import forward_flops

    it = gpt2_runtime.tokenize(f"counted flops {time_tag()}: the cat sat on the mat " * 3, True)
    t = cancel.CancelToken(None, 1e18)
    with cancel.running(t):
        gpt2_runtime.forward_many([it])
    assert t.flops == forward_flops(len(it), **model_dims(gpt2_runtime)) > 0


def time_tag() -> str:
    import uuid

    return uuid.uuid4().hex  # a text no other test sends: its forward is not cached


def test_a_job_without_an_estimate_stops_at_the_limit_as_it_runs(gpt2_runtime):
    """A job that multiplies matrices forever, with no device estimate: it is stopped once
    its counted work passes 1.5 x max_request_flops, answered 422 device_limit_exceeded
    naming the limit, and the service keeps serving."""
    from fastapi.testclient import TestClient

    app, started, ended = _spin_app(gpt2_runtime, request_timeout_s=0, max_request_flops=1e8)
    with TestClient(app, raise_server_exceptions=False) as c:
        err = _err(c.post("/v1/spin", json={"matmul": True}), 422, "device_limit_exceeded")
        assert "max_request_flops" in err["message"] and "passed" in err["message"]
        assert ended == ["JobCancelled"] and app.state.slot.depth == 0
        _still_serving(c)


def test_patch_is_bounded_by_the_device_limit(make_client, gpt2_runtime):
    """/v1/patch per_position + residual (the breaker's 46 s request, here on the bundled
    model) under a small max_request_flops: a named 422, before or while it runs."""
    toks = [0] + SEG + SEG
    body = {"clean_tokens": toks, "corrupted_tokens": [0] + SEG[::-1] + SEG, "metric": "loss",
            "per_position": True, "residual": True}
    c = make_client(gpt2_runtime, max_request_flops=1e6)
    err = _err(c.post("/v1/patch", json=body), 422, "device_limit_exceeded")
    assert "max_request_flops" in err["message"]
    assert c.app.state.slot.depth == 0
    assert make_client(gpt2_runtime).post("/v1/patch", json=body).status_code == 200


def test_attention_flow_is_refused_by_its_device_estimate_before_it_runs(make_client,
                                                                        gpt2_runtime):
    """/v1/rollout with flow declares its cost (estimates.flow_flops, one term per text and
    flow layer ``top + 1`` deep): the estimate with flow is the one without plus the hand sum
    of those terms, and under a max_request_flops that the forwards and rollout fit, flow on
    16 tokens is a 422 device_limit_exceeded naming ``flow`` before any forward, while
    rollout alone is served. Planted fault: without the declared cost flow is served."""
    from attnscope.service.serving.core.estimates import flow_flops

    probe = make_client(gpt2_runtime, max_request_flops=1)
    texts = [" ".join(["w"] * 15), " ".join(["w"] * 14)]
    lengths = [len(probe.post("/v1/tokenize", json={"text": t}).json()["tokens"]["tokens"])
               for t in texts]
    assert max(lengths) <= 16, lengths

    def estimate(body):
        err = _err(probe.post("/v1/rollout", json=body), 422, "device_limit_exceeded")
        return float(re.search(r"\(([0-9.e+]+) floating-point operations\)",
                               err["message"]).group(1))

    plain = {"texts": texts}
    body = {**plain, "flow": True, "flow_layers": [0, 1]}
    flow = sum(flow_flops(T, d) for T in lengths for d in (1, 2))
    assert estimate(body) - estimate(plain) == pytest.approx(flow, rel=1e-3)
    limit = 2 * estimate(plain)
    assert flow > limit  # the test's premise: flow alone is over the limit
    c = make_client(gpt2_runtime, max_request_flops=limit)
    before = gpt2_runtime.forward_count
    err = _err(c.post("/v1/rollout", json=body), 422, "device_limit_exceeded", "flow")
    assert "max_request_flops" in err["message"] and "estimated" in err["message"]
    assert gpt2_runtime.forward_count == before
    assert c.app.state.slot.depth == 0 and c.app.state.engine.budget.in_use == 0
    assert c.post("/v1/rollout", json=plain).status_code == 200
