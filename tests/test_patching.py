"""Activation patching and attribution patching: the runtime's batched grids against
TransformerLens 4.3 ``patching`` (TransformerBridge on the same local weights), and attribution
against a direct autograd computation on Hugging Face's own forward."""

from __future__ import annotations

import pytest
import torch

from attnscope.service.analysis import interventions as A
from attnscope.service.config import Settings
from attnscope.service.runtime import Runtime
from attnscope.service.runtime import interventions as I

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

    m, grads = I.attribution_grads(rt, fk.hidden_states[0], lambda lg: raw(lg)[0], [pos])
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
