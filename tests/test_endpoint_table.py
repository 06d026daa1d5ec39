"""The endpoint table (service/serving/core/table.py): every route is made from it, the JS
client's methods and the TypeScript client interface are generated from it, and a new
endpoint added through it alone is served, documented in OpenAPI and callable from the JS
client without touching any other file (issue 24)."""

from __future__ import annotations

import threading
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from attnscope.schemas.common import TextOrTexts

from conftest import ROOT
from web_browser import browser, page  # noqa: F401  (fixtures)

from attnscope.service.serving.core.engine import Plan
from attnscope.service.serving.core.table import (
    Endpoint, check_table, default_table, typescript_client, with_js_endpoints,
)


class ToyRequest(TextOrTexts):
    """A toy request: ``text``/``texts`` tokenized by the engine, ``power`` applied to the
    first text's token count."""

    power: Literal[1, 2] = Field(1, description="1: the token count, 2: its square.")


class ToyResponse(BaseModel):
    value: int = Field(..., description="The token count (or its square).")
    n_layers: int = Field(..., description="Layers of the model the job saw.")


def _toy_plan(rt, req, items):
    def job(forwards):
        fw = forwards[0]
        return {"value": fw.n_tokens ** req.power, "n_layers": int(fw.tensors.pattern.shape[0])}
    return Plan(items, job)


def _toy_check(rt, req):
    from attnscope.service.errors import InvalidRequest

    if req.text == "refuse":
        raise InvalidRequest("text 'refuse' is refused by the toy check", "text")


TOY = Endpoint(
    path="/v1/toy", name="toy", request=ToyRequest, response=ToyResponse,
    summary="A toy endpoint made from the table alone",
    description="Counts the tokens of ``text`` from its recorded forward (a test fixture).",
    plan=_toy_plan, check=_toy_check, tags=("toy",), order=999,
)


@pytest.fixture(scope="module")
def toy_app(gpt2_runtime):
    from attnscope.service.app import create_app
    from attnscope.service.config import Settings

    return create_app(Settings(model="bundled"), runtime=gpt2_runtime,
                      endpoints=[*default_table(), TOY])


def test_every_route_comes_from_the_table(client):
    paths = client.get("/openapi.json").json()["paths"]
    table = default_table()
    assert [e.path for e in table] == [p for p in paths if p.startswith("/v1/")]
    for e in table:
        op = paths[e.path][e.method.lower()]
        assert op["summary"] == e.summary and op["description"] == e.description


def test_the_table_refuses_two_endpoints_with_one_path_or_name():
    table = default_table()
    with pytest.raises(ValueError, match="path '/v1/attention'"):
        check_table([*table, TOY.__class__(**{**TOY.__dict__, "path": "/v1/attention"})])
    with pytest.raises(ValueError, match="name 'heads'"):
        check_table([*table, TOY.__class__(**{**TOY.__dict__, "name": "heads"})])


def test_the_committed_clients_are_generated_from_the_table():
    """After adding an endpoint: run scripts/gen-clients and commit what it writes."""
    table = default_table()
    js = (ROOT / "service/web/attnscope.js").read_text()
    assert with_js_endpoints(js, table) == js, "run scripts/gen-clients"
    assert (ROOT / "clients/typescript/client.d.ts").read_text() == typescript_client(table), \
        "run scripts/gen-clients"
    # planted: a table with one more endpoint renders something else
    assert with_js_endpoints(js, [*table, TOY]) != js
    assert '"/v1/toy"' in with_js_endpoints(js, [*table, TOY])
    assert 'toy(body: S["ToyRequest"]): Promise<S["ToyResponse"]>;' in typescript_client([TOY])


def test_a_toy_endpoint_is_served_and_documented(toy_app, gpt2_runtime):
    from fastapi.testclient import TestClient

    with TestClient(toy_app, raise_server_exceptions=False) as c:
        r = c.post("/v1/toy", json={"text": "The cat sat on the mat.", "power": 2})
        assert r.status_code == 200, r.text
        n = len(c.post("/v1/tokenize", json={"text": "The cat sat on the mat."}).json()["tokens"]["tokens"])
        assert {k: r.json()[k] for k in ("value", "n_layers")} == {"value": n * n, "n_layers": 2}
        # the route class, the schema's validation, the check and the error envelope
        bad = c.post("/v1/toy", json={"text": "x", "power": 3})
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "power"
        refused = c.post("/v1/toy", json={"text": "refuse"})
        assert refused.status_code == 422 and "toy check" in refused.json()["error"]["message"]
        op = c.get("/openapi.json").json()["paths"]["/v1/toy"]["post"]
        assert op["summary"] == TOY.summary and op["tags"] == ["toy"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/ToyRequest")
        assert {"422", "429", "503"} <= set(op["responses"])
        js = c.get("/static/web/attnscope.js").text
        assert '{"name": "toy", "method": "POST", "path": "/v1/toy", "binary": false}' in js
    # the default app has no such route
    from attnscope.service.app import create_app
    from attnscope.service.config import Settings

    with TestClient(create_app(Settings(model="bundled"), runtime=gpt2_runtime)) as c:
        assert c.post("/v1/toy", json={"text": "x"}).status_code == 404


@pytest.fixture(scope="module")
def toy_server(toy_app):
    import uvicorn

    from conftest import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(toy_app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    import httpx

    for _ in range(600):  # until it answers (a safety net, not a bound)
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        threading.Event().wait(0.1)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    t.join(timeout=60)


def test_the_generated_js_client_calls_the_toy_endpoint(toy_server, page):  # noqa: F811
    page.goto(toy_server + "/healthz")
    out = page.evaluate("""async () => {
        const { Client, ApiError } = await import("/static/web/attnscope.js");
        const c = new Client();
        const ok = await c.toy({ text: "The cat sat on the mat.", power: 1 });
        let err = null;
        try { await c.toy({ text: "refuse" }); } catch (e) { err = [e instanceof ApiError, e.status, e.param]; }
        const model = await c.model();
        return { ok, err, layers: model.n_layers, methods: typeof c.toy + typeof c.attention };
    }""")
    assert out["ok"]["n_layers"] == 2 and out["ok"]["value"] > 1
    assert out["err"] == [True, 422, "text"]
    assert out["layers"] == 2 and out["methods"] == "functionfunction"
    # the refused call's 422 (asked for above) and the favicon's 404 are the page's only errors
    assert sorted(page.errors) == [
        "console.error: Failed to load resource: the server responded with a status of 404 (Not Found)",
        "console.error: Failed to load resource: the server responded with a status of 422 "
        "(Unprocessable Entity)"], page.errors
    page.errors.clear()
