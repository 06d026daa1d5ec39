"""/v1/attention through the app: patterns bit-exact with Hugging Face at n_ctx, scores from the
recorded q/k/v equal to a manual recomputation.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from test_api import decode
from recorded_reference import hf_reference, words


# --------------------------------------------------------------- buffers: batches, padding
@pytest.mark.regression
def test_text_at_n_ctx_through_the_app_is_bit_exact(client, gpt2_runtime):
    rt = gpt2_runtime
    n_ctx = rt.adapter.n_ctx if hasattr(rt.adapter, "n_ctx") else 256
    text = " the" * (n_ctx + 40)
    ids = rt.tokenizer(text)["input_ids"]
    # cut to exactly n_ctx tokens with the BOS the default (add_bos null, GPT-2) prepends
    text = rt.tokenizer.decode(ids[:n_ctx - 1]) + f""
    tt = rt.tokenize(text, add_bos=True)
    assert len(tt) == n_ctx
    r = client.post("/v1/attention", json={"text": text, "encoding": "base64"})
    assert r.status_code == 200, r.text
    # the reference on the tokens the response reports
    assert r.json()["add_bos"] is True
    assert [t["id"] for t in r.json()["attention"]["tokens"]] == list(tt.input_ids)
    got = decode(r.json()["attention"]["pattern"])
    hf = hf_reference(rt, list(tt.input_ids))
    assert np.array_equal(got, hf["pattern"].numpy())
    r = client.post("/v1/attention", json={"text": text + " the"})
    assert r.status_code == 422


@pytest.mark.regression
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_scores_from_the_qkv_views_equal_a_manual_recomputation(family, make_client, gpt2_runtime,
                                                                 bert_runtime):
    rt = gpt2_runtime if family == "gpt2" else bert_runtime
    c = make_client(rt, forward_batch_size=4, padding_side="left")
    tag = uuid.uuid4().hex[:6]
    texts = [f"{tag} " + words(n, (tag, n)) for n in (2, 25, 9)]
    for _ in range(2):  # computed, then from the cache
        r = c.post("/v1/attention", json={"texts": texts, "include_scores": True,
                                          "encoding": "base64"})
        assert r.status_code == 200, r.text[:300]
        for t, res in zip(texts, r.json()["results"]):
            # the reference on the tokens the response reports (GPT-2: BOS first by default)
            ids = [tok["id"] for tok in res["tokens"]]
            assert ids == list(rt.tokenize(t, add_bos=rt.default_add_bos).input_ids)
            hf = hf_reference(rt, ids)
            scores = decode(res["scores"]).astype(np.float64)
            want = (hf["q"].double() @ hf["k"].double().transpose(-1, -2)).numpy()
            want = want * np.array(rt.scaling)[:, None, None, None]
            if rt.adapter.causal:
                want = np.where(np.tril(np.ones((len(ids), len(ids)), bool)), want, -np.inf)
            assert scores.shape == want.shape
            fin = np.isfinite(want)
            assert np.array_equal(np.isfinite(scores), fin)
            assert np.abs(scores[fin] - want[fin]).max() <= 1e-4
            assert np.abs(decode(res["pattern"]) - hf["pattern"].numpy()).max() <= 2e-6
