"""Request limits and validation: the memory limit (max_request_bytes, exactly at and over the
estimate), index lists (repeats, giant lists, out of range) and no type coercion across JSON
types. Each bad request is a 4xx envelope naming the field and the limit; the service keeps serving.
"""

from __future__ import annotations

import re

import pytest

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
    ("/v1/attention", {"text": "hi", "layers": [0.0]}, "layers.0"),
    ("/v1/attention", {"text": "hi", "heads": ["0"]}, "heads.0"),
    ("/v1/attention", {"text": "hi", "round": True}, "round"),
    ("/v1/attention", {"text": "hi", "sparse": {"top_k": True}}, "sparse.top_k"),
    ("/v1/links", {"text": "hi there", "layer": True}, "layer"),
    ("/v1/links", {"text": "hi there", "layer": "1"}, "layer"),
    ("/v1/links", {"text": "hi there", "layer": 1.0}, "layer"),
    ("/v1/heads", {"text": "hi there", "thresholds": {"sink": "0.5"}}, "thresholds.sink"),
    ("/v1/heads", {"text": "hi there", "probe": {"enabled": "false"}}, "probe.enabled"),
    ("/v1/trajectories", {"text": "hi there", "n_components": 2.0}, "n_components"),
    ("/v1/verify", {"text": "hi there", "tolerance": True}, "tolerance"),
    ("/v1/scratch-attention", {"q": [[True, False]], "k": [[1, 0]], "v": [[1, 0]]}, "q.0.0"),
])
def test_no_type_coercion(client, path, body, param):
    e = _err(client.post(path, json=body), param=param)
    assert e["type"] == "validation_error"
    _still_serving(client)


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
