"""Regression tests for inputs that once broke the HTTP API (found by attacking a live server).

Each test sends the hostile request in-process and checks the 4xx envelope (field, limit and
value named) and that the next good request still succeeds.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import assert_error as _err

TEXT = "The cat sat on the mat. The cat sat on the mat."


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


def test_embedding_pca_fit_is_cached(client, gpt2_runtime):
    from attnscope.service.analysis.scratch import fit_embedding_pca

    emb = gpt2_runtime.adapter.embed_matrix()
    a = fit_embedding_pca(emb, 3, 7)
    assert fit_embedding_pca(emb, 3, 7) is a
    assert fit_embedding_pca(emb, 3, 8) is not a
    body = {"text": "hello world", "project": 3, "seed": 7}
    r1, r2 = (client.post("/v1/scratch-attention", json=body) for _ in range(2))
    assert r1.status_code == r2.status_code == 200 and r1.json() == r2.json()


# --- links: ranking ran on the event loop (/healthz waited 12 s behind one request) --------

def _naive_links(w, top_k, exclude_self, ignore, direction):
    from attnscope.service.analysis.links import eligible_keys

    ok = eligible_keys(w.shape[0], exclude_self, ignore, direction)
    out = []
    for q in range(w.shape[0]):
        keys = ok[q].nonzero().squeeze(-1)
        if keys.numel() == 0:
            continue
        vals = w[q, keys]
        order = __import__("torch").sort(vals, descending=True, stable=True).indices[:top_k]
        out.append((q, tuple((int(keys[i]), float(vals[i])) for i in order)))
    return out


@pytest.mark.parametrize("top_k,exclude_self,ignore,direction", [
    (1, True, (), "earlier"), (3, False, (0,), "earlier"), (50, True, (1, 4), "any"),
    (2, True, tuple(range(12)), "earlier"),
])
def test_vectorised_links_equal_the_per_row_rule(top_k, exclude_self, ignore, direction):
    import torch

    from attnscope.service.analysis.links import strongest_links

    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 4, (12, 12), generator=g).float() / 4  # many ties
    w = torch.softmax(w, -1)
    got = [(ql.query_pos, tuple((k.key_pos, k.weight) for k in ql.links))
           for ql in strongest_links(w, top_k, exclude_self, ignore, direction)]
    assert got == _naive_links(w, top_k, exclude_self, ignore, direction)


def test_links_do_not_block_the_event_loop(client):
    import threading

    texts = [f"a{j} " + " ".join(["a"] * 200) for j in range(12)]
    client.post("/v1/tokenize", json={"texts": texts})
    done = threading.Event()
    result = {}

    def big():
        result["r"] = client.post("/v1/links", json={"texts": texts, "layer": 1, "top_k": 4096})
        done.set()

    th = threading.Thread(target=big)
    th.start()
    worst = 0.0
    time.sleep(0.2)
    while not done.is_set():
        t = time.perf_counter()
        assert client.get("/healthz").status_code == 200
        worst = max(worst, time.perf_counter() - t)
        time.sleep(0.05)
    th.join()
    assert result["r"].status_code == 200
    first = result["r"].json()["results"][0]
    assert len(first["links"][-1]["links"]) == len(first["tokens"]) - 1
    assert worst < 2.0, worst


# --- scratch-attention: overflow sent silently (JSON null for a visible key, inf in base64) --

def test_scratch_neg_inf_score_on_visible_key_is_an_overflow(client):
    body = {"q": [[1e200]], "k": [[-1e200], [1.0]], "v": [[1.0], [2.0]]}
    e = _err(client.post("/v1/scratch-attention", json=body), param="q")
    assert "overflows" in e["message"] and "1e+200" in e["message"]
    # the causal mask's -inf stays legitimate: null in JSON
    ok = client.post("/v1/scratch-attention", json={"q": [[1.0], [2.0]], "k": [[1.0], [2.0]],
                                                    "v": [[1.0], [2.0]], "variant": "causal"})
    assert ok.status_code == 200 and ok.json()["scores"][0][0][1] is None


@pytest.mark.parametrize("dtype,x,ok", [
    ("float16", 300.0, False),   # score 90000 > 65504
    ("float16", 200.0, True),    # score 40000 fits
    ("float32", 1e20, False),    # score 1e40 > 3.4e38
    ("float32", 1e18, True),
])
def test_scratch_base64_values_must_fit_the_wire_dtype(client, dtype, x, ok):
    import base64

    body = {"q": [[x]], "k": [[x]], "v": [[1.0]], "scale": False, "encoding": "base64",
            "dtype": dtype}
    r = client.post("/v1/scratch-attention", json=body)
    if ok:
        assert r.status_code == 200, r.text
        d = r.json()["scores"]
        vals = np.frombuffer(base64.b64decode(d["data"]), "<f2" if dtype == "float16" else "<f4")
        assert np.isfinite(vals).all()
    else:
        e = _err(r, param="dtype")
        assert dtype in e["message"] and "inf" in e["message"]
        # the same request in JSON is fine (float64)
        body["encoding"] = "json"
        assert client.post("/v1/scratch-attention", json=body).status_code == 200
