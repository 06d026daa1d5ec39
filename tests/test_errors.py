"""One list of error types: ``attnscope.schemas.errors.ERROR_TYPES`` (type -> status).

The service's error classes and every envelope its handlers and middlewares write (found in the
source with ast) use only types of that table, with its status; the client's exception per
type is built from it; the README's error table lists the same types. A planted new type in a
synthetic service tree is reported.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import attnscope.client as ac
from attnscope.client import _errors as client_errors
from attnscope.schemas.errors import ERROR_TYPES
from attnscope.service import errors as service_errors
from conftest import ROOT

FRAMEWORK_FALLBACK = "http_error"  # another framework HTTPException: its own status


def sent_types(service_dir: Path) -> dict[str, list[str]]:
    """Error types the service source writes: ``envelope("t", ...)``, ``send_envelope(send,
    status, "t", ...)``, class attributes ``type = "t"`` of exception classes, and the values of
    status -> type dict literals (``{404: "not_found", ...}``). type -> ["file:line", ...]."""
    found: dict[str, list[str]] = {}

    def add(t, f, node):
        found.setdefault(t, []).append(f"{f.relative_to(service_dir)}:{node.lineno}")

    for f in sorted(service_dir.rglob("*.py")):
        tree = ast.parse(f.read_text(), str(f))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                pos = {"envelope": 0, "send_envelope": 2}.get(name)
                if pos is not None and len(node.args) > pos:
                    arg = node.args[pos]
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        add(arg.value, f, node)
                    elif isinstance(arg, ast.Call) and len(arg.args) == 2 \
                            and isinstance(arg.args[1], ast.Constant):  # types.get(s, "x")
                        add(arg.args[1].value, f, node)
            elif isinstance(node, ast.ClassDef):
                for st in node.body:
                    if isinstance(st, ast.Assign) and len(st.targets) == 1 \
                            and getattr(st.targets[0], "id", None) == "type" \
                            and isinstance(st.value, ast.Constant):
                        add(st.value.value, f, st)
            elif isinstance(node, ast.Dict) and node.keys and all(
                    isinstance(k, ast.Constant) and isinstance(k.value, int)
                    and 400 <= k.value < 600 for k in node.keys) and all(
                    isinstance(v, ast.Constant) and isinstance(v.value, str) for v in node.values):
                for v in node.values:
                    add(v.value, f, node)
    return found


def unknown_types(service_dir: Path) -> dict[str, list[str]]:
    return {t: w for t, w in sent_types(service_dir).items()
            if t not in ERROR_TYPES and t != FRAMEWORK_FALLBACK}


def test_the_service_sends_only_listed_types():
    found = sent_types(ROOT / "service")
    assert {"validation_error", "not_found", "unauthorized", "internal_error"} <= set(found)
    assert unknown_types(ROOT / "service") == {}, \
        "error types missing from schemas/errors.py ERROR_TYPES"


def test_every_service_error_class_has_the_listed_status():
    classes = [c for _, c in inspect.getmembers(service_errors, inspect.isclass)
               if issubclass(c, service_errors.AttnscopeError)]
    assert len(classes) >= 10
    for c in classes:
        assert c.type in ERROR_TYPES, c
        assert c.status == ERROR_TYPES[c.type], (c, c.status, ERROR_TYPES[c.type])


def test_the_client_has_a_class_for_every_listed_type():
    assert set(ac.ERROR_TYPES) == set(ERROR_TYPES)
    assert set(client_errors._TYPE_CLASSES) <= set(ERROR_TYPES)  # no stale types
    for t, status in ERROR_TYPES.items():
        cls = ac.ERROR_TYPES[t]
        family = ac.STATUS_ERRORS.get(status) or (
            ac.InternalServerError if status >= 500 else ac.APIStatusError)
        assert issubclass(cls, family), (t, cls, family)


def test_the_readme_error_table_lists_the_same_types():
    text = (ROOT / "README.md").read_text()
    section = text.split("### Errors", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d{3}) \| `([a-z_]+)` \|", section, re.M)
    assert {t: int(s) for s, t in rows} == ERROR_TYPES


def test_a_planted_new_type_is_reported(tmp_path):
    (tmp_path / "a.py").write_text(
        "class Teapot(Exception):\n    type = 'teapot'\n    status = 418\n"
        "def f(send):\n    return envelope('brand_new', 'm')\n"
        "async def g(send):\n    await send_envelope(send, 599, 'another_one', 'm')\n"
        "TYPES = {404: 'not_found', 410: 'gone'}\n"
        "def h(exc):\n    return envelope(TYPES.get(exc.status, 'fallback_type'), 'm')\n")
    assert set(unknown_types(tmp_path)) == {"teapot", "brand_new", "another_one", "gone",
                                            "fallback_type"}
    (tmp_path / "a.py").write_text("def f():\n    return envelope('validation_error', 'm')\n")
    assert unknown_types(tmp_path) == {}


@pytest.mark.parametrize("etype", sorted(ERROR_TYPES))
def test_an_envelope_of_each_type_raises_its_class(etype):
    import httpx

    status = ERROR_TYPES[etype]
    req = httpx.Request("POST", "http://x/v1/attention")
    r = httpx.Response(status, json={"error": {"type": etype, "message": "m", "param": "p"}},
                       request=req)
    e = client_errors.status_error(r)
    assert type(e) is ac.ERROR_TYPES[etype] and e.type == etype and e.status_code == status


# -- the field named as the user wrote it (issue 25, breaker findings) ---------------------

#: the one spelling of ``param``: the body's keys and list indices joined by dots
PARAM_SPELLING = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.([A-Za-z0-9_]+|\d+))*$")
#: pydantic's union member tags, which must never reach a message or a param
UNION_TAGS = re.compile(r"constrained-str|function-(after|before|wrap|plain)|list\[|"
                        r"Base64Input|CacheItem|\.(zero|set|add|scale|mean)\b|\[key\]")
TOKENS = [[0, 5, 6, 7]]
B64_INT = {"encoding": "base64", "dtype": "int32", "shape": [2], "data": "AQAAAAIAAAA="}
LOSS = {"kind": "loss", "terms": [{"position": 0}]}

#: (path, body, param, words of the message): every endpoint family, validation (pydantic)
#: and model-aware (feature / runtime) errors alike
PARAM_CASES = [
    ("/v1/run", {"token_lists": TOKENS, "cache": [1.5]}, "cache.0",
     ["a valid string, or a valid dictionary", "(got 1.5)"]),
    ("/v1/run", {"token_lists": TOKENS, "cache": [{"hook": 3}]}, "cache.0.hook",
     ["a valid string", "(got 3)"]),
    ("/v1/run", {"token_lists": TOKENS, "cache": ["hook_embed", 2.5]}, "cache.1", ["(got 2.5)"]),
    ("/v1/run", {"token_lists": TOKENS, "cache": [{"hook": "hook_embed", "positions": [9]}]},
     "cache.0.positions", ["position 9 is out of range"]),
    ("/v1/run", {"token_lists": TOKENS, "interventions": [{"kind": "zeroo", "hook": "x"}]},
     "interventions.0.kind", ["'zeroo'", "'zero'"]),
    ("/v1/run", {"token_lists": TOKENS, "interventions": [{"kind": "zero"}]},
     "interventions.0.hook", ["Field required"]),
    ("/v1/run", {"token_lists": TOKENS, "interventions": [
        {"kind": "add", "hook": "hook_embed", "vector": B64_INT}]},
     "interventions.0.vector.dtype", ["'float16' or 'float32'", "(got 'int32')"]),
    ("/v1/run", {"token_lists": TOKENS, "interventions": [
        {"kind": "add", "hook": "hook_embed", "vector": "abc"}]},
     "interventions.0.vector", ["a valid list", "(got 'abc')"]),
    ("/v1/run", {"token_lists": TOKENS, "interventions": [
        {"kind": "zero", "hook": "blocks.0.attn.hook_z", "heads": [9]}]},
     "interventions.0.heads", ["head 9 is out of range"]),
    ("/v1/run", {"token_lists": TOKENS, "metrics": {"m": {"kind": "logit_diff", "terms": [
        {"position": 0, "target": 1.5, "distractor": 2}]}}},
     "metrics.m.terms.0.target", ["a valid integer, or a valid string"]),
    ("/v1/run", {"token_lists": TOKENS, "logits": {"positions": [7]}}, "logits.positions",
     ["logits.positions: position 7 is out of range"]),
    ("/v1/run", {"token_lists": TOKENS, "metrics": {"m": LOSS}, "grad": {
        "metric": "m", "hooks": ["hook_embd"]}}, "grad.hooks.0", ["hook_embed"]),
    ("/v1/run", {"token_lists": [[0, 5], [0, 5]], "metrics": {"m": {
        "kind": "loss", "terms": [{"prompt": 5, "position": 0}]}}}, "metrics.m.terms.0",
     ["out of range"]),
    ("/v1/logit-lens", {"text": "a b c", "positions": [40]}, "positions.0", ["out of range"]),
    ("/v1/logit-attribution", {"text": "a b", "target": 1.5}, "target",
     ["a valid integer, or a valid string, or a valid list"]),
    ("/v1/logit-attribution", {"text": "a b", "target": [" a", " b", " c"], "texts": None},
     "target", ["3 tokens given for 1 prompt"]),
    ("/v1/path-patch", {"pairs": [{"clean_tokens": [0, 1, 3, 4], "corrupted_tokens": [0, 2, 3, 4]}],
                        "senders": [{"kind": "head", "layer": 0}], "receivers": [{"kind": "logits"}],
                        "metric": LOSS}, "senders.0.head", ["Field required"]),
    ("/v1/path-patch", {"pairs": [{"clean_tokens": [0, 1, 3, 4], "corrupted_tokens": [0, 2, 3, 4]}],
                        "senders": [{"kind": "head", "layer": 0, "head": 0}],
                        "receivers": [{"kind": "logits"}], "sender_positions": [9],
                        "metric": LOSS}, "sender_positions.0", ["out of range"]),
    ("/v1/ablate", {"text": "a b c", "heads": [[0, 9]]}, "heads.0.1", ["out of range"]),
    ("/v1/attention", {"text": "a b c", "layers": [0, 7]}, "layers.1", ["out of range"]),
    ("/v1/links", {"text": "a b c", "layer": 0, "ignore": [40]}, "ignore.0", ["out of range"]),
    ("/v1/predictions", {"text": "a b", "positions": [0, 0]}, "positions.1", ["repeats"]),
    ("/v1/tokenize", {"tokens": [0, 5, 6, 99999]}, "tokens.3", ["99999"]),
    ("/v1/circuits", {"top_k": 0}, "top_k", ["greater than or equal to 1"]),
    # model-level rules name their field too (they were param null)
    ("/v1/patch", {"clean_tokens": [0, 5, 6, 7], "corrupted_tokens": [0, 8, 6, 7]}, "logit_diff",
     ["logit_diff: metric 'logit_diff' (the default) needs logit_diff {target, distractor}"]),
    ("/v1/ablate", {"text": "a b c", "scan": True, "scan_metric": "logit_diff"}, "logit_diff",
     ["scan_metric 'logit_diff' needs logit_diff"]),
    ("/v1/run", {"token_lists": TOKENS, "grad": {"metric": "m", "hooks": ["hook_embed"]}},
     "grad.metric", ["grad.metric: 'm' is not declared in 'metrics' (declared: [])"]),
    ("/v1/run", {"token_lists": TOKENS, "metrics": {"m": LOSS}, "grad": {
        "metric": "x", "hooks": ["hook_embed"]}}, "grad.metric", ["'x'", "(declared: ['m'])"]),
]


@pytest.mark.parametrize("path, body, param, words", PARAM_CASES,
                         ids=[f"{c[0]}:{c[2]}" for c in PARAM_CASES])
def test_every_error_names_the_field_as_the_request_spells_it(client, path, body, param, words):
    """One spelling of ``param`` on every endpoint (dots, as pydantic's loc and docs/api.md:
    ``tokens.3``, ``interventions.0.heads``, ``logits.positions``), never a runtime's name
    (``logit_positions``, ``cache['hook_embed']``, ``interventions[0]``) or a union member's
    tag (``cache.0.constrained-str``); the message names the same field and the rule."""
    body = {k: v for k, v in body.items() if v is not None}
    r = client.post(path, json=body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert PARAM_SPELLING.match(err["param"]), err
    assert not UNION_TAGS.search(err["message"]), err
    for w in words:
        assert w in err["message"], (w, err)
    assert client.get("/healthz").status_code == 200  # and the service keeps serving


def test_a_device_limit_reached_while_the_job_runs_names_the_field(gpt2_runtime):
    """A job stopped as it runs for passing 1.5 x max_request_flops (its estimate was under
    the limit) names the same field as the refusal before the job: the plan's
    ``device_param`` (/v1/path-patch: ``pairs``), else ``texts`` / ``text`` by its items (it
    was param null). Real app, an extra table endpoint whose job multiplies matrices until
    stopped."""
    import torch
    from fastapi.testclient import TestClient
    from pydantic import BaseModel

    from attnscope.service.app import create_app
    from attnscope.service.config import Settings
    from attnscope.service.serving.core.engine import Plan
    from attnscope.service.serving.core.table import Endpoint, default_table

    class SpinRequest(BaseModel):
        texts: list[str]
        device_param: str | None = None

    class SpinResponse(BaseModel):
        done: bool

    def plan(rt, req, items):
        def job(_):
            m = torch.ones(64, 64)
            while True:
                m = (m @ m) * 0.0 + 1.0
        its = [rt.tokenize(t, True, f"texts.{i}") for i, t in enumerate(req.texts)]
        return Plan(its, job, response_bytes=1 << 20, device_param=req.device_param)

    spin = Endpoint(path="/v1/spin", name="spin", request=SpinRequest, response=SpinResponse,
                    summary="spin", description="spin", plan=plan, tokenize=False, order=999)
    app = create_app(Settings(model="bundled", request_timeout_s=0, max_request_flops=1e8),
                     runtime=gpt2_runtime, endpoints=[*default_table(), spin])
    with TestClient(app, raise_server_exceptions=False) as c:
        for body, param in [({"texts": ["a b", "c d"]}, "texts"), ({"texts": ["a b"]}, "text"),
                            ({"texts": ["a"], "device_param": "pairs"}, "pairs")]:
            r = c.post("/v1/spin", json=body)
            assert r.status_code == 422, r.text
            err = r.json()["error"]
            assert err["type"] == "device_limit_exceeded" and "passed" in err["message"], err
            assert err["param"] == param, err
        assert c.get("/healthz").status_code == 200


def test_param_spelling_rewrites_bracketed_paths():
    from attnscope.service.app import param_spelling

    assert param_spelling("interventions[0].heads") == "interventions.0.heads"
    assert param_spelling("heads[1][0]") == "heads.1.0"
    assert param_spelling("metrics['m'].terms[2]") == "metrics.m.terms.2"
    assert param_spelling("grad.hooks[-1]") == "grad.hooks.-1"
    for same in ("tokens.3", "Authorization", "body", None, ""):
        assert param_spelling(same) == same


def test_planted_runtime_names_are_caught(client, monkeypatch):
    """Planted fault: /v1/run passing the runtime's errors through as they are: the table's
    cases see the runtime's spelling (``logit_positions``, ``cache['hook_embed']``)."""
    from attnscope.service.serving import run as run_mod

    monkeypatch.setattr(run_mod, "_renumbered", lambda exc, origin, keys=None: exc)
    for path, body, param, _ in PARAM_CASES:
        if param in ("logits.positions", "cache.0.positions"):
            err = client.post(path, json=body).json()["error"]
            assert err["param"] != param and err["param"] in ("logit_positions",
                                                              "cache.hook_embed.positions")


def test_planted_union_tags_are_caught(client, monkeypatch):
    """Planted fault: the loc taken as pydantic gives it (tags kept): the check sees them."""
    from attnscope.service import app as app_mod

    monkeypatch.setattr(app_mod, "_user_loc", lambda loc, body, etype: [
        x for x in loc if x != "body"])
    err = client.post("/v1/run", json={"token_lists": TOKENS, "cache": [1.5]}).json()["error"]
    assert UNION_TAGS.search(err["param"]) and UNION_TAGS.search(err["message"])
