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
    from attnscope.service.serving.checks import check_indices

    values = head + [_Untouchable()] * 100_000
    with pytest.raises((InvalidRequest, OutOfRange)):
        check_indices(values, 3, "layers", "layer")
    with pytest.raises(AssertionError, match="looked past"):  # the probe itself works
        check_indices([_Untouchable()], 3, "layers", "layer")


@pytest.mark.regression
def test_ignore_out_of_range_names_first_offender(client):
    e = _err(client.post("/v1/links", json={"texts": ["a b c d e f", "a"], "layer": 0,
                                            "ignore": [0, 3, 5]}), type_="out_of_range")
    assert e["param"] == "ignore.1" and "texts.1 has 1 tokens" in e["message"]


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
