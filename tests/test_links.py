"""POST /v1/links and service.analysis.links against a transcription of the source document's
``strongest_previous_token`` (000_1c89b6c8c2a32040.txt), on random and real patterns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnscope.schemas import LinksResponse
from attnscope.service.analysis.links import strongest_links

from conftest import SENTENCE


def seed_strongest_previous_token(weights, n, exclude_self=True, ignore=None):
    """The document's function, returning (query, key, weight) instead of printing."""
    ignore = ignore or []
    out = []
    for query_idx in range(n):
        row = weights[query_idx].copy()
        for key_idx in range(query_idx + 1, n):
            row[key_idx] = -1
        if exclude_self:
            row[query_idx] = -1
        for key_idx in ignore:
            row[key_idx] = -1
        if row.max() < 0:
            continue
        key_idx = row.argmax()
        out.append((query_idx, int(key_idx), float(row[key_idx])))
    return out


def _causal_random(n, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, n, generator=g).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return s.softmax(-1)


@pytest.mark.parametrize("exclude_self, ignore", [(True, []), (False, []), (True, [0]), (False, [0, 3]),
                                                  (True, list(range(9)))])
def test_top1_equals_the_document_function(exclude_self, ignore):
    for seed in range(5):
        w = _causal_random(9, seed)
        got = [(ql.query_pos, ql.links[0].key_pos, ql.links[0].weight)
               for ql in strongest_links(w, 1, exclude_self, ignore)]
        want = seed_strongest_previous_token(w.double().numpy(), 9, exclude_self, ignore)
        assert [g[:2] for g in got] == [x[:2] for x in want]
        np.testing.assert_allclose([g[2] for g in got], [x[2] for x in want], atol=0)


def test_top_k_ties_and_direction():
    w = torch.tensor([[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [0.25, 0.25, 0.5, 0], [0.4, 0.1, 0.4, 0.1]])
    links = strongest_links(w, top_k=3)
    assert [ql.query_pos for ql in links] == [1, 2, 3]  # query 0: no earlier key -> skipped
    assert [k.key_pos for k in links[2].links] == [0, 2, 1]  # ties: lower key_pos first
    np.testing.assert_allclose([k.weight for k in links[2].links], [0.4, 0.4, 0.1], rtol=1e-6)
    assert [k.key_pos for k in links[1].links] == [0, 1]  # fewer eligible keys than top_k
    enc = torch.tensor([[0.1, 0.9], [0.2, 0.8]])
    assert strongest_links(enc, direction="earlier")[0].query_pos == 1
    anyd = strongest_links(enc, direction="any")
    assert [(ql.query_pos, ql.links[0].key_pos) for ql in anyd] == [(0, 1), (1, 0)]
    assert strongest_links(torch.ones(1, 1)) == []


def test_links_endpoint_bundled(client, gpt2_runtime):
    fw = gpt2_runtime.forward_many([gpt2_runtime.tokenize(SENTENCE)])[0]
    labels = [t.label for t in fw.tokens.tokens]
    n = fw.n_tokens
    for layer, head, ignore in [(0, None, []), (1, None, [0]), (0, 1, []), (1, 3, [0, 2])]:
        # the source document's tokenisation: the text's own tokens (no BOS)
        payload = {"text": SENTENCE, "layer": layer, "ignore": ignore, "add_bos": False}
        if head is not None:
            payload["head"] = head
        r = client.post("/v1/links", json=payload)
        assert r.status_code == 200, r.text
        body = LinksResponse.model_validate(r.json())
        assert body.layer == layer and body.head == head and body.results is None
        assert body.add_bos is False
        w = fw.pattern[layer].double().numpy()
        w = w.mean(0) if head is None else w[head]
        want = seed_strongest_previous_token(w, n, True, ignore)
        got = body.links
        assert [(q.query_pos, q.links[0].key_pos) for q in got.links] == [x[:2] for x in want]
        np.testing.assert_allclose([q.links[0].weight for q in got.links], [x[2] for x in want], atol=1e-6)
        assert [q.query for q in got.links] == [labels[x[0]] for x in want]
        assert [q.links[0].key for q in got.links] == [labels[x[1]] for x in want]
        assert got.skipped == [q for q in range(n) if q not in {x[0] for x in want}]
        assert got.skipped[:1] == [0] and (1 in got.skipped) == (0 in ignore)
        assert [t.label for t in got.tokens] == labels
    # the previous-token head L0H1 mostly links a token to the one before it
    r = client.post("/v1/links", json={"text": SENTENCE, "layer": 0, "head": 1,
                                       "add_bos": False}).json()
    prev = [q for q in r["links"]["links"] if q["links"][0]["key_pos"] == q["query_pos"] - 1]
    assert len(prev) >= 0.8 * len(r["links"]["links"])


def test_links_top_k_texts_round(client):
    r = client.post("/v1/links", json={"texts": [SENTENCE, "In the beginning"], "layer": 1,
                                       "top_k": 3, "round": 3})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert len(res) == 2 and r.json().get("links") is None
    for q in res[0]["links"]:
        ws = [k["weight"] for k in q["links"]]
        assert len(ws) == min(3, q["query_pos"]) and ws == sorted(ws, reverse=True)
        assert all(round(x, 3) == x for x in ws)
        assert all(k["key_pos"] < q["query_pos"] for k in q["links"])


def test_links_encoder_direction(bert_client, bert_runtime):
    r = bert_client.post("/v1/links", json={"text": SENTENCE, "layer": 0, "head": 2, "direction": "any"})
    assert r.status_code == 200, r.text
    fw = bert_runtime.forward_many([bert_runtime.tokenize(SENTENCE)])[0]
    w = fw.pattern[0, 2].double().numpy().copy()
    np.fill_diagonal(w, -1)
    got = r.json()["links"]["links"]
    assert [q["links"][0]["key_pos"] for q in got] == list(w.argmax(-1))
    assert r.json()["links"]["skipped"] == []
    r = bert_client.post("/v1/links", json={"text": SENTENCE, "layer": 0})
    assert r.json()["links"]["skipped"] == [0]  # [CLS] has no earlier key
    assert all(k["key_pos"] < q["query_pos"] for q in r.json()["links"]["links"] for k in q["links"])


def test_links_documented_empty_results(client, gpt2_runtime):
    # the text's own tokens (add_bos false): "a" is one token, self excluded
    r = client.post("/v1/links", json={"text": "a", "layer": 0, "add_bos": False})
    assert r.status_code == 200 and r.json()["links"]["links"] == [] and r.json()["links"]["skipped"] == [0]
    n = len(gpt2_runtime.tokenize(SENTENCE))
    r = client.post("/v1/links", json={"text": SENTENCE, "layer": 0, "ignore": list(range(n)),
                                       "add_bos": False})
    assert r.status_code == 200 and r.json()["links"]["links"] == []
    assert r.json()["links"]["skipped"] == list(range(n))
    r = client.post("/v1/links", json={"text": "a", "layer": 0, "exclude_self": False,
                                       "add_bos": False})
    assert r.json()["links"]["links"][0]["links"] == [{"key_pos": 0, "key": "a", "weight": 1.0}]


@pytest.mark.parametrize("payload, etype, param, words", [
    ({"layer": 2}, "out_of_range", "layer", ["2 layers", "0..1"]),
    ({"layer": 0, "head": 4}, "out_of_range", "head", ["4 heads"]),
    ({"layer": -1}, "validation_error", "layer", []),
    ({"layer": 0, "ignore": [0, 99]}, "out_of_range", "ignore.1", ["99", "tokens"]),
    ({"layer": 0, "ignore": [-1]}, "validation_error", "ignore.0", []),
    ({"layer": 0, "top_k": 0}, "validation_error", "top_k", []),
    ({"layer": 0, "direction": "any"}, "validation_error", "direction", ["encoders only"]),
    ({"layer": 0, "direction": "later"}, "validation_error", "direction", []),
    ({}, "validation_error", "layer", []),
])
def test_links_errors(client, payload, etype, param, words):
    r = client.post("/v1/links", json={"text": SENTENCE, **payload})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["type"] == etype and err["param"] == param, err
    for w in words:
        assert w in err["message"], err["message"]


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


@pytest.mark.regression
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
