"""The served OpenAPI states the constraints the server enforces (issue 29 item 9): a body the
server refuses for a repeated index, an index past the model's size, or an empty token string
is refused by the document too (JSON Schema 2020-12, the served document with the resident
model's bounds). Each row also plants the fault: the keyword that states the constraint is
removed from the document, and the body then validates (the row can fail).

Constraints no JSON Schema can state are the server's alone (a position past the text's own
token count, a target that is not one token, equal token counts across a batch)."""

from __future__ import annotations

import copy

import pytest

T = "The cat sat on the mat. The cat sat on the mat."
PAIR = {"clean_text": T, "corrupted_text": T}
METRIC = {"kind": "logit_diff", "terms": [{"position": -1, "target": " the", "distractor": " a"}]}
PP = {"pairs": [PAIR], "senders": [{"kind": "head", "layer": 0, "head": 0}],
      "receivers": [{"kind": "logits"}], "metric": METRIC}

# (path, body, the refused field's param, the keyword that states it in the document)
ROWS = [
    ("/v1/ablate", {"text": T, "heads": [[0, 0], [0, 0]]}, "heads.1", "uniqueItems"),
    ("/v1/ablate", {"text": T, "components": [{"kind": "neuron", "layer": 0,
                                               "neurons": [1, 1]}]},
     "components.0.neurons.1", "uniqueItems"),
    ("/v1/ablate", {"text": T, "components": [{"kind": "neuron", "layer": 0,
                                               "neurons": [512]}]},
     "components.0.neurons.0", "maximum"),
    ("/v1/heads", {"text": T, "heads": [[0, 1], [0, 1]]}, "heads.1", "uniqueItems"),
    ("/v1/heads", {"text": T, "heads": [[0, 4]]}, "heads.0", "maximum"),
    ("/v1/heads", {"text": T, "exclude_heads": [[1, 0], [1, 0]]}, "exclude_heads.1",
     "uniqueItems"),
    ("/v1/run", {"texts": [T], "cache": [{"hook": "blocks.0.attn.hook_z", "heads": [1, 1]}]},
     "cache.0.heads.1", "uniqueItems"),
    ("/v1/run", {"texts": [T], "cache": [{"hook": "blocks.*.attn.hook_z", "layers": [0, 0]}]},
     "cache.0.layers.1", "uniqueItems"),
    ("/v1/run", {"texts": [T], "cache": [{"hook": "blocks.0.attn.hook_z",
                                          "positions": [2, 2]}]},
     "cache.0.positions.1", "uniqueItems"),
    ("/v1/run", {"texts": [T], "cache": [{"hook": "blocks.0.attn.hook_z", "prompts": [0, 0]}]},
     "cache.0.prompts.1", "uniqueItems"),
    ("/v1/logit-lens", {"text": T, "positions": [1, 1]}, "positions.1", "uniqueItems"),
    ("/v1/logit-attribution", {"text": T, "target": " the", "positions": [2, 2]},
     "positions.1", "uniqueItems"),
    ("/v1/trajectories", {"text": T, "positions": [1, 1]}, "positions.1", "uniqueItems"),
    ("/v1/trajectories", {"text": T, "positions": [-1]}, "positions.0", "minimum"),
    ("/v1/links", {"text": T, "layer": 0, "ignore": [0, 0]}, "ignore.1", "uniqueItems"),
    ("/v1/links", {"text": T, "layer": 0, "direction": "any"}, "direction", "enum"),
    ("/v1/path-patch", {**PP, "sender_positions": [1, 1]}, "sender_positions", "uniqueItems"),
    ("/v1/path-patch", {**PP, "receiver_positions": [2, 2]}, "receiver_positions",
     "uniqueItems"),
    ("/v1/path-patch", {**PP, "receivers": [{"kind": "head", "layer": 1, "heads": [1, 1],
                                             "input": "q"}]}, "receivers.0", "uniqueItems"),
    ("/v1/path-patch", {**PP, "metric": {"kind": "logit_diff", "terms": [
        {"position": -1, "target": "", "distractor": " a"}]}}, "metric", "minLength"),
    ("/v1/patch", {"pairs": [{"clean_tokens": [5, 2048], "corrupted_tokens": [5, 6]}],
                   "logit_diff": {"target": " the", "distractor": " a"}},
     "pairs.0.clean_tokens.1", "maximum"),
    ("/v1/ablate", {"text": T, "components": [{"kind": "mlp", "layer": 0},
                                              {"kind": "mlp", "layer": 0}]},
     "components.1", "uniqueItems"),
    ("/v1/path-patch", {**PP, "senders": [{"kind": "mlp", "layer": 0},
                                          {"kind": "mlp", "layer": 0}]},
     "senders.1", "uniqueItems"),
    ("/v1/path-patch", {**PP, "receivers": [{"kind": "mlp", "layer": 1}, {"kind": "logits"}]},
     "receivers.1", "maxItems"),
    ("/v1/path-patch", {**PP, "metric": {"kind": "logit_diff", "terms": [
        {"prompt": 1, "position": -1, "target": " the", "distractor": " a"}]}},
     "metric.terms.0.prompt", "enum"),
    ("/v1/path-patch", {**PP, "metric": {"kind": "kl", "terms": [
        {"prompt": 2, "reference_prompt": 1, "position": -1}]}},
     "metric.terms.0.prompt", "enum"),
    ("/v1/path-patch", {**PP, "pairs": [{**PAIR, "metric": {"kind": "logit_diff", "terms": [
        {"prompt": 1, "position": -1, "target": " the", "distractor": " a"}]}}]},
     "pairs.0.metric.terms.0.prompt", "enum"),
    ("/v1/path-patch", {**PP, "pairs": [{**PAIR, "metric": {"kind": "loss", "terms": [
        {"position": 2}]}}]}, "pairs.0.metric", "anyOf"),
    ("/v1/path-patch", {**PP, "pairs": [{**PAIR, "metric": {**METRIC, "reduce": "sum"}}]},
     "pairs.0.metric", "const"),
    ("/v1/patch", {"pairs": [{**PAIR, "metric": {**METRIC, "reduce": "mean"}}],
                   "metric": {**METRIC, "reduce": "sum"}}, "pairs.0.metric", "const"),
]


@pytest.fixture(scope="module")
def spec(client):
    return client.get("/openapi.json").json()


def _validator(spec: dict, path: str):
    import jsonschema

    body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator({**body, "components": spec["components"]})


def _without(x, keyword: str):
    """``x`` with every ``keyword`` removed (the planted fault)."""
    if isinstance(x, dict):
        return {k: _without(v, keyword) for k, v in x.items() if k != keyword}
    if isinstance(x, list):
        return [_without(v, keyword) for v in x]
    return x


@pytest.mark.parametrize("path,body,param,keyword", ROWS,
                         ids=[f"{r[0]}:{r[2]}:{r[3]}" for r in ROWS])
def test_the_document_refuses_what_the_server_refuses(client, spec, path, body, param,
                                                       keyword):
    r = client.post(path, json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"].startswith(param), r.text
    errors = list(_validator(spec, path).iter_errors(body))
    assert errors, f"the document accepts a body the server refuses ({param})"
    # the planted fault: without the keyword, the document accepts the body
    assert not list(_validator(_without(copy.deepcopy(spec), keyword), path).iter_errors(body))


@pytest.mark.parametrize("path,body", [
    ("/v1/ablate", {"text": T, "heads": [[0, 0], [0, 1]]}),
    ("/v1/ablate", {"text": T, "components": [{"kind": "neuron", "layer": 0,
                                               "neurons": [1, 511]}]}),
    ("/v1/heads", {"text": T, "heads": [[0, 1], [1, 3]], "exclude_heads": [[1, 3]]}),
    ("/v1/run", {"texts": [T], "cache": [{"hook": "blocks.0.attn.hook_z", "heads": [0, 1],
                                          "positions": [1, 2], "prompts": [0]}]}),
    ("/v1/trajectories", {"text": T, "positions": [0, 1]}),
    ("/v1/links", {"text": T, "layer": 0, "ignore": [0, 1]}),
    ("/v1/path-patch", {**PP, "sender_positions": [1, 2], "receiver_positions": [-1]}),
    ("/v1/path-patch", {**PP, "pairs": [{**PAIR, "metric": {**METRIC, "terms": [
        {"position": -1, "target": " a", "distractor": " the"}]}}]}),
    ("/v1/patch", {"pairs": [{**PAIR, "metric": {**METRIC, "reduce": "sum"}}],
                   "metric": {**METRIC, "reduce": "sum"}}),
    ("/v1/path-patch", {**PP, "metric": {"kind": "kl", "terms": [
        {"prompt": 0, "reference_prompt": 1, "position": -1}]}}),
    ("/v1/path-patch", {**PP, "receivers": [{"kind": "mlp", "layer": 1},
                                            {"kind": "head", "layer": 1, "input": "v"}]}),
    ("/v1/patch", {"pairs": [{"clean_tokens": [5, 2047], "corrupted_tokens": [5, 6]}],
                   "logit_diff": {"target": " the", "distractor": " a"}}),
])
def test_distinct_and_in_range_bodies_pass_both(client, spec, path, body):
    """The rows' bodies with the repeat or bound fixed: the document and the server accept
    them (the schema does not simply refuse the endpoint)."""
    assert not [e.message for e in _validator(spec, path).iter_errors(body)]
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text


def test_encoder_only_values_leave_a_causal_models_document():
    """``direction: "any"`` (keys after the query) stays in an encoder's document only."""
    from attnscope.service.ops.openapi import model_bounds

    node = {"type": "string", "enum": ["earlier", "any"], "x-attnscope-encoder-only": ["any"]}
    spec = {"components": {"schemas": {"X": {"properties": {"direction": node}}}}}

    def enum(causal):
        out = model_bounds(spec, 2, 4, 100, 16, causal=causal)
        return out["components"]["schemas"]["X"]["properties"]["direction"]["enum"]

    assert enum(True) == ["earlier"] and enum(False) == ["earlier", "any"]


def test_every_operation_can_be_generated_from_the_served_document(spec):
    """Rules stay within what generators support: schemathesis builds a body for every
    operation (an ``if``/``then`` pairs rule on /v1/patch once made it give up with
    UnsupportedSchema, and tests/test_fuzz.py then tests nothing there)."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    unsupported = []
    for result in schemathesis.openapi.from_dict(spec).get_all_operations():
        op = result.ok()

        @settings(max_examples=2, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def build(case):
            assert case.method

        try:
            build()
        except Exception as exc:  # noqa: BLE001 - collected, reported below
            unsupported.append(f"{op.label}: {type(exc).__name__}")
    assert unsupported == []
