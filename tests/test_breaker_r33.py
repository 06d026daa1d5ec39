"""Breaker findings of stop 33 (bad inputs against the real app on the bundled model)."""

from __future__ import annotations

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
