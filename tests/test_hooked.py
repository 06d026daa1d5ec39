"""The hooked forward (service/runtime/hooked.py) against TransformerLens 4.3 and Hugging Face.

TransformerLens: ``TransformerBridge.boot_transformers(dir)`` with
``enable_compatibility_mode(no_processing=True)`` (legacy names, the unprocessed weights our
model serves) and ``use_attn_result`` / ``use_split_qkv_input`` on, so that every hook we
expose exists there. Its own float32 rounding against Hugging Face is ~1e-5 on logits, so the
bounds below are ``max(1e-5, 2 x the bridge's clean discrepancy)`` where stated.
Hugging Face: ``GPT2LMHeadModel`` eager, ``use_cache=False`` (the runtime's own call), bit for
bit."""

from __future__ import annotations

import os

import pytest
import torch

from attnscope.service.errors import InvalidRequest
from attnscope.service.runtime import hooked as K

from interventions_reference import gpt2_small_dir, tl_hooked_bridge, tl_legacy_name

pytest.importorskip("transformer_lens")

IDS = torch.tensor([[0, 5, 17, 99, 300, 12, 7, 8, 41, 250],
                    [0, 51, 17, 929, 300, 12, 7, 9, 41, 77]])


def _hf(path):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(str(path), attn_implementation="eager").eval()


class Model:
    def __init__(self, path):
        self.path = path
        self.hf = _hf(path)
        self.parts = K.gpt2_parts(self.hf)
        self.tl = tl_hooked_bridge(path)


@pytest.fixture(scope="module")
def bundled(bundled_dir):
    return Model(bundled_dir)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return Model(gpt2_small_dir(tmp_path_factory.mktemp("hooked_small"), seed=3, n_positions=64))


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b|; -inf entries must coincide."""
    a, b = a.detach(), b.detach()
    ia, ib = torch.isinf(a), torch.isinf(b)
    assert torch.equal(ia, ib)
    return float((a[~ia] - b[~ib]).abs().max()) if (~ia).any() else 0.0


def _tl_cache(m: Model, ids):
    with torch.no_grad():
        logits, cache = m.tl.run_with_cache(ids)
    return logits, {k: v for k, v in cache.items() if tl_legacy_name(k)}


def _check_full_cache(m: Model, ids, names=None):
    """Every hook equal to TL's to ``1e-5 + 1e-6 * max|value|`` (float32: the bridge's own
    blocks round differently; bundled model, residual ~20: measured 1.7e-5 on resid_post,
    whose Hugging Face value we equal bit for bit)."""
    tl_logits, tl = _tl_cache(m, ids)
    parts = m.parts if names is None else K.with_names(m.parts, names)
    ours = K.run(parts, ids, cache={"*": None})
    assert set(ours.cache) == set(tl), set(ours.cache) ^ set(tl)
    worst = {}
    for n, t in tl.items():
        assert tuple(ours.cache[n].shape) == tuple(t.shape), n
        fin = t[torch.isfinite(t)]
        worst[n] = _diff(ours.cache[n], t) / (1e-5 + 1e-6 * float(fin.abs().max()))
    assert max(worst.values()) <= 1.0, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert _diff(ours.logits, tl_logits) <= 1e-5 + 1e-6 * float(tl_logits.abs().max())
    return worst


def test_full_cache_equals_transformerlens_bundled(bundled):
    worst = _check_full_cache(bundled, IDS)
    assert len(worst) == 4 + 21 * 2


@pytest.mark.slow
def test_full_cache_equals_transformerlens_gpt2_small(small):
    ids = torch.randint(0, 2048, (1, 16), generator=torch.Generator().manual_seed(1))
    _check_full_cache(small, ids)


def test_catalogue_names_and_shapes_are_transformerlens(bundled):
    _, tl = _tl_cache(bundled, IDS)
    pts = K.hook_points(bundled.hf)
    assert [h.name for h in pts] == [h.name for h in K.hook_points(bundled.parts)]
    assert {h.name for h in pts} == set(tl)
    for h in pts:
        assert h.shape(*IDS.shape) == tuple(tl[h.name].shape), h
        assert len(h.axes) == len(h.sizes)
    z = next(h for h in pts if h.name == "blocks.1.attn.hook_z")
    assert z.axes == ("batch", "pos", "head", "d_head") and z.sizes == (None, None, 4, 32)


@pytest.mark.parametrize("swap", [("resid_mid", "resid_post"), ("q", "k")])
def test_a_wrong_name_map_fails_the_transformerlens_comparison(bundled, swap):
    """Planted fault: two hooks' TL names exchanged in a copy of the map."""
    names = dict(K.TL_NAMES)
    a, b = swap
    names[a], names[b] = names[b], names[a]
    with pytest.raises(AssertionError):
        _check_full_cache(bundled, IDS, names)
    _check_full_cache(bundled, IDS)  # the real map still passes


def _hf_bit_for_bit(m: Model, ids):
    with torch.no_grad():
        o = m.hf(ids, output_attentions=True, output_hidden_states=True, use_cache=False)
    L = m.parts.n_layers
    res = K.run(m.parts, ids, cache={"blocks.*.hook_resid_pre": None,
                                     "blocks.*.attn.hook_pattern": None,
                                     f"blocks.{L - 1}.hook_resid_post": None})
    assert torch.equal(res.logits, o.logits)
    for layer in range(L):
        assert torch.equal(res.cache[f"blocks.{layer}.hook_resid_pre"], o.hidden_states[layer])
        assert torch.equal(res.cache[f"blocks.{layer}.attn.hook_pattern"], o.attentions[layer])
    # nothing cached: the same forward
    assert torch.equal(K.run(m.parts, ids).logits, o.logits)
    # Hugging Face's default (use_cache=True) makes k and v contiguous (its DynamicCache),
    # another matmul kernel: equal to float rounding only
    with torch.no_grad():
        o2 = m.hf(ids, use_cache=True)
    return float((o2.logits - res.logits).abs().max())


def test_logits_and_hidden_states_equal_hugging_face_bit_for_bit(bundled):
    assert _hf_bit_for_bit(bundled, IDS) <= 1e-4
    assert _hf_bit_for_bit(bundled, IDS[:1]) <= 1e-4


@pytest.mark.slow
def test_logits_equal_hugging_face_bit_for_bit_gpt2_small(small):
    ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(2))
    assert _hf_bit_for_bit(small, ids) <= 1e-4


# ---------------------------------------------------------------- interventions against TL

def _vec(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _cases():
    """(id, our interventions, TL fwd_hooks builder(tl_clean_cache) -> [(name, fn)])."""
    v128 = _vec(128)
    val_v = torch.randn(2, 1, 32, generator=torch.Generator().manual_seed(5))  # [pos, head, dh]

    def edit(fn):
        def hook(t, hook):
            t = t.clone()
            fn(t)
            return t
        return hook

    return [
        ("zero_z_head_pos", [K.Zero(hook="blocks.0.attn.hook_z", heads=[1], positions=[2, 3])],
         lambda c: [("blocks.0.attn.hook_z", edit(lambda t: t[:, 2:4, 1].zero_()))]),
        ("mean_z_batch_pos", [K.Mean(hook="blocks.1.attn.hook_z", heads=[0, 2])],
         lambda c: [("blocks.1.attn.hook_z", edit(
             lambda t: t.__setitem__((slice(None), slice(None), [0, 2]),
                                     t[:, :, [0, 2]].mean((0, 1), keepdim=True))))]),
        ("mean_mlp_post_pos", [K.Mean(hook="blocks.0.mlp.hook_post", over="pos", prompts=[1])],
         lambda c: [("blocks.0.mlp.hook_post", edit(
             lambda t: t[1].copy_(t[1].mean(0, keepdim=True).expand_as(t[1]))))]),
        ("set_resid_from_prompt", [K.Set(hook="blocks.1.hook_resid_pre", prompts=[1],
                                         positions=[3, -1], source_prompt=0)],
         lambda c: [("blocks.1.hook_resid_pre", edit(
             lambda t: t.__setitem__((1, [3, 9]), t[0, [3, 9]])))]),
        ("set_k_input_one_head", [K.Set(hook="blocks.1.hook_k_input", heads=[2], prompts=[1],
                                        source_prompt=0)],
         lambda c: [("blocks.1.hook_k_input", edit(lambda t: t[1, :, 2].copy_(t[0, :, 2])))]),
        ("set_q_input_two_heads_positions", [K.Set(hook="blocks.0.hook_q_input", heads=[0, 3],
                                                   positions=[3], source_prompt=1)],
         lambda c: [("blocks.0.hook_q_input", edit(
             lambda t: t.__setitem__((slice(None), 3, [0, 3]), t[1, 3, [0, 3]])))]),
        ("add_resid_mid_steer", [K.Add(hook="blocks.0.hook_resid_mid", vector=v128, scale=3.0,
                                       positions=[-1])],
         # TL 4.3's bridge aliases hook_resid_mid to ln2.hook_in: an edit there reaches the
         # MLP's input only, not the residual the MLP output is added to (HookedTransformer
         # and we edit the stream itself), so TL gets the same edit on hook_mlp_out too
         lambda c: [("blocks.0.hook_resid_mid", edit(lambda t: t[:, -1].add_(3.0 * v128))),
                    ("blocks.0.hook_mlp_out", edit(lambda t: t[:, -1].add_(3.0 * v128)))]),
        ("scale_pattern_head", [K.Scale(hook="blocks.1.attn.hook_pattern", heads=[3],
                                        factor=0.5)],
         lambda c: [("blocks.1.attn.hook_pattern", edit(lambda t: t[:, 3].mul_(0.5)))]),
        ("add_scores_query_pos", [K.Add(hook="blocks.0.attn.hook_attn_scores", heads=[1],
                                        positions=[5], vector=_vec(10, 1))],
         lambda c: [("blocks.0.attn.hook_attn_scores", edit(
             lambda t: t[:, 1, 5].add_(_vec(10, 1))))]),  # -inf + c stays -inf
        ("set_v_value", [K.Set(hook="blocks.0.attn.hook_v", heads=[2], positions=[1, 6],
                               value=val_v)],
         lambda c: [("blocks.0.attn.hook_v", edit(lambda t: t.__setitem__(
             (slice(None), [1, 6], slice(2, 3)), val_v)))]),
        ("zero_result_head", [K.Zero(hook="blocks.1.attn.hook_result", heads=[0])],
         lambda c: [("blocks.1.attn.hook_result", edit(lambda t: t[:, :, 0].zero_()))]),
        ("scale_ln2_normalized", [K.Scale(hook="blocks.0.ln2.hook_normalized", factor=1.5,
                                          positions=[2])],
         lambda c: [("blocks.0.ln2.hook_normalized", edit(lambda t: t[:, 2].mul_(1.5)))]),
        ("pattern_many_layers_mlp_out", [K.Scale(hook="blocks.*.hook_mlp_out", factor=0.0),
                                         K.Add(hook="hook_embed", vector=v128, prompts=[0])],
         lambda c: [(f"blocks.{i}.hook_mlp_out", edit(lambda t: t.mul_(0.0))) for i in (0, 1)]
         + [("hook_embed", edit(lambda t: t[0].add_(v128)))]),
        ("mean_reference", [K.Mean(hook="blocks.0.attn.hook_z", heads=[3],
                                   reference=torch.full((4, 32), 0.25))],
         lambda c: [("blocks.0.attn.hook_z", edit(lambda t: t[:, :, 3].fill_(0.25)))]),
        ("two_edits_same_hook_in_order", [K.Add(hook="blocks.1.hook_resid_post", vector=v128),
                                          K.Scale(hook="blocks.1.hook_resid_post", factor=2.0)],
         lambda c: [("blocks.1.hook_resid_post", edit(lambda t: t.add_(v128).mul_(2.0)))]),
    ]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_intervention_equals_transformerlens_run_with_hooks(bundled, case):
    _, ours_iv, tl_hooks = case
    b = bundled.tl
    with torch.no_grad():
        clean_tl = b(IDS)
        ref = b.run_with_hooks(IDS, fwd_hooks=tl_hooks(None))
    clean = K.run(bundled.parts, IDS).logits
    ours = K.run(bundled.parts, IDS, interventions=ours_iv).logits
    assert float((ours - clean).abs().max()) > 1e-3  # the edit does change the logits
    # float32 drift: the two forwards' clean gap, doubled, plus 1e-6 of the logits' scale
    # (the edited forward sums in its own order; 2x the clean gap alone failed once at 2.0e-5)
    rounding = float((clean_tl - clean).abs().max())
    bound = max(1e-5, 2 * rounding) + 1e-6 * float(ref.abs().max())
    assert float((ours - ref).abs().max()) <= bound


def test_intervention_cache_shows_the_edited_value_and_the_selection(bundled):
    res = K.run(bundled.parts, IDS, interventions=[K.Zero(hook="blocks.0.attn.hook_z",
                                                          heads=[1])],
                cache={"blocks.0.attn.hook_z": K.CacheSelect(heads=[1, 2], positions=[-1],
                                                             prompts=[1]),
                       "blocks.*.attn.hook_pattern": K.CacheSelect(layers=[1], heads=[0])})
    z = res.cache["blocks.0.attn.hook_z"]
    assert z.shape == (1, 1, 2, 32) and torch.all(z[:, :, 0] == 0) and torch.any(z[:, :, 1] != 0)
    assert set(res.cache) == {"blocks.0.attn.hook_z", "blocks.1.attn.hook_pattern"}
    assert res.cache["blocks.1.attn.hook_pattern"].shape == (2, 1, 10, 10)


def test_setting_a_hook_from_its_own_prompt_is_exactly_clean(bundled):
    clean = K.run(bundled.parts, IDS).logits
    ours = K.run(bundled.parts, IDS, interventions=[
        K.Set(hook="blocks.*.attn.hook_z", prompts=[0], source_prompt=0),
        K.Set(hook="blocks.1.hook_resid_mid", source_prompt=1, prompts=[1])]).logits
    assert torch.equal(ours, clean)


def test_scores_edit_stays_causal(bundled):
    """A set of the scores writes no weight above the diagonal (TL would let it through)."""
    T = IDS.shape[1]
    res = K.run(bundled.parts, IDS, interventions=[
        K.Set(hook="blocks.0.attn.hook_attn_scores", value=torch.zeros(4, T, T))],
        cache={"blocks.0.attn.hook_pattern": None})
    pat = res.cache["blocks.0.attn.hook_pattern"]
    assert torch.all(pat.triu(1) == 0)
    rows = torch.arange(1, T + 1, dtype=pat.dtype)
    torch.testing.assert_close(pat[0, 0].sum(-1), torch.ones(T))
    torch.testing.assert_close(pat[0, 0].diagonal(), 1 / rows)  # uniform over the past


# ---------------------------------------------------------------- metrics and gradients

def test_metrics_equal_hand_written_torch(bundled):
    metrics = {
        "ld": K.LogitDiff(terms=[(None, -1, 17, 99), (0, 3, 5, 6)]),
        "ld_sum": K.LogitDiff(terms=[(1, 2, 17, 99)], reduce="sum"),
        "p": K.Prob(terms=[(0, 4, 300)]),
        "lp": K.LogProb(terms=[(None, 4, 300)]),
        "loss": K.Loss(terms=[(None, 0), (1, 8)]),
        "kl": K.KL(terms=[(0, 1, -1), (1, 0, 3)]),
    }
    res = K.run(bundled.parts, IDS, metrics=metrics, logit_positions=[0])
    lg = K.run(bundled.parts, IDS).logits
    lsm = torch.log_softmax(lg, -1)
    ld = torch.stack([lg[0, 9, 17] - lg[0, 9, 99], lg[1, 9, 17] - lg[1, 9, 99],
                      lg[0, 3, 5] - lg[0, 3, 6]])
    exp = {
        "ld": (ld, ld.mean()),
        "ld_sum": (lg[1, 2, 17:18] - lg[1, 2, 99:100], (lg[1, 2, 17] - lg[1, 2, 99])),
        "p": (lsm[0, 4, 300:301].exp(), lsm[0, 4, 300].exp()),
        "lp": (lsm[:, 4, 300], lsm[:, 4, 300].mean()),
        "loss": (torch.stack([-lsm[0, 0, IDS[0, 1]], -lsm[1, 0, IDS[1, 1]],
                              -lsm[1, 8, IDS[1, 9]]]), None),
        "kl": (torch.stack([(lsm[0, 9].exp() * (lsm[0, 9] - lsm[1, 9])).sum(),
                            (lsm[1, 3].exp() * (lsm[1, 3] - lsm[0, 3])).sum()]), None),
    }
    for n, (vals, val) in exp.items():
        torch.testing.assert_close(res.metrics[n].values, vals, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(res.metrics[n].value, vals.mean() if val is None else val,
                                   rtol=1e-6, atol=1e-6)
    assert res.logits.shape == (2, 1, 2048) and res.logit_positions == [0]
    assert float((res.logits[:, 0] - lg[:, 0]).abs().max()) <= 1e-5
    assert torch.all(res.metrics["kl"].values >= 0)


def test_gradient_equals_autograd_through_transformerlens_hooks(bundled):
    """Attribution patching's one backward: d(mean logit difference)/d(hooks), against
    torch.autograd.grad of the same metric through TL's hooks."""
    hooks = ["blocks.0.attn.hook_z", "blocks.1.hook_resid_pre", "blocks.1.hook_q_input",
             "blocks.0.attn.hook_result", "blocks.1.attn.hook_pattern", "hook_embed"]
    metric = K.LogitDiff(terms=[(None, -1, 17, 99), (0, 5, 300, 12)])
    res = K.run(bundled.parts, IDS, grad=K.GradRequest(metric=metric, hooks=hooks),
                cache={"blocks.0.attn.hook_z": None})
    assert set(res.grads) == set(hooks)
    assert not res.cache["blocks.0.attn.hook_z"].requires_grad

    saved = {}

    def keep(name):
        def fn(t, hook):
            saved[name] = t
            return t
        return fn

    with torch.enable_grad():
        lg = bundled.tl.run_with_hooks(IDS, fwd_hooks=[(h, keep(h)) for h in hooks])
        ld = torch.stack([lg[0, -1, 17] - lg[0, -1, 99], lg[1, -1, 17] - lg[1, -1, 99],
                          lg[0, 5, 300] - lg[0, 5, 12]]).mean()
        ref = torch.autograd.grad(ld, [saved[h] for h in hooks])
    torch.testing.assert_close(res.grad_value, ld.detach(), rtol=0, atol=2e-5)
    for h, g in zip(hooks, ref):
        assert res.grads[h].shape == g.shape, h
        scale = float(g.abs().max())
        assert scale > 0, h
        assert float((res.grads[h] - g).abs().max()) <= 1e-4 * max(1.0, scale), h


def test_gradient_of_the_logits_head_by_finite_difference(bundled):
    """d metric / d hook_resid_post of the last layer at one entry, against a central
    difference of the forward with an Add there (float64 copy of the parts)."""
    parts = K.gpt2_parts(_hf(bundled.path).double())
    ids = IDS[:1]
    metric = K.LogProb(terms=[(0, 6, 300)])
    res = K.run(parts, ids, grad=K.GradRequest(metric=metric, hooks=["blocks.0.hook_resid_mid"]))
    g = res.grads["blocks.0.hook_resid_mid"]
    eps = 1e-5
    for pos, d in [(6, 3), (2, 100)]:
        e = torch.zeros(128, dtype=torch.float64)
        e[d] = eps

        def f(sign):
            return float(K.run(parts, ids, metrics={"m": metric}, interventions=[
                K.Add(hook="blocks.0.hook_resid_mid", vector=e, scale=sign,
                      positions=[pos])]).metrics["m"].value)
        fd = (f(1.0) - f(-1.0)) / (2 * eps)
        assert abs(fd - float(g[0, pos, d])) <= 1e-6 + 1e-5 * abs(fd)


# ---------------------------------------------------------------- bad input

def _err(param_prefix, **kw):
    with pytest.raises(InvalidRequest) as ei:
        K.run(kw.pop("parts"), kw.pop("ids", IDS), **kw)
    assert ei.value.param == param_prefix, (ei.value.param, ei.value.message)
    return ei.value.message


def test_unknown_hook_names_the_closest(bundled):
    msg = _err("cache['blocks.0.attn.hook_zz']", parts=bundled.parts,
               cache={"blocks.0.attn.hook_zz": None})
    assert "blocks.0.attn.hook_z" in msg
    msg = _err("interventions[0].hook", parts=bundled.parts,
               interventions=[K.Zero(hook="blocks.1.hook_resid_psot")])
    assert "blocks.1.hook_resid_post" in msg
    _err("grad.hooks[0]", parts=bundled.parts,
         grad=K.GradRequest(metric=K.Loss(terms=[(0, 0)]), hooks=["blocks.9.*"]))


def test_out_of_range_selections(bundled):
    p = bundled.parts
    assert "head 4" in _err("interventions[0].heads", parts=p,
                            interventions=[K.Zero(hook="blocks.0.attn.hook_z", heads=[4])])
    _err("interventions[0].positions", parts=p,
         interventions=[K.Zero(hook="blocks.0.hook_resid_pre", positions=[10])])
    _err("interventions[0].prompts", parts=p,
         interventions=[K.Zero(hook="blocks.0.hook_resid_pre", prompts=[2])])
    _err("interventions[0].heads", parts=p,
         interventions=[K.Zero(hook="blocks.0.hook_resid_pre", heads=[0])])
    _err("cache['blocks.*.hook_z'].layers", parts=p,
         cache={"blocks.*.hook_z": K.CacheSelect(layers=[2])})
    _err("logit_positions", parts=p, logit_positions=[-11])
    _err("metrics['m'].terms[0]", parts=p, metrics={"m": K.Loss(terms=[(0, 9)])})
    _err("metrics['m'].terms[0]", parts=p, metrics={"m": K.Prob(terms=[(0, 1, 2048)])})
    _err("input_ids", parts=p, ids=torch.zeros(1, 300, dtype=torch.long))
    _err("input_ids", parts=p, ids=torch.tensor([[0, 2048]]))


def test_wrong_shape_tensor_and_missing_prompt(bundled):
    p = bundled.parts
    msg = _err("interventions[0].value", parts=p, interventions=[
        K.Set(hook="blocks.0.attn.hook_v", heads=[2], value=torch.zeros(10, 2, 32))])
    assert "[10, 1, 32]" in msg
    _err("interventions[0].vector", parts=p,
         interventions=[K.Add(hook="blocks.0.hook_resid_pre", vector=torch.zeros(32))])
    _err("interventions[0].reference", parts=p,
         interventions=[K.Mean(hook="blocks.0.attn.hook_z", reference=torch.zeros(3, 32))])
    assert "0..1" in _err("interventions[0].source_prompt", parts=p, interventions=[
        K.Set(hook="blocks.0.attn.hook_z", source_prompt=2)])
    _err("interventions[0]", parts=p, interventions=[K.Set(hook="blocks.0.attn.hook_z")])
    _err("interventions[0].over", parts=p, interventions=[
        K.Mean(hook="blocks.0.attn.hook_attn_scores", over="pos")])
    _err("interventions", parts=p, interventions=[
        K.Zero(hook="blocks.0.ln1.hook_scale"), K.Zero(hook="blocks.0.hook_v_input", heads=[0])])


def test_unsupported_configs_are_refused(bundled):
    from attnscope.service.errors import UnsupportedModelConfig

    hf = _hf(bundled.path)
    hf.config.reorder_and_upcast_attn = True
    with pytest.raises(UnsupportedModelConfig):
        K.gpt2_parts(hf)


def test_reference_means_feed_mean_ablation(bundled):
    ref_ids = torch.tensor([[0, 3, 4, 5, 6], [0, 7, 8, 9, 10], [0, 11, 12, 13, 14]])
    means = K.reference_means(bundled.parts, ref_ids, ["blocks.0.attn.hook_z"])
    z = K.run(bundled.parts, ref_ids, cache={"blocks.0.attn.hook_z": None}).cache
    m = means["blocks.0.attn.hook_z"]
    assert m.shape == (4, 32)
    torch.testing.assert_close(m, z["blocks.0.attn.hook_z"].mean((0, 1)))
    res = K.run(bundled.parts, IDS, cache={"blocks.0.attn.hook_z": None}, interventions=[
        K.Mean(hook="blocks.0.attn.hook_z", heads=[1], reference=m)])
    assert torch.equal(res.cache["blocks.0.attn.hook_z"][:, :, 1], m[1].expand(2, 10, 32))


# ----------------------------------------- starting at a layer; per-row masks (patching grids)
def test_start_from_a_cached_residual_equals_the_full_forward(bundled):
    """``start=l, resid_pre=<hook_resid_pre of l>``: the layers from l with their
    interventions, bit for bit the full forward's (what the patching grids run)."""
    p = bundled.parts
    full = K.run(p, IDS, cache={"blocks.*.hook_resid_pre": None})
    for layer in range(p.n_layers + 1):
        resid = (full.cache[f"blocks.{layer}.hook_resid_pre"] if layer < p.n_layers else None)
        ivs = [K.Zero(hook="blocks.1.attn.hook_z", heads=[2])] if layer <= 1 else []
        ref = K.run(p, IDS, interventions=ivs, logit_positions=[-1, 3])
        if resid is None:  # start = n_layers: ln_f and the unembedding only
            resid = K.run(p, IDS, cache={"blocks.1.hook_resid_post": None}).cache[
                "blocks.1.hook_resid_post"]
        got = K.run(p, IDS, interventions=ivs, logit_positions=[-1, 3], start=layer,
                    resid_pre=resid)
        assert torch.equal(got.logits, ref.logits), layer
    one = K.run(p, IDS[:1].expand(3, -1), start=1,
                resid_pre=full.cache["blocks.1.hook_resid_pre"][:1])  # [1, pos, d] broadcast
    assert torch.equal(one.logits, K.run(p, IDS[:1].expand(3, -1)).logits)


def test_start_refuses_hooks_below_it_and_bad_residuals(bundled):
    p = bundled.parts
    r = torch.zeros(2, IDS.shape[1], p.d_model)
    for kw, param in (
            (dict(start=1, resid_pre=r, cache={"blocks.0.hook_resid_post": None}), "start"),
            (dict(start=1, resid_pre=r, interventions=[K.Zero(hook="hook_embed")]), "start"),
            (dict(start=1), "resid_pre"),
            (dict(start=1, resid_pre=r[:, :-1]), "resid_pre"),
            (dict(start=1, resid_pre=r.double()), "resid_pre"),
            (dict(start=p.n_layers + 1, resid_pre=r), "start")):
        with pytest.raises(InvalidRequest) as e:
            K.run(p, IDS, **kw)
        assert e.value.param == param, kw


def test_mask_edits_each_row_its_own_selection(bundled):
    """A per-row mask (row h: head h at every position; row 2: head 1 at position 4 only) is
    the same forward as one intervention per row with a prompts/heads/positions selection."""
    p = bundled.parts
    ids = IDS[:1].expand(3, -1)
    clean = K.run(p, IDS[1:], cache={"blocks.1.attn.hook_z": None}).cache["blocks.1.attn.hook_z"][0]
    mask = torch.zeros(3, ids.shape[1], p.n_heads, dtype=torch.bool)
    mask[0, :, 0] = mask[1, :, 1] = True
    mask[2, 4, 1] = True
    for make in (lambda **kw: K.Set(value=clean, **kw), K.Zero,
                 lambda **kw: K.Mean(reference=clean.mean(0), **kw)):
        masked = K.run(p, ids, interventions=[make(hook="blocks.1.attn.hook_z", mask=mask)])
        sel = [make(hook="blocks.1.attn.hook_z", prompts=[0], heads=[0]),
               make(hook="blocks.1.attn.hook_z", prompts=[1], heads=[1]),
               make(hook="blocks.1.attn.hook_z", prompts=[2], heads=[1], positions=[4])]
        if isinstance(sel[0], K.Set):  # a value of the selection's shape
            sel = [K.Set(hook=s.hook, prompts=s.prompts, heads=s.heads, positions=s.positions,
                         value=clean[s.positions or slice(None)][:, s.heads])
                   for s in sel]
        ref = K.run(p, ids, interventions=sel)
        assert torch.equal(masked.logits, ref.logits)
        assert not torch.equal(masked.logits[0], masked.logits[1])
    # residual stream, [batch, pos] mask: row t takes position t from the other prompt
    other = K.run(p, IDS[1:], cache={"blocks.1.hook_resid_pre": None}).cache["blocks.1.hook_resid_pre"][0]
    eye = torch.eye(3, ids.shape[1], dtype=torch.bool)
    masked = K.run(p, ids, interventions=[K.Set(hook="blocks.1.hook_resid_pre", value=other,
                                                mask=eye)])
    ref = K.run(p, ids, interventions=[
        K.Set(hook="blocks.1.hook_resid_pre", prompts=[t], positions=[t], value=other[t:t + 1])
        for t in range(3)])
    assert torch.equal(masked.logits, ref.logits)


def test_bad_masks_are_refused(bundled):
    p = bundled.parts
    T = IDS.shape[1]
    for m in (torch.ones(2, T, dtype=torch.bool),  # hook_z has 3 leading axes
              torch.ones(2, T, 5, dtype=torch.bool),
              torch.ones(2, T, p.n_heads)):  # not bool
        with pytest.raises(InvalidRequest) as e:
            K.run(p, IDS, interventions=[K.Zero(hook="blocks.0.attn.hook_z", mask=m)])
        assert e.value.param == "interventions[0].mask"
