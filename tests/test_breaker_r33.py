"""Breaker findings of stop 33 (bad inputs against the real app on the bundled model)."""

from __future__ import annotations

import time

import pytest


@pytest.mark.parametrize("path,body,param", [
    ("/v1/path-patch", {"pairs": [{"clean_text": "the cat sat on the mat", "corrupted_text":
                                   "the dog sat on the mat"}],
                        "senders": [{"kind": "head", "layer": 2147483648, "head": 0}],
                        "receivers": [{"kind": "logits"}]}, "senders.0.layer"),
    ("/v1/path-patch", {"pairs": [{"clean_text": "the cat sat on the mat", "corrupted_text":
                                   "the dog sat on the mat"}],
                        "senders": [{"kind": "head", "layer": -1, "head": 0}],
                        "receivers": [{"kind": "logits"}]}, "senders.0.layer"),
    ("/v1/path-patch", {"pairs": [{"clean_text": "the cat sat on the mat", "corrupted_text":
                                   "the dog sat on the mat"}],
                        "senders": [{"kind": "head", "layer": 0, "head": "x"}],
                        "receivers": [{"kind": "logits"}]}, "senders.0.head"),
    ("/v1/ablate", {"text": "the cat sat on the mat", "components": [{"kind": "head",
                                                                      "head": 0}]},
     "components.0.layer"),
    ("/v1/ablate", {"text": "the cat sat on the mat", "components": [{"kind": "mlp",
                                                                      "layer": "x"}]},
     "components.0.layer"),
])
def test_a_union_tag_that_is_also_a_field_is_not_the_param(client, path, body, param):
    """{"kind": "head", "head": 0}: pydantic's loc holds the tag 'head' before the field
    (senders.0.head.layer); the envelope names the field the user wrote (senders.0.layer),
    not the head field (which was named before the fix)."""
    r = client.post(path, json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == param, r.json()


@pytest.fixture(scope="module")
def llama_client():
    """The in-process app on ``--model bundled-llama`` (rotary: has attn.hook_cos/sin)."""
    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app
    from attnscope.service.config import Settings

    with TestClient(create_app(Settings(model="bundled-llama")),
                    raise_server_exceptions=False) as c:
        while c.get("/readyz").status_code == 503:
            time.sleep(0.05)  # the model loads after the app starts
        yield c


@pytest.mark.parametrize("hook", ["blocks.0.attn.hook_cos", "blocks.1.attn.hook_sin"])
def test_a_direction_out_of_a_rotary_table_is_a_422(llama_client, hook):
    """A rotary table is not an activation a direction can be projected out of: it was a 500
    (the ablation's site order had no rotary sites); now a 422 naming components.0.hook. A
    direction out of hook_resid_post on the same model still runs (200)."""
    body = {"text": "the cat sat on the mat", "components": [
        {"kind": "direction", "hook": hook, "vector": [1.0] * 32}]}
    r = llama_client.post("/v1/ablate", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "components.0.hook"
    d = llama_client.get("/v1/model").json()["d_model"]
    ok = llama_client.post("/v1/ablate", json={"text": "the cat sat on the mat", "components": [
        {"kind": "direction", "hook": "blocks.0.hook_resid_post", "vector": [1.0] * d}]})
    assert ok.status_code == 200, ok.text
