"""Regression tests for inputs that once broke the HTTP API (found by attacking a live server).

Each test sends the hostile request in-process and checks the 4xx envelope (field, limit and
value named) and that the next good request still succeeds.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

TEXT = "The cat sat on the mat. The cat sat on the mat."


def _err(r, status=422, type_=None, param=None):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) >= {"type", "message", "param"}
    if type_ is not None:
        assert e["type"] == type_, e
    if param is not None:
        assert e["param"] == param, e
    return e


def _still_serving(client):
    r = client.post("/v1/attention", json={"text": "hello world", "layers": [0]})
    assert r.status_code == 200, r.text


# --- no coercion across JSON types (pydantic strict mode on every request model) ---------

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


def test_ints_still_accepted_for_floats(client):
    r = client.post("/v1/verify", json={"text": "hi there", "tolerance": 1})
    assert r.status_code == 200, r.text
    r = client.post("/v1/scratch-attention", json={"q": [[1, 0]], "k": [[1, 0]], "v": [[1, 0]]})
    assert r.status_code == 200, r.text


# --- repeated indices multiplied the work and the response (a 300 kB body ran for minutes) -

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


@pytest.mark.parametrize("path,body", [
    ("/v1/attention", {"text": TEXT, "layers": [0] * 200_000}),
    ("/v1/verify", {"text": TEXT, "layers": [0] * 200_000}),
    ("/v1/links", {"text": TEXT, "layer": 0, "ignore": [0] * 200_000}),
    ("/v1/trajectories", {"text": TEXT, "positions": [0] * 200_000}),
])
def test_giant_index_lists_fail_fast(client, path, body):
    t = time.perf_counter()
    _err(client.post(path, json=body))
    assert time.perf_counter() - t < 5
    _still_serving(client)


def test_ignore_out_of_range_names_first_offender(client):
    e = _err(client.post("/v1/links", json={"texts": ["a b c d e f", "a"], "layer": 0,
                                            "ignore": [0, 3, 5]}), type_="out_of_range")
    assert e["param"] == "ignore.1" and "texts.1 has 1 tokens" in e["message"]


# --- scratch-attention: a 3 MB request answered with 555 MB of JSON -------------------------

def test_scratch_weights_cap(client):
    from attnscope.schemas.scratch import MAX_WEIGHTS

    m = [[0.1] * 128] * 512
    e = _err(client.post("/v1/scratch-attention", json={"q": m, "k": m, "v": m, "n_heads": 64}),
             param="n_heads")
    assert str(MAX_WEIGHTS) in e["message"] and str(64 * 512 * 512) in e["message"]
    # at the limit: 16 heads x 512 x 512 is allowed
    assert 16 * 512 * 512 <= MAX_WEIGHTS
    _still_serving(client)


def test_scratch_weights_cap_text_source(bert_client):
    # the encoder's 512-token context x 64 heads is over the cap
    r = bert_client.post("/v1/scratch-attention",
                         json={"text": "word " * 400, "n_heads": 64})
    e = _err(r, param="n_heads")
    assert "limit" in e["message"]


# --- trajectories: the PCA's SVD under multi-threaded BLAS took ~1 s per text on a busy box -

def test_trajectories_batch_is_fast(client):
    texts = [" ".join(f"w{i}x{j}" for i in range(40)) for j in range(8)]
    t = time.perf_counter()
    r = client.post("/v1/trajectories", json={"texts": texts, "encoding": "base64"})
    assert r.status_code == 200, r.text
    assert time.perf_counter() - t < 20
    assert len(r.json()["results"]) == 8
