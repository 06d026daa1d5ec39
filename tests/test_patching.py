"""Activation patching and attribution patching: the runtime's batched grids against
TransformerLens 4.3 ``patching`` (TransformerBridge on the same local weights), and attribution
against a direct autograd computation on Hugging Face's own forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnscope.service.analysis import interventions as A
from attnscope.service.config import Settings
from attnscope.service.runtime import Runtime
from attnscope.service.runtime import hooked as H
from attnscope.service.runtime import interventions as I

from conftest import assert_error
from interventions_reference import gpt2_small_dir, hf_run, induction_ids, tl_bridge

pytest.importorskip("transformer_lens")


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return gpt2_small_dir(tmp_path_factory.mktemp("gpt2small"))


@pytest.fixture(scope="module")
def small_rt(small_dir):
    return Runtime.load(Settings(model=str(small_dir)))


def _pair(rt, T_seg=12, seed=0):
    """A clean induction prompt (BOS + seg + seg) and a corrupted one (second half replaced)."""
    clean = induction_ids(seed, T_seg, 2)
    other = induction_ids(seed + 100, T_seg, 1)
    corrupted = clean[: 1 + T_seg] + other[1:]
    fc, fk = (f.tensors for f in rt.forward_many(
        [rt.tokenized_from_ids(clean), rt.tokenized_from_ids(corrupted)]))
    return clean, corrupted, fc, fk


def _tl_normalised(bridge, clean, corrupted, pos, tgt, dis):
    """TransformerLens' tutorial metric: the normalised logit difference, scalar."""
    _, cache = bridge.run_with_cache(torch.tensor([clean]))
    with torch.no_grad():
        lc = bridge(torch.tensor([clean]))[0, pos]
        lk = bridge(torch.tensor([corrupted]))[0, pos]
    c, k = float(lc[tgt] - lc[dis]), float(lk[tgt] - lk[dis])

    def metric(logits):
        return (logits[0, pos, tgt] - logits[0, pos, dis] - k) / (c - k)
    return cache, metric


def _values(rt, fc, fk, pos, tgt, dis):
    c = float(A.logit_diff(I.recorded_logits(rt, fc, [pos])[0], tgt, dis))
    k = float(A.logit_diff(I.recorded_logits(rt, fk, [pos])[0], tgt, dis))
    return c, k


def test_head_and_residual_grids_equal_transformerlens_bundled(gpt2_runtime, bundled_dir):
    from transformer_lens import patching

    rt = gpt2_runtime
    clean, corrupted, fc, fk = _pair(rt, 12)
    T = len(clean)
    pos, tgt, dis = T - 2, clean[-1], corrupted[-1]
    bridge = tl_bridge(bundled_dir)
    cache, tl_metric = _tl_normalised(bridge, clean, corrupted, pos, tgt, dis)
    c_val, k_val = _values(rt, fc, fk, pos, tgt, dis)

    def metric(lg):  # [batch, 1, vocab] -> [batch]
        return A.normalized(A.logit_diff(lg[:, 0], tgt, dis), c_val, k_val)

    ours = I.head_patch_grid(rt, fc, fk, metric, [pos])
    ref = patching.get_act_patch_attn_head_out_all_pos(bridge, torch.tensor([corrupted]), cache, tl_metric)
    assert ours.shape == ref.shape == (rt.adapter.n_layers, rt.adapter.n_heads)
    assert (ours - ref).abs().max() <= 1e-5
    assert ours[1].max() > 0.2  # layer 1's induction heads restore part of the clean answer

    res = I.resid_patch_grid(rt, fc, fk, metric, [pos])
    rref = patching.get_act_patch_resid_pre(bridge, torch.tensor([corrupted]), cache, tl_metric)
    assert res.shape == rref.shape == (rt.adapter.n_layers, T)
    assert (res - rref).abs().max() <= 1e-5
    # the residual stream at the metric's position entering layer 0 is the token itself: the
    # tokens differ there, so patching it back restores almost everything
    assert res[0, pos] > 0.5


def test_head_grid_equals_transformerlens_gpt2_small(small_rt, small_dir):
    """GPT-2-small shapes ([12, 12]): TransformerLens' sweep of a few cells (its bridge needs
    a full forward per cell, seconds each on the 2-core CI) against our grid's rows for the
    same layers; the metric is the raw logit difference (normalising by the random model's
    small clean - corrupted gap would only scale the float rounding)."""
    import pandas as pd
    from transformer_lens import patching

    rt = small_rt
    clean, corrupted, fc, fk = _pair(rt, 6)
    T = len(clean)
    pos, tgt, dis = T - 2, clean[-1], corrupted[-1]
    bridge = tl_bridge(small_dir)
    _, cache = bridge.run_with_cache(torch.tensor([clean]))
    layers = [0, 6, 11]
    ours = I.head_patch_grid(rt, fc, fk, lambda lg: A.logit_diff(lg[:, 0], tgt, dis), [pos],
                             layers=layers)
    cells = pd.DataFrame([(0, 3), (6, 0), (6, 11), (11, 7)], columns=["layer", "head"])
    ref = patching.generic_activation_patch(
        bridge, torch.tensor([corrupted]), cache,
        lambda lg: lg[0, pos, tgt] - lg[0, pos, dis],
        patching.layer_head_vector_patch_setter, "z", index_df=cells)
    got = torch.stack([ours[l, h] for l, h in cells.itertuples(index=False)])
    assert (got - ref).abs().max() <= 1e-5
    assert torch.isnan(ours[1]).all() and not torch.isnan(ours[layers]).any()
    _, k_val = _values(rt, fc, fk, pos, tgt, dis)
    assert (ours[layers] - k_val).abs().max() > 1e-3  # the patches do move the metric


def test_per_position_grid_equals_transformerlens_by_pos(gpt2_runtime, bundled_dir):
    from transformer_lens import patching

    rt = gpt2_runtime
    clean, corrupted, fc, fk = _pair(rt, 4, seed=3)
    T = len(clean)
    pos, tgt, dis = T - 2, clean[-1], corrupted[-1]
    bridge = tl_bridge(bundled_dir)
    cache, tl_metric = _tl_normalised(bridge, clean, corrupted, pos, tgt, dis)
    c_val = float(A.logit_diff(I.recorded_logits(rt, fc, [pos])[0], tgt, dis))
    k_val = float(A.logit_diff(I.recorded_logits(rt, fk, [pos])[0], tgt, dis))
    ours = I.head_patch_grid(rt, fc, fk, lambda lg: A.normalized(A.logit_diff(lg[:, 0], tgt, dis),
                                                                 c_val, k_val), [pos], per_position=True)
    ref = patching.get_act_patch_attn_head_out_by_pos(bridge, torch.tensor([corrupted]), cache, tl_metric)
    assert ours.shape == (rt.adapter.n_layers, rt.adapter.n_heads, T)
    assert (ours - ref.permute(0, 2, 1)).abs().max() <= 1e-5
    # positions after the metric's position never matter (causal): 0 up to float rounding
    # (the batched patched runs against the corrupted run alone)
    assert ours[..., pos + 1:].abs().max() <= 1e-6
    assert ours[..., : pos + 1].abs().max() > 0.05


def test_attribution_equals_direct_autograd_and_ranks_like_exact(gpt2_runtime):
    rt = gpt2_runtime
    clean, corrupted, fc, fk = _pair(rt, 12, seed=1)
    T = len(clean)
    pos, tgt, dis = T - 2, clean[-1], corrupted[-1]

    def raw(lg):
        return A.logit_diff(lg[:, 0], tgt, dis)

    # the endpoint starts the corrupted run from its embeddings (no recorded forward)
    assert torch.equal(I.embedding_output(rt, corrupted), fk.hidden_states[0])
    m, grads = I.attribution_grads(rt, corrupted, H.LogitDiff(terms=[(0, pos, tgt, dis)]))
    z_c, z_k = I.head_z(fc.pattern, fc.v), I.head_z(fk.pattern, fk.v)
    att = A.attribution(torch.stack(grads), z_c, z_k)  # [layer, head]

    # direct autograd on Hugging Face's own forward: z captured before c_proj, grad of the
    # logit difference, times (clean z - corrupted z), summed over positions and d_head
    model = rt.model
    with torch.no_grad():
        zs_clean = []
        hf_run(model, [clean], watch=zs_clean)
    watched = []
    with torch.enable_grad():
        emb_hook = model.transformer.wte.register_forward_hook(lambda m_, a, o: o.requires_grad_(True))
        try:
            logits = hf_run(model, [corrupted], watch=watched)
        finally:
            emb_hook.remove()
        metric = logits[0, pos, tgt] - logits[0, pos, dis]
        g = torch.autograd.grad(metric, watched)
    direct = torch.stack([(gl[0] * (zc[0] - zk[0].detach())).sum(dim=(0, 2))
                          for gl, zc, zk in zip(g, zs_clean, watched)])
    assert float(m) == pytest.approx(float(metric.detach()), abs=1e-5)
    assert (att - direct).abs().max() <= 1e-5

    # exact patching ranks the same top heads (the induction heads of layer 1)
    exact = I.head_patch_grid(rt, fc, fk, raw, [pos]) - float(m)
    top_exact = set(exact.flatten().topk(2).indices.tolist())
    top_attr = set(att.flatten().topk(2).indices.tolist())
    assert top_exact == top_attr
    assert A.pearson(att, exact) > 0.8


# ------------------------------------------------------------------ the endpoint
CLEAN = "The cat sat on the mat. The cat sat on the"
CORRUPTED = "The dog sat on the rug. The cat sat on the"


def test_patch_endpoint_equals_hf_hook_loop(client, gpt2_runtime):
    """The grid through HTTP == an independent loop of Hugging Face forwards, each with one
    head's z replaced by the clean run's (a c_proj pre-hook), normalised by hand."""
    rt = gpt2_runtime
    r = client.post("/v1/patch", json={"clean_text": CLEAN, "corrupted_text": CORRUPTED, "add_bos": True,
                                       "logit_diff": {"target": " m", "distractor": " ru"},
                                       "residual": True, "per_position": True})
    assert r.status_code == 200, r.text
    b = r.json()
    ids_c = [t["id"] for t in b["clean_tokens"]]
    ids_k = [t["id"] for t in b["corrupted_tokens"]]
    tgt, dis = b["logit_diff"]["target"]["id"], b["logit_diff"]["distractor"]["id"]
    assert b["logit_diff"]["position"] == len(ids_c) - 1

    def ld(logits):
        return float(logits[0, -1, tgt] - logits[0, -1, dis])
    zs_c = []
    with torch.no_grad():
        c = ld(hf_run(rt.model, [ids_c], watch=zs_c))
        k = ld(rt.model(input_ids=torch.tensor([ids_k])).logits)
        assert b["clean_value"] == pytest.approx(c, abs=1e-5)
        assert b["corrupted_value"] == pytest.approx(k, abs=1e-5)
        L, H = rt.adapter.n_layers, rt.adapter.n_heads
        for layer in range(L):
            for h in range(H):
                def edit(lyr, z, layer=layer, h=h):
                    if lyr == layer:
                        z = z.clone()
                        z[:, :, h] = zs_c[layer][:, :, h]
                    return z
                p = ld(hf_run(rt.model, [ids_k], edit))
                assert b["heads_raw"][layer][h] == pytest.approx(p, abs=1e-5)
                assert b["heads"][layer][h] == pytest.approx((p - k) / (c - k), abs=1e-5)
    T = len(ids_c)
    assert np.array(b["heads_per_position"]).shape == (L, H, T)
    assert np.array(b["residual"]).shape == (L, T)
    # the residual stream entering layer 0 at the differing positions carries the whole change
    res = np.array(b["residual"])
    assert res[0].max() > 0.5 and b["approximation"] is None


def test_patch_attribution_endpoint(client, gpt2_runtime):
    base = {"clean_text": CLEAN, "corrupted_text": CORRUPTED, "add_bos": True,
            "logit_diff": {"target": " m", "distractor": " ru"}}
    exact = client.post("/v1/patch", json=base).json()
    r = client.post("/v1/patch", json={**base, "method": "attribution", "per_position": True})
    assert r.status_code == 200, r.text
    att = r.json()
    assert "linear approximation" in att["approximation"]
    assert att["clean_value"] == exact["clean_value"]
    a, e = np.array(att["heads"]), np.array(exact["heads"])
    assert a.shape == e.shape
    # the per-position estimates sum to the all-position one (the estimate is linear in the patch)
    per = np.array(att["heads_per_position"])
    np.testing.assert_allclose(per.sum(-1), a, atol=1e-4)
    assert np.corrcoef(a.ravel(), e.ravel())[0, 1] > 0.5


def test_patch_bad_inputs_and_memory(client, bert_client, make_client, gpt2_runtime):
    ld = {"target": " m", "distractor": " ru"}
    # the counts of the texts' own tokens (add_bos false)
    e = assert_error(client.post("/v1/patch", json={"clean_text": "The cat sat on the mat.",
                                                    "corrupted_text": "The man sat on the mat.",
                                                    "logit_diff": ld, "add_bos": False}),
                     422, "validation_error", "corrupted_text")
    assert "9 tokens" in e["message"] and "has 8" in e["message"]
    base = {"clean_text": CLEAN, "corrupted_text": CORRUPTED}
    for body, type_, param in [
        (dict(base), "validation_error", None),  # logit_diff needed
        ({**base, "logit_diff": {"target": " mat", "distractor": " ru"}}, "validation_error", "logit_diff.target"),
        ({**base, "logit_diff": {"target": " m", "distractor": " m"}}, "validation_error", "logit_diff.distractor"),
        ({**base, "logit_diff": {**ld, "position": 99}}, "out_of_range", "logit_diff.position"),
        ({**base, "metric": "loss", "positions": [99]}, "out_of_range", "positions.0"),
        ({**base, "logit_diff": ld, "method": "attribution", "residual": True}, "validation_error", None),
        ({**base, "logit_diff": ld, "method": "nope"}, "validation_error", None),
    ]:
        assert_error(client.post("/v1/patch", json=body), 422, type_, param)
    assert_error(bert_client.post("/v1/patch", json={**base, "logit_diff": ld}), 422, "unsupported_model")

    # too many patched forwards for the memory limit: refused before any forward runs
    small = make_client(gpt2_runtime, max_request_bytes=40 << 20)
    long_c = " ".join(["The cat sat on the mat."] * 8)
    long_k = " ".join(["The dog sat on the rug."] * 8)
    before = gpt2_runtime.forward_count
    e = assert_error(small.post("/v1/patch", json={"clean_text": long_c, "corrupted_text": long_k,
                                                   "logit_diff": ld, "per_position": True}),
                     422, "memory_limit_exceeded")
    assert "patched forwards" in e["message"] and "the limit is" in e["message"]
    assert gpt2_runtime.forward_count == before
    ok = small.post("/v1/patch", json={"clean_text": long_c, "corrupted_text": long_k, "logit_diff": ld})
    assert ok.status_code == 200, ok.text
    r = client.post("/v1/patch", json={"clean_text": CLEAN, "corrupted_text": CORRUPTED, "metric": "loss"})
    assert r.status_code == 200 and r.json()["metric"] == "loss"
