"""The HTTP API in-process (real app, real bundled model)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from attnscope.schemas import AttentionResponse, ModelInfo, TokenizeResponse

from conftest import SENTENCE


def decode(t):
    if isinstance(t, dict):
        dt = {"float32": "<f4", "float16": "<f2"}[t["dtype"]]
        return np.frombuffer(base64.b64decode(t["data"]), dtype=dt).reshape(t["shape"])
    return np.array(t, dtype=np.float64)


def test_health_ready_model(client, gpt2_runtime):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200
    info = ModelInfo.model_validate(client.get("/v1/model").json())
    assert info.id == "attnscope-tiny-gpt2" and info.causal and info.family == "gpt2"
    assert (info.n_layers, info.n_heads, info.d_model) == (
        gpt2_runtime.adapter.n_layers, gpt2_runtime.adapter.n_heads, gpt2_runtime.adapter.d_model)
    assert info.d_head * info.n_heads == info.d_model
    assert info.device == "cpu" and info.dtype == "float32" and info.revision.startswith("sha256:")


def test_attention_matches_runtime_and_hf(client, gpt2_runtime):
    r = client.post("/v1/attention", json={"text": SENTENCE})
    assert r.status_code == 200
    body = AttentionResponse.model_validate(r.json())
    assert body.model.id == "attnscope-tiny-gpt2" and body.results is None
    # the reference on the tokens the response reports: BOS first (add_bos null, GPT-2)
    assert body.add_bos is True
    fw = gpt2_runtime.forward_many([gpt2_runtime.tokenize(SENTENCE, add_bos=True)])[0]
    assert [t.id for t in body.attention.tokens] == list(fw.tokens.input_ids)
    got = decode(body.attention.pattern)
    assert got.shape == tuple(fw.pattern.shape)
    assert np.abs(got - fw.pattern.double().numpy()).max() <= 1e-6
    assert [t.label for t in body.attention.tokens][:3] == ["<|endoftext|>", "Then", " I"]
    assert body.attention.scores is None


def test_selection_head_mean_rounding_base64(client, gpt2_runtime):
    # the reference on the tokens the response reports: BOS first (add_bos null, GPT-2)
    fw = gpt2_runtime.forward_many([gpt2_runtime.tokenize(SENTENCE, add_bos=True)])[0]
    full = fw.pattern.double().numpy()
    r = client.post("/v1/attention", json={"text": SENTENCE, "layers": [1, 0], "heads": [2], "round": 3})
    assert r.json()["add_bos"] is True
    assert [t["id"] for t in r.json()["attention"]["tokens"]] == list(fw.tokens.input_ids)
    got = decode(r.json()["attention"]["pattern"])
    assert got.shape == (2, 1, fw.n_tokens, fw.n_tokens)
    assert np.abs(got - np.round(full[[1, 0]][:, [2]], 3)).max() <= 1e-9
    r = client.post("/v1/attention", json={"text": SENTENCE, "head_mean": True, "encoding": "base64"})
    a = r.json()["attention"]
    got = decode(a["pattern"])
    assert a["pattern"]["dtype"] == "float32" and got.dtype == np.float32
    assert np.abs(got - full.mean(axis=1)).max() <= 1e-6
    r = client.post("/v1/attention", json={"text": SENTENCE, "encoding": "base64", "dtype": "float16"})
    got = decode(r.json()["attention"]["pattern"])
    assert got.dtype == np.float16 and np.abs(got - full).max() <= 1e-3


def test_scores_masked_explicitly(client, gpt2_runtime):
    r = client.post("/v1/attention", json={"text": SENTENCE, "include_scores": True, "layers": [0]})
    s = r.json()["attention"]["scores"]
    T = len(r.json()["attention"]["tokens"])
    assert s[0][0][0][1] is None  # future key of a causal model: null, documented
    arr = np.array([[[[np.nan if x is None else x for x in row] for row in h] for h in lyr] for lyr in s])
    assert np.isnan(arr[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]]).all()
    # the reference on the tokens the response reports (BOS first by default)
    fw = gpt2_runtime.forward_many([gpt2_runtime.tokenize(SENTENCE, add_bos=True)])[0]
    assert [t["id"] for t in r.json()["attention"]["tokens"]] == list(fw.tokens.input_ids)
    lower = np.tril_indices(T)
    ref = fw.scores([0]).double().numpy()
    assert np.abs(arr[..., lower[0], lower[1]] - ref[..., lower[0], lower[1]]).max() <= 1e-5
    r = client.post("/v1/attention", json={"text": SENTENCE, "include_scores": True, "encoding": "base64"})
    sb = decode(r.json()["attention"]["scores"])
    assert np.isneginf(sb[..., 0, 1]).all()
    p = torch.from_numpy(sb.astype(np.float32)).softmax(-1).numpy()
    assert np.abs(p - decode(r.json()["attention"]["pattern"])).max() <= 1e-6


def test_batch_results_in_order(client):
    texts = ["First text here.", SENTENCE, "Third"]
    r = client.post("/v1/attention", json={"texts": texts, "layers": [0]})
    body = AttentionResponse.model_validate(r.json())
    assert body.attention is None and len(body.results) == 3
    for t, res in zip(texts, body.results):
        single = client.post("/v1/attention", json={"text": t, "layers": [0]}).json()["attention"]
        assert res.tokens == [type(res.tokens[0]).model_validate(x) for x in single["tokens"]]
        assert np.abs(decode(res.pattern) - decode(single["pattern"])).max() <= 1e-5


def test_tokenize(client, gpt2_runtime):
    r = client.post("/v1/tokenize", json={"text": "a <|endoftext|> b", "add_bos": True})
    body = TokenizeResponse.model_validate(r.json())
    toks = body.tokens.tokens
    assert toks[0].special and toks[0].label == "<|endoftext|>"
    assert not any(t.special for t in toks[1:])
    assert "".join(t.label for t in toks[1:]) == "a <|endoftext|> b"
    r = client.post("/v1/tokenize", json={"texts": ["x", "y z"]})
    # add_bos null: the model's convention (BOS first for GPT-2), as the analyses see them
    assert r.json()["add_bos"] is True
    assert [x["n_tokens"] for x in r.json()["results"]] == [
        len(gpt2_runtime.tokenize("x", add_bos=True)), len(gpt2_runtime.tokenize("y z", add_bos=True))]
    assert [len(x["tokens"]) for x in r.json()["results"]] == [x["n_tokens"] for x in r.json()["results"]]


@pytest.mark.parametrize(
    "body,status,etype,param,needle",
    [
        ({"text": ""}, 422, "validation_error", "text", "non-whitespace"),
        ({"text": " \n\t "}, 422, "validation_error", "text", "non-whitespace"),
        ({"texts": ["ok", "  "]}, 422, "validation_error", "texts.1", "non-whitespace"),
        ({"texts": []}, 422, "validation_error", "texts", "at least 1"),
        ({"text": "word " * 400}, 422, "context_length_exceeded", "text", "256 tokens"),
        ({"texts": ["ok", "word " * 400]}, 422, "context_length_exceeded", "texts.1", "256 tokens"),
        ({"text": "x", "layers": [2]}, 422, "out_of_range", "layers.0", "2 layers"),
        ({"text": "x", "layers": [-1]}, 422, "out_of_range", "layers.0", "0..1"),
        ({"text": "x", "heads": [0, 9]}, 422, "out_of_range", "heads.1", "4 heads"),
        ({"texts": ["a"] * 33}, 422, "batch_too_large", "texts", "32"),
        ({"text": "x", "texts": ["y"]}, 422, "validation_error", None, "exactly one"),
        ({}, 422, "validation_error", None, "exactly one"),
        ({"text": "x", "encoding": "xml"}, 422, "validation_error", "encoding", "json"),
        ({"text": "x", "round": 99}, 422, "validation_error", "round", "10"),
        ({"text": "x", "nope": 1}, 422, "validation_error", "nope", "Extra"),
        ({"text": 5}, 422, "validation_error", "text", "string"),
    ],
)
def test_bad_inputs_get_envelope_then_service_keeps_serving(client, body, status, etype, param, needle):
    r = client.post("/v1/attention", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == etype and err["param"] == param and needle in err["message"], err
    assert client.post("/v1/attention", json={"text": "still fine", "layers": [0]}).status_code == 200


def test_bad_json_and_big_body(client):
    r = client.post("/v1/attention", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "body"
    r = client.post("/v1/attention", content=b"x" * 4_000_001, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "payload_too_large"
    assert "4000000" in r.json()["error"]["message"]
    assert client.get("/nowhere").json()["error"]["type"] == "not_found"
    assert client.get("/v1/attention").json()["error"]["type"] == "method_not_allowed"


def test_not_ready_is_503(make_client):
    c = make_client(None, model="/nonexistent/dir", exit_on_load_failure=False)
    import time

    for _ in range(2400):  # wait for the event (the load failed); 120 s: a safety net
        if c.app.state.load_error:
            break
        time.sleep(0.05)
    assert c.app.state.load_error
    r = c.get("/readyz")
    assert r.status_code == 503 and r.json()["error"]["type"] == "not_ready"
    r = c.post("/v1/attention", json={"text": "x"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "not_ready"
    assert c.get("/healthz").status_code == 200


def test_encoder_attention(bert_client, bert_runtime):
    r = bert_client.post("/v1/attention", json={"text": SENTENCE, "include_scores": True, "layers": [5]})
    a = r.json()["attention"]
    assert a["tokens"][0]["label"] == "[CLS]" and a["tokens"][-1]["label"] == "[SEP]"
    assert all(x is not None for x in np.array(a["scores"], dtype=object).ravel())
    r = bert_client.post("/v1/attention", json={"text": "x", "add_bos": True})
    assert r.status_code == 422 and r.json()["error"]["param"] == "add_bos"


def test_openapi_documents_every_field(client):
    spec = client.get("/openapi.json").json()
    assert "/v1/attention" in spec["paths"]
    missing = []
    for name, schema in spec["components"]["schemas"].items():
        if name in ("HTTPValidationError", "ValidationError"):
            continue
        for field, prop in schema.get("properties", {}).items():
            if "description" not in prop and "$ref" not in prop and "allOf" not in prop:
                missing.append(f"{name}.{field}")
    assert not missing, missing


def test_every_request_example_in_the_document_is_answered(client):
    """The body /docs' "Try it out" starts from (each request schema's first example) is a
    request the service answers with 200; an operation without one is named."""
    spec = client.get("/openapi.json").json()
    sent = 0
    for path, ops in spec["paths"].items():
        op = ops.get("post")
        if not op or "requestBody" not in op:
            continue
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        examples = spec["components"]["schemas"][ref.split("/")[-1]].get("examples")
        assert examples, f"{path}: no example body"
        r = client.post(path, json=examples[0])
        assert r.status_code == 200, (path, r.text[:300])
        sent += 1
    assert sent >= 12


def test_docs_work_offline_and_missing_content_type_is_explained(client):
    html = client.get("/docs").text
    assert "/static/swagger-ui/swagger-ui-bundle.js" in html and "cdn" not in html.lower()
    assert client.get("/static/swagger-ui/swagger-ui-bundle.js").status_code == 200
    r = client.post("/v1/attention", content=b'{"text": "hi"}', headers={"content-type": "text/plain"})
    assert r.status_code == 422 and "Content-Type: application/json" in r.json()["error"]["message"]


def test_empty_and_absurdly_nested_bodies(client):
    r = client.post("/v1/attention", content=b"", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "body"
    assert "missing" in r.json()["error"]["message"]
    deep = b'{"text":' + b"[" * 100000 + b"]" * 100000 + b"}"
    r = client.post("/v1/attention", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "body"
    assert client.post("/v1/attention", json={"text": "fine", "layers": [0]}).status_code == 200
