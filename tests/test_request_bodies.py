"""Request bodies over ``INLINE_BODY_BYTES`` are parsed and validated in a worker thread
(service/serving/core/routes.py ``V1Route``, issue 17: big bodies parsed on the event loop held
``/healthz`` for seconds), with exactly the answers FastAPI's own path gives: every case below
is sent once through FastAPI's path (the threshold raised past every body) and once through
the worker thread (the body padded with JSON whitespace past the threshold), and the two
answers must be equal, status and body."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.routing import APIRoute

from attnscope.service.serving.core import routes as common

PAD = 70_000  # bytes of leading JSON whitespace: past INLINE_BODY_BYTES (64 KiB)


def _routes(routes):
    """Every APIRoute of an app, through included routers (FastAPI keeps them nested)."""
    for r in routes:
        inner = getattr(r, "original_router", None)
        if inner is not None:
            yield from _routes(inner.routes)
        elif isinstance(r, APIRoute):
            yield r


def test_every_v1_post_route_parses_big_bodies_off_the_loop(client):
    posts = [r for r in _routes(client.app.routes) if "POST" in r.methods]
    assert {r.path for r in posts} >= {
        "/v1/attention", "/v1/heads", "/v1/links", "/v1/trajectories", "/v1/verify",
        "/v1/scratch-attention", "/v1/tokenize", "/v1/predictions", "/v1/ablate", "/v1/patch",
        "/v1/attention-norms", "/v1/rollout"}
    off = [r.path for r in posts if isinstance(r, common.V1Route) and r.offloads_body]
    assert sorted(off) == sorted(r.path for r in posts if r.path.startswith("/v1/"))


def _mats(n: int, d: int) -> dict:
    row = [round(0.01 * (i % 97), 2) for i in range(d)]
    return {"q": [row] * n, "k": [row] * n, "v": [row] * n}


def _record(monkeypatch) -> list[bool]:
    """Patch the off-loop parse to record, per call, whether it ran outside the event loop."""
    seen: list[bool] = []
    real = common._parse_and_validate

    def spy(field, body):
        try:
            asyncio.get_running_loop()
            seen.append(False)
        except RuntimeError:
            seen.append(True)
        return real(field, body)

    monkeypatch.setattr(common, "_parse_and_validate", spy)
    return seen


def test_big_bodies_are_parsed_off_the_loop_small_ones_inline(client, monkeypatch):
    seen = _record(monkeypatch)
    small = client.post("/v1/scratch-attention", json=_mats(4, 4))
    assert small.status_code == 200 and seen == []
    big = _mats(64, 128)
    assert len(json.dumps(big)) > common.INLINE_BODY_BYTES
    r = client.post("/v1/scratch-attention", json=big)
    assert r.status_code == 200, r.text
    assert seen == [True]  # once, in a worker thread
    r = client.post("/v1/scratch-attention", json={**big, "n_heads": 0})
    assert r.status_code == 422 and r.json()["error"]["param"] == "n_heads"
    assert seen == [True, True]


def test_planted_fault_a_route_parsing_on_the_loop_is_seen(client, monkeypatch):
    """The check above fails when big bodies stay on FastAPI's path (threshold raised)."""
    seen = _record(monkeypatch)
    monkeypatch.setattr(common, "INLINE_BODY_BYTES", 1 << 40)
    assert client.post("/v1/scratch-attention", json=_mats(64, 128)).status_code == 200
    assert seen == []


CT = {"content-type": "application/json"}
CASES = {
    # valid
    "tokenize": ("/v1/tokenize", b'{"text": "hello world"}', CT),
    "attention": ("/v1/attention", b'{"text": "a b c", "layers": [1], "round": 4}', CT),
    "scratch": ("/v1/scratch-attention", json.dumps(_mats(8, 8)).encode(), CT),
    "vnd+json": ("/v1/tokenize", b'{"text": "hi"}',
                 {"content-type": "application/vnd.api+json; charset=utf-8"}),
    # not JSON / not decodable
    "trailing comma": ("/v1/attention", b'{"text": "x",}', CT),
    "truncated": ("/v1/attention", b'{"text": "x", "layers": [0', CT),
    "two documents": ("/v1/attention", b'{"text": "x"} {}', CT),
    "not utf-8": ("/v1/attention", b'{"text": "\xff\xfe"}', CT),
    "control char": ("/v1/attention", b'{"text": "a\x01b"}', CT),
    "deep": ("/v1/attention", b'{"text":' + b"[" * 100_000 + b"]" * 100_000 + b"}", CT),
    "deep 900": ("/v1/attention", b'{"text":' + b"[" * 899 + b"]" * 899 + b"}", CT),
    # what only the standard library reads (orjson refuses or reads it otherwise)
    "NaN": ("/v1/scratch-attention", b'{"q": [[NaN]], "k": [[1]], "v": [[1]]}', CT),
    "Infinity": ("/v1/scratch-attention", b'{"q": [[-Infinity]], "k": [[1]], "v": [[1]]}', CT),
    "1e400": ("/v1/scratch-attention", b'{"q": [[1e400]], "k": [[1]], "v": [[1]]}', CT),
    "big int": ("/v1/attention", b'{"text": "x", "layers": [123456789012345678901234567890]}', CT),
    "u64 int": ("/v1/attention", b'{"text": "x", "layers": [18446744073709551615]}', CT),
    "i64 min": ("/v1/attention", b'{"text": "x", "layers": [-9223372036854775809]}', CT),
    "lone surrogate": ("/v1/attention", b'{"text": "\\ud800"}', CT),
    "utf-16": ("/v1/tokenize", '{"text": "hi"}'.encode("utf-16"), CT),
    "duplicate keys": ("/v1/attention", b'{"text": 1, "text": "x", "layers": [0]}', CT),
    # invalid values
    "wrong type": ("/v1/attention", b'{"text": 5}', CT),
    "strict bool": ("/v1/attention", b'{"text": "x", "include_scores": 1}', CT),
    "strict index": ("/v1/attention", b'{"text": "x", "layers": [1.5]}', CT),
    # JSON Schema's integer: a number with a zero fractional part is the integer (valid)
    "integral index": ("/v1/attention", b'{"text": "x", "layers": [1.0]}', CT),
    "extra field": ("/v1/attention", b'{"text": "x", "bogus": 1}', CT),
    "several": ("/v1/attention", b'{"text": 5, "layers": "0", "bogus": 1}', CT),
    "missing": ("/v1/attention", b"{}", CT),
    "list body": ("/v1/attention", b"[1, 2]", CT),
    "null body": ("/v1/attention", b"null", CT),
    "string body": ("/v1/attention", b'"text"', CT),
    "cross-field": ("/v1/scratch-attention", b'{"q": [[1, 2]], "k": [[1]], "v": [[1]]}', CT),
    "not finite": ("/v1/scratch-attention", b'{"q": [[1e308, 1]], "k": [[1, 1]], "v": [[1]], '
                   b'"text": "x"}', CT),
    "model check": ("/v1/attention", b'{"text": "x", "layers": [7]}', CT),
    # content types FastAPI does not read as JSON (left to FastAPI)
    "text/plain": ("/v1/attention", b'{"text": "x"}', {"content-type": "text/plain"}),
    "no content-type": ("/v1/attention", b'{"text": "x"}', {}),
}


def _padded(body: bytes) -> bytes:
    """``body`` with PAD bytes of JSON whitespace where the parser ignores them."""
    for bom in (b"\xff\xfe", b"\xef\xbb\xbf"):  # UTF-16 LE, UTF-8 BOMs stay first
        if body.startswith(bom):
            ws = " ".encode("utf-16-le") if bom == b"\xff\xfe" else b" "
            return bom + ws * (PAD // len(ws)) + body[len(bom):]
    return b" " * PAD + body


def _answer(client, path, body, headers):
    r = client.post(path, content=body, headers=headers)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.content


@pytest.mark.parametrize("name", list(CASES))
def test_big_bodies_get_fastapis_answer(client, monkeypatch, name):
    path, body, headers = CASES[name]
    big = _padded(body)
    assert len(big) > common.INLINE_BODY_BYTES
    with monkeypatch.context() as m:
        m.setattr(common, "INLINE_BODY_BYTES", 1 << 40)  # FastAPI's own path, on the loop
        want = _answer(client, path, big, headers)
    seen = _record(monkeypatch)
    got = _answer(client, path, big, headers)
    assert got == want
    json_ct = headers.get("content-type", "").startswith(("application/json",
                                                          "application/vnd.api+json"))
    assert seen == ([True] if json_ct else [])
    if name in ("tokenize", "attention", "scratch", "vnd+json", "integral index"):
        assert want[0] == 200
    elif name not in ("duplicate keys", "utf-16", "BOM"):
        assert want[0] == 422, want


def test_bodies_nested_past_max_body_depth_are_unparsable(client):
    """Nesting past MAX_BODY_DEPTH: the answer FastAPI gives past the standard library's
    recursion limit on the loop (~950 levels here, depending on the stack)."""
    d = common.MAX_BODY_DEPTH
    deep = b'{"text":' + b"[" * d + b"]" * d + b"}"
    r = client.post("/v1/attention", content=_padded(deep), headers=CT)
    assert r.status_code == 422 and r.json()["error"]["param"] == "body"
    assert "could not be parsed" in r.json()["error"]["message"]
    assert common.nesting_depth(deep) == d + 1
    tricky = rb'["[[[[", {"a": "]]]\\", "b": "\"]"}, [[]]]'
    assert json.loads(tricky)[1] == {"a": "]]]\\", "b": '"]'}
    assert common.nesting_depth(tricky) == 3
    assert common.nesting_depth(b"3") == 0


def test_bom_body_gets_fastapis_answer(client, monkeypatch):
    body = b"\xef\xbb\xbf" + b" " * PAD + b'{"text": "hi"}'
    with monkeypatch.context() as m:
        m.setattr(common, "INLINE_BODY_BYTES", 1 << 40)
        want = _answer(client, "/v1/tokenize", body, CT)
    assert _answer(client, "/v1/tokenize", body, CT) == want


def test_parse_json_body_equals_the_standard_library():
    """The parser itself, on the cases orjson and json.loads treat differently."""
    for raw in (b"[1e400, -1e400, 1e-400, -0, 0.1, 1.7976931348623157e308]",
                b"[123456789012345678901234567890, 18446744073709551615, -9223372036854775808]",
                b'["\\ud800\\udc00", "\\u00e9", "\xc3\xa9"]', b'{"a": 1, "a": 2}',
                b"[NaN, Infinity]", "[1]".encode("utf-32"), b"\xef\xbb\xbf[1]",
                b"[0.30000000000000004, 2.2250738585072014e-308, 4.9e-324, 5e-324]"):
        want = json.loads(raw)
        got = common.parse_json_body(raw)
        assert repr(got) == repr(want) and type(got) is type(want), raw
    for raw in (b"[1,]", b'"\\ud800"x', b"\xff", b"[" * 5000):
        with pytest.raises(Exception) as exc_std:
            json.loads(raw)
        with pytest.raises(Exception) as exc_ours:
            common.parse_json_body(raw)
        assert type(exc_ours.value) is type(exc_std.value)
        assert str(exc_ours.value) == str(exc_std.value)


def test_the_rejected_value_is_shown_as_repr_shows_it():
    """The 422 message's '(got ...)' is ``repr`` cut at 80 characters, rendered only that
    far (a big rejected list costs no event-loop time; a deep one no recursion)."""
    from attnscope.service.app import _repr_head

    values = [[], {}, [1, 2.5, None, True, "a'b", 'a"b'], {"k": [1, {"x": "é\n"}]},
              list(range(30)), [[0.1] * 7] * 5, {"a" * 90: 1}, "x" * 200, 1e300, -0.0,
              [[[[[]]]]], {"q": [[1.0, 2.0]], "n": None}]
    for v in values:
        for limit in (1, 5, 81, 10_000):
            head = _repr_head(v, limit)
            full = repr(v)
            if len(full) <= limit:
                assert head == full
            else:
                assert len(head) >= limit and full.startswith(head), (v, limit)
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    assert _repr_head(deep, 81) == "[" * 81
    big = [0.123456789] * 1_000_000
    assert _repr_head(big, 81) == repr(big[:10])[:-1][:len(_repr_head(big, 81))]


# -- an all-default request may be sent without a body (issue 26: POST /v1/circuits) -------

def test_a_request_with_every_field_defaulted_may_have_no_body(client):
    """``POST /v1/circuits`` with no body, an empty one or only whitespace (any Content-Type)
    is the defaults, the same answer as ``{}``; ``null`` is still refused, and an endpoint
    with a required field still says the body is missing."""
    want = client.post("/v1/circuits", json={})
    assert want.status_code == 200
    for kwargs in ({}, {"content": b""}, {"content": b"  \n"},
                   {"content": b"", "headers": {"content-type": "application/json"}},
                   {"content": b"", "headers": {"content-type": "text/plain"}}):
        r = client.post("/v1/circuits", **kwargs)
        assert r.status_code == 200, (kwargs, r.text)
        assert r.json() == want.json()
    r = client.post("/v1/circuits", content=b"null", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "body"
    r = client.post("/v1/circuits", json={"top_k": 0})
    assert r.status_code == 422 and r.json()["error"]["param"] == "top_k"
    for path in ("/v1/attention", "/v1/links", "/v1/path-patch"):
        r = client.post(path)
        assert r.status_code == 422 and "body is missing" in r.json()["error"]["message"], path


def test_only_all_default_requests_are_body_optional(client):
    """The rule is read from the schemas (a request that validates from ``{}``), and the
    OpenAPI document says so while keeping the body's ``$ref`` (making the route parameter
    optional had turned it into an anyOf with null)."""
    from attnscope.service.app import body_optional_paths

    assert body_optional_paths(client.app.state.endpoints) == {"/v1/circuits"}
    spec = client.get("/openapi.json").json()
    for path, item in spec["paths"].items():
        op = item.get("post")
        if not op or "requestBody" not in op:
            continue
        body = op["requestBody"]
        assert set(body["content"]["application/json"]["schema"]) == {"$ref"}, path
        assert body.get("required") is (path != "/v1/circuits"), path


def test_planted_fault_an_optional_body_on_a_required_request_is_seen(client):
    """A table that marked /v1/links optional would send its body to validation as {}: the
    rule itself refuses to (links needs ``layer``), so the planted entry is not taken."""
    from attnscope.service.app import body_optional_paths

    links = [ep for ep in client.app.state.endpoints if ep.path == "/v1/links"]
    assert body_optional_paths(links) == frozenset()
