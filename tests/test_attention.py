"""/v1/attention through the app: patterns bit-exact with Hugging Face at n_ctx, scores from the
recorded q/k/v equal to a manual recomputation.
"""

from __future__ import annotations

import random
import uuid

import numpy as np
import pytest
import torch

from attnscope.service.runtime import Runtime

from test_api import decode


# --------------------------------------------------------------- buffers: batches, padding
def hf_reference(rt: Runtime, ids: list[int]):
    """Hugging Face's own forward of one unpadded text, with q/k/v from manual hooks on the
    q/k/v modules (split into heads here) and the last block's output from a hook on it: the
    recorded tensors (hidden_states = the L+1 residual-stream states, the last pre-ln_f;
    final_hidden_state = HF's last hidden_states entry)."""
    caps: list[list] = [[None] * len(h.qkv) for h in rt._handles]
    base = rt.adapter.base()
    last_block = (base.h if rt.adapter.causal else base.encoder.layer)[-1]
    last = []
    hooks = [last_block.register_forward_hook(
        lambda m, a, o: last.append((o[0] if isinstance(o, tuple) else o)[0].clone()))]
    for i, h in enumerate(rt._handles):
        for j, m in enumerate(h.qkv):
            def hook(mod, args, out, i=i, j=j):
                caps[i][j] = out[0].clone()
            hooks.append(m.register_forward_hook(hook))
    kw = dict(input_ids=torch.tensor([ids]), output_attentions=True, output_hidden_states=True)
    if rt.adapter.family == "bert":
        kw["token_type_ids"] = torch.zeros_like(kw["input_ids"])
    try:
        with torch.inference_mode():
            out = rt.adapter.base()(**kw)
    finally:
        for h in hooks:
            h.remove()
    H, dh = rt.adapter.n_heads, rt.adapter.d_head
    qs, ks, vs = [], [], []
    for layer in caps:
        parts = layer[0].split(rt.adapter.d_model, dim=-1) if len(layer) == 1 else layer
        q, k, v = (p.reshape(len(ids), H, dh).transpose(0, 1) for p in parts)
        qs.append(q), ks.append(k), vs.append(v)
    return dict(pattern=torch.stack([a[0] for a in out.attentions]),
                hidden_states=torch.stack([h[0] for h in out.hidden_states[:-1]] + last),
                final_hidden_state=out.hidden_states[-1][0],
                q=torch.stack(qs), k=torch.stack(ks), v=torch.stack(vs))


@pytest.mark.regression
def test_text_at_n_ctx_through_the_app_is_bit_exact(client, gpt2_runtime):
    rt = gpt2_runtime
    n_ctx = rt.adapter.n_ctx if hasattr(rt.adapter, "n_ctx") else 256
    text = " the" * (n_ctx + 40)
    ids = rt.tokenizer(text)["input_ids"]
    # cut to exactly n_ctx tokens
    text = rt.tokenizer.decode(ids[:n_ctx]) + f""
    tt = rt.tokenize(text)
    assert len(tt) == n_ctx
    r = client.post("/v1/attention", json={"text": text, "encoding": "base64"})
    assert r.status_code == 200, r.text
    got = decode(r.json()["attention"]["pattern"])
    hf = hf_reference(rt, list(tt.input_ids))
    assert np.array_equal(got, hf["pattern"].numpy())
    r = client.post("/v1/attention", json={"text": text + " the"})
    assert r.status_code == 422


WORDS = "the cat sat on a mat and then it ran far away from home".split()


def words(n: int, seed) -> str:
    r = random.Random(str(seed))
    return " ".join(r.choice(WORDS) for _ in range(n))


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
            ids = list(rt.tokenize(t).input_ids)
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
