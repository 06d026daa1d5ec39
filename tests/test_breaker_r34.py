"""Breaker findings of stop 34 (bad inputs against the real app on the bundled model, after
the OpenAPI was made to state the server's constraints)."""

from __future__ import annotations

import pytest

from conftest import SENTENCE


def test_an_empty_direction_positions_list_is_a_422(client):
    """positions [] on a direction component ablated nothing and answered 200 (the ablated loss
    equal to the clean one); it is a 422 naming the field, as the top-level positions are."""
    hook = "blocks.0.hook_resid_post"
    d = client.get("/v1/model").json()["d_model"]
    comp = {"kind": "direction", "hook": hook, "vector": [float(i % 7) - 3 for i in range(d)]}
    r = client.post("/v1/ablate", json={"text": SENTENCE, "components": [{**comp,
                                                                          "positions": []}]})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "components.0.positions"
    ok = client.post("/v1/ablate", json={"text": SENTENCE, "components": [comp]})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path,body,param", [
    ("/v1/attention", {"text": "hello", "layers": [1e308]}, "layers.0"),
    ("/v1/tokenize", {"tokens": [1e308]}, "tokens.0"),
])
def test_a_huge_float_index_is_refused_with_a_short_message(client, path, body, param):
    """1e308 (a float with a zero fraction) was turned into a 309-digit int and printed whole;
    past 2**53 a float is no exact integer and is refused as one (short message)."""
    r = client.post(path, json=body)
    assert r.status_code == 422, r.text
    e = r.json()["error"]
    assert e["param"] == param and len(e["message"]) < 200, e


def test_integral_floats_are_taken_as_the_integers(client):
    """1.0 is the integer 1 (JSON Schema's integer); the same response as with 1."""
    a = client.post("/v1/attention", json={"text": "hello world", "layers": [1.0]})
    b = client.post("/v1/attention", json={"text": "hello world", "layers": [1]})
    assert a.status_code == b.status_code == 200
    assert a.json() == b.json()


@pytest.mark.parametrize("path,body", [
    ("/v1/scratch-attention", {"tokens": [1, 2], "add_bos": True}),
    ("/v1/rollout", {"text": SENTENCE, "flow_layers": [1]}),
])
def test_the_schema_refuses_what_the_server_refuses(client, path, body):
    """Two rules the OpenAPI missed: the body is a 422 from the server and invalid against the
    served request schema."""
    import jsonschema

    spec = client.get("/openapi.json").json()
    ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    schema = {**ref, "components": spec["components"]}
    assert client.post(path, json=body).status_code == 422
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(body, schema, cls=jsonschema.Draft202012Validator)
    ok = dict(body)
    ok.pop("add_bos", None) if "add_bos" in ok else ok.update(flow=True)
    jsonschema.validate(ok, schema, cls=jsonschema.Draft202012Validator)


@pytest.mark.parametrize("path,extra", [
    ("/v1/patch", {"metric": "loss"}),
    ("/v1/path-patch", {"senders": [{"kind": "head", "layer": 0, "head": 0}],
                        "receivers": [{"kind": "logits"}],
                        "metric": {"kind": "loss", "terms": [{"position": 5}]}}),
])
def test_add_bos_true_with_token_id_pairs_is_a_422(client, path, extra):
    """Pairs of token ids only with add_bos true answered 200 echoing add_bos true while no BOS
    was added; it is the 422 that top-level token ids get (param add_bos). Pairs with a text
    take it."""
    ids = [0, 211, 1030, 77, 1499, 603, 1877, 342, 958]
    other = [0, 1210, 45, 1600, 388, 1777, 90, 1402, 958]
    pair = {"clean_tokens": ids, "corrupted_tokens": other}
    r = client.post(path, json={"pairs": [pair], "add_bos": True, **extra})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "add_bos"
    assert client.post(path, json={"pairs": [pair], **extra}).status_code == 200
    texts = {"clean_text": "the cat sat on the mat", "corrupted_text": "the dog sat on the mat"}
    r = client.post(path, json={"pairs": [texts], "add_bos": True, **extra})
    assert r.status_code == 200 and r.json()["add_bos"] is True, r.text
