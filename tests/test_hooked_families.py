"""The hooked forward on the rotary families (service/runtime/hooked_families.py): Llama,
Mistral, Qwen2, Gemma, Gemma 2 and GPT-NeoX, on the random small checkpoints of
tests/families.py (GQA 4/2 heads, NeoX rotary_pct 0.25 + parallel residual, Mistral window 8,
Gemma 2 soft-caps + alternating window + post norms, Qwen2 q/k/v biases, Gemma 1 + w and
sqrt(d_model)). Texts of 13 tokens, longer than the windows.

* Hugging Face eager, ``use_cache=False``: logits and every hidden state bit for bit; head
  ablation, kv-head ablation, activation patching and gradients equal HF hook loops (forward
  hooks on ``o_proj`` / ``dense`` / ``k_proj``), with planted faults (wrong theta, swapped
  kv heads, window off by one, no soft-cap) that the HF equality catches.
* TransformerLens 4.3's bridge (no_processing, hook_result, split q/k/v inputs): the same
  hook names (``hook_cos`` / ``hook_sin`` with the request's batch where TL caches a broadcast
  batch of 1), shapes, values within TL's own float32
  rounding ``1e-5 + 1e-6 * max|value|``, and the same interventions through
  ``run_with_hooks``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from attnscope.service.errors import UnsupportedModelConfig
from attnscope.service.runtime import hooked as K
from attnscope.service.runtime import hooked_families as HF

from families import FAMILIES, family_checkpoint, family_config
from interventions_reference import tl_hooked_bridge, tl_legacy_name

G = torch.Generator().manual_seed(7)
IDS = torch.randint(5, 2048, (2, 13), generator=G)
IDS[:, 0] = 0


class Fam:
    def __init__(self, family, root):
        import transformers as tf

        self.family = family
        self.path = family_checkpoint(family, root)
        self.hf = tf.AutoModelForCausalLM.from_pretrained(
            self.path, attn_implementation="eager").eval()
        self.parts = K.parts(self.hf)
        self._tl = None

    @property
    def tl(self):
        if self._tl is None:
            self._tl = tl_hooked_bridge(self.path)
        return self._tl

    def hf_logits(self, ids=IDS, **kw):
        with torch.inference_mode():
            return self.hf(ids, use_cache=False, **kw)

    def attn(self, layer):
        base = self.hf.gpt_neox if self.family == "gpt_neox" else self.hf.model
        layer = base.layers[layer]
        return layer.attention if self.family == "gpt_neox" else layer.self_attn

    def o_proj(self, layer):
        a = self.attn(layer)
        return a.dense if self.family == "gpt_neox" else a.o_proj


_CACHE: dict = {}


@pytest.fixture(params=FAMILIES)
def fam(request, tmp_path_factory):
    if request.param not in _CACHE:
        _CACHE[request.param] = Fam(request.param, tmp_path_factory.getbasetemp() / "families")
    return _CACHE[request.param]


def _tl_legacy(cache):
    """TL's legacy-named hooks; its rotary tables' broadcast batch of 1 expanded to IDS'."""
    return {k: v.expand(len(IDS), *v.shape[1:]) if k.endswith(("hook_cos", "hook_sin")) else v
            for k, v in cache.items() if tl_legacy_name(k)}


def _bound(t: torch.Tensor) -> float:
    fin = t[torch.isfinite(t)]
    return 1e-5 + 1e-6 * float(fin.abs().max())


def _diff(a, b) -> float:
    a, b = a.detach(), b.detach()
    ia, ib = torch.isinf(a), torch.isinf(b)
    assert torch.equal(ia, ib)
    return float((a[~ia] - b[~ib]).abs().max()) if (~ia).any() else 0.0


# ------------------------------------------------------------------ Hugging Face, bit for bit

def test_logits_and_hidden_states_equal_hugging_face_bit_for_bit(fam):
    ref = fam.hf_logits(output_hidden_states=True)
    L = fam.parts.n_layers
    res = K.run(fam.parts, IDS, cache={"hook_embed": None, "blocks.*.hook_resid_post": None})
    assert torch.equal(res.logits, ref.logits)
    assert torch.equal(res.cache["hook_embed"], ref.hidden_states[0])
    for layer in range(L - 1):  # the last hidden state is after the final norm
        assert torch.equal(res.cache[f"blocks.{layer}.hook_resid_post"],
                           ref.hidden_states[layer + 1]), layer
    # a forward from a later layer (what patching grids do) is the same forward
    later = K.run(fam.parts, IDS, start=1, resid_pre=ref.hidden_states[1])
    assert torch.equal(later.logits, ref.logits)
    # caching every hook changes nothing downstream
    assert torch.equal(K.run(fam.parts, IDS, cache={"*": None}).logits, ref.logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_hf_bit_for_bit_too(fam, dtype):
    """In bfloat16 / float16 the logits equal HF's eager forward bit for bit as well; the
    RMSNorm hooks come back float32 (as HF and TL compute them), the others in the dtype."""
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(fam.path, attn_implementation="eager",
                                                 dtype=dtype).eval()
    with torch.inference_mode():
        ref = hf(IDS, use_cache=False).logits
    res = K.run(hf, IDS, cache={"blocks.0.ln1.hook_scale": None, "blocks.0.attn.hook_z": None})
    assert torch.equal(res.logits, ref)
    assert res.cache["blocks.0.attn.hook_z"].dtype == dtype
    norm_dt = dtype if fam.family == "gpt_neox" else torch.float32
    assert res.cache["blocks.0.ln1.hook_scale"].dtype == norm_dt


def test_hf_patterns_equal_hook_pattern(fam):
    ref = fam.hf_logits(output_attentions=True)
    res = K.run(fam.parts, IDS, cache={"blocks.*.attn.hook_pattern": None})
    for layer, a in enumerate(ref.attentions):
        assert torch.equal(res.cache[f"blocks.{layer}.attn.hook_pattern"], a), layer
    win = [b.window for b in fam.parts.blocks]
    if fam.family == "mistral":
        assert win == [8, 8]
    elif fam.family == "gemma2":
        assert win == [8, None]  # layer_types: sliding, full
    else:
        assert win == [None, None]
    for layer, w in enumerate(win):  # keys older than the window get exactly 0
        p = res.cache[f"blocks.{layer}.attn.hook_pattern"]
        q = torch.arange(13)
        outside = (q[None, :] > q[:, None]) if w is None else \
            (q[None, :] > q[:, None]) | (q[None, :] <= q[:, None] - w)
        assert (p[..., outside] == 0).all() and (p[..., ~outside] > 0).all()


@pytest.mark.parametrize("fault", ["theta", "kv_mapping", "window", "softcap"])
def test_planted_faults_break_the_hf_equality(fam, fault):
    """Each planted fault moves the logits away from HF's (so the bit-for-bit equality above
    checks the switch); a fault a family does not have is skipped."""
    p = fam.parts
    if fault == "theta":  # RoPE with theta * 1.1
        rd = p.rotary_dim
        theta = fam.hf.config.rope_parameters["rope_theta"] * 1.1
        bad = replace(p, inv_freq=1.0 / (theta ** (torch.arange(0, rd, 2).float() / rd)))
    elif fault == "kv_mapping":  # query head h reads the other group's kv head
        if p.n_kv_heads == p.n_heads:
            pytest.skip("no grouped-query attention")
        dh = p.d_head

        def swap(w):
            return None if w is None else torch.cat([w[dh:2 * dh], w[:dh], w[2 * dh:]])
        bad = replace(p, blocks=tuple(replace(b, k_w=swap(b.k_w), k_b=swap(b.k_b),
                                              v_w=swap(b.v_w), v_b=swap(b.v_b))
                                      for b in p.blocks))
    elif fault == "window":
        if all(b.window is None for b in p.blocks):
            pytest.skip("no sliding window")
        bad = replace(p, blocks=tuple(b if b.window is None else replace(b, window=b.window + 1)
                                      for b in p.blocks))
    else:
        if p.attn_softcap is None:
            pytest.skip("no soft-cap")
        bad = replace(p, attn_softcap=None)
    ref = fam.hf_logits().logits
    assert torch.equal(K.run(p, IDS).logits, ref)
    assert float((K.run(bad, IDS).logits - ref).abs().max()) > 1e-4


def test_final_softcap_is_applied(fam):
    if fam.parts.final_softcap is None:
        pytest.skip("no final soft-cap")
    ref = fam.hf_logits().logits
    uncapped = K.run(replace(fam.parts, final_softcap=None), IDS).logits
    assert float((uncapped - ref).abs().max()) > 1e-4
    assert float(ref.abs().max()) < fam.parts.final_softcap


def _o_hook(fam, layer, fn):
    H, dh = fam.parts.n_heads, fam.parts.d_head

    def pre(module, args):
        x = args[0]
        z = fn(x.view(*x.shape[:-1], H, dh).clone())
        return (z.reshape(x.shape),)
    return fam.o_proj(layer).register_forward_pre_hook(pre)


def test_head_ablation_and_patching_equal_hf_hook_loops(fam):
    """Zero one head's z (an HF pre-hook on o_proj / dense zeroing its slice) and patch one
    head from prompt 0 into prompt 1: the same logits bit for bit."""
    for layer, head in [(0, 1), (1, 3)]:
        h = _o_hook(fam, layer, lambda z: z.index_fill(2, torch.tensor([head]), 0.0))
        try:
            ref = fam.hf_logits().logits
        finally:
            h.remove()
        ours = K.run(fam.parts, IDS, interventions=[
            K.Zero(hook=f"blocks.{layer}.attn.hook_z", heads=[head])]).logits
        assert torch.equal(ours, ref), (layer, head)

        def patch(z):
            z[1, :, head] = z[0, :, head]
            return z
        h = _o_hook(fam, layer, patch)
        try:
            ref = fam.hf_logits().logits
        finally:
            h.remove()
        ours = K.run(fam.parts, IDS, interventions=[
            K.Set(hook=f"blocks.{layer}.attn.hook_z", heads=[head], source_prompt=0,
                  prompts=[1])]).logits
        assert torch.equal(ours, ref), (layer, head)


def test_kv_head_edit_reaches_its_query_heads_only(fam):
    """hook_k / hook_v carry the key/value heads: zeroing kv head j (an HF forward hook on
    k_proj's output) equals Zero on attn.hook_k heads=[j], and changes the patterns of query
    heads j*g .. j*g+g-1 only."""
    p = fam.parts
    if p.n_kv_heads == p.n_heads:
        pytest.skip("no grouped-query attention")
    g, dh, j = p.kv_group, p.d_head, 1
    assert [hp.sizes[2] for hp in K.hook_points(p) if hp.name.startswith("blocks.0.")
            and hp.site in ("k", "v", "k_input", "v_input", "rot_k")] == [p.n_kv_heads] * 5

    def out(module, args, y):
        y = y.clone()
        y[..., j * dh:(j + 1) * dh] = 0.0
        return y
    h = fam.attn(0).k_proj.register_forward_hook(out)
    try:
        ref = fam.hf_logits(output_attentions=True)
    finally:
        h.remove()
    clean = K.run(p, IDS, cache={"blocks.0.attn.hook_pattern": None})
    ours = K.run(p, IDS, interventions=[K.Zero(hook="blocks.0.attn.hook_k", heads=[j])],
                 cache={"blocks.0.attn.hook_pattern": None})
    assert torch.equal(ours.logits, ref.logits)
    pat, pat0 = ours.cache["blocks.0.attn.hook_pattern"], clean.cache["blocks.0.attn.hook_pattern"]
    assert torch.equal(pat, ref.attentions[0])
    for q in range(p.n_heads):
        same = torch.equal(pat[:, q], pat0[:, q])
        assert same == (q // g != j), q


def test_gradient_equals_hf_autograd(fam):
    """d logit_diff / d hook_z (the total derivative) equals autograd through HF's own
    forward, the z watched at o_proj's input."""
    p = fam.parts
    T = IDS.shape[1]
    metric = K.LogitDiff(terms=[(0, T - 1, 11, 12), (1, 5, 40, 7)])
    res = K.run(p, IDS, grad=K.GradRequest(metric=metric, hooks=["blocks.*.attn.hook_z"]))
    watched = []

    def fn(z):  # in the graph (not a detached leaf): the total derivative, as ours
        watched.append(z)
        return z
    hs = [_o_hook(fam, layer, fn) for layer in range(p.n_layers)]
    try:
        with torch.enable_grad():
            lg = fam.hf(IDS, use_cache=False).logits
            ld = ((lg[0, T - 1, 11] - lg[0, T - 1, 12]) + (lg[1, 5, 40] - lg[1, 5, 7])) / 2
            gs = torch.autograd.grad(ld, watched)
    finally:
        for h in hs:
            h.remove()
    torch.testing.assert_close(res.grad_value, ld.detach(), rtol=1e-6, atol=1e-6)
    for layer, g in enumerate(gs):
        torch.testing.assert_close(res.grads[f"blocks.{layer}.attn.hook_z"], g,
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hook,head,d", [
    ("blocks.0.hook_resid_pre", None, 5), ("blocks.0.ln1.hook_scale", None, 0),
    ("blocks.0.attn.hook_k", 1, 3), ("blocks.1.hook_k_input", 1, 7),
    ("blocks.0.attn.hook_rot_q", 2, 1), ("blocks.0.hook_attn_out", None, 9),
    ("blocks.1.mlp.hook_post", None, 11), ("ln_final.hook_normalized", None, 2)])
def test_gradient_by_finite_difference_float64(fam, hook, head, d):
    """d logprob / d hook at one entry against a central difference of the forward with an
    Add there, on a float64 copy: norms (RMS and LayerNorm), kv-head hooks, rotary, MLP.
    Hugging Face's RMSNorm computes in float32 even for a float64 model (``x.to(float32)``;
    we do the same, bit for bit), so the difference is taken at h = 1e-3 and 2e-3 (Richardson) and compared to
    1e-3 (the metric's float32 rounding / eps; the analytic gradient itself equals HF
    autograd exactly, test_gradient_equals_hf_autograd)."""
    import transformers as tf

    key = ("f64", fam.family)
    if key not in _CACHE:
        hf = tf.AutoModelForCausalLM.from_pretrained(fam.path, attn_implementation="eager")
        _CACHE[key] = K.parts(hf.double().eval())
    p = _CACHE[key]
    try:
        (hp,) = K.resolve(p, hook)
    except Exception:
        pytest.skip(f"{fam.family} has no {hook}")
    ids = IDS[:1]
    metric = K.LogProb(terms=[(0, 9, 300)])
    g = K.run(p, ids, grad=K.GradRequest(metric=metric, hooks=[hook])).grads[hook]
    pos = 4
    e = torch.zeros(hp.sizes[-1], dtype=torch.float64)
    e[d] = 1.0

    def f(step):
        return float(K.run(p, ids, metrics={"m": metric}, interventions=[
            K.Add(hook=hook, vector=e, scale=step, positions=[pos],
                  heads=None if head is None else [head])]).metrics["m"].value)

    def central(h):
        return (f(h) - f(-h)) / (2 * h)
    fd = (4 * central(1e-3) - central(2e-3)) / 3  # Richardson: the h^2 term cancels
    got = float(g[0, pos, head, d] if head is not None else g[0, pos, d])
    assert abs(fd - got) <= 1e-3 * (1 + abs(fd)), (fd, got)
    assert abs(got) > 1e-2 or abs(fd) < 1e-2, (fd, got)


def test_metrics_equal_hf_logits(fam):
    lg = fam.hf_logits().logits
    res = K.run(fam.parts, IDS, metrics={
        "ld": K.LogitDiff(terms=[(None, 4, 9, 10)]), "lp": K.LogProb(terms=[(1, 2, 33)]),
        "loss": K.Loss(terms=[(0, 3)]), "kl": K.KL(terms=[(0, 1, 6)])}, logit_positions=[-1])
    lp = torch.log_softmax(lg, -1)
    torch.testing.assert_close(res.metrics["ld"].values, lg[:, 4, 9] - lg[:, 4, 10], rtol=0,
                               atol=1e-6)
    torch.testing.assert_close(res.metrics["lp"].value, lp[1, 2, 33], rtol=0, atol=1e-6)
    torch.testing.assert_close(res.metrics["loss"].value, -lp[0, 3, IDS[0, 4]], rtol=0,
                               atol=1e-6)
    kl = (lp[0, 6].exp() * (lp[0, 6] - lp[1, 6])).sum()
    torch.testing.assert_close(res.metrics["kl"].value, kl, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ TransformerLens 4.3

def test_every_hook_equals_transformerlens_by_name_shape_and_value(fam):
    with torch.no_grad():
        tl_logits, cache = fam.tl.run_with_cache(IDS)
    tl = _tl_legacy(cache)
    ours = K.run(fam.parts, IDS, cache={"*": None})
    assert set(ours.cache) == set(tl), set(ours.cache) ^ set(tl)
    assert [h.name for h in K.hook_points(fam.parts)] == list(ours.cache)  # forward order
    worst = {}
    for n, t in tl.items():
        assert tuple(ours.cache[n].shape) == tuple(t.shape), n
        worst[n] = _diff(ours.cache[n], t) / _bound(t)
    assert max(worst.values()) <= 1.0, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert _diff(ours.logits, tl_logits) <= _bound(tl_logits)
    names = set(tl)
    assert ("blocks.0.attn.hook_rot_q" in names) == (fam.family != "gpt_neox")
    assert ("blocks.0.hook_resid_mid" in names) == (fam.family != "gpt_neox")
    assert ("blocks.0.ln1_post.hook_scale" in names) == (fam.family == "gemma2")
    assert "hook_pos_embed" not in names
    assert tuple(cache["rotary_emb.hook_cos"].shape) == (1, IDS.shape[1], fam.parts.rotary_dim)
    assert {"rotary_emb.hook_sin", "blocks.1.attn.hook_cos"} <= names


def test_a_wrong_name_map_fails_the_transformerlens_comparison(fam):
    """Planted fault: the catalogue serving hook_k's values under hook_v's name (and back)
    is caught by the value comparison with TL's cache."""
    names = dict(fam.parts.names, k="attn.hook_v", v="attn.hook_k")
    bad = K.with_names(fam.parts, names)
    with torch.no_grad():
        _, cache = fam.tl.run_with_cache(IDS)
    tl = _tl_legacy(cache)
    ours = K.run(bad, IDS, cache={"blocks.0.attn.hook_v": None}).cache["blocks.0.attn.hook_v"]
    assert _diff(ours, tl["blocks.0.attn.hook_v"]) > 10 * _bound(tl["blocks.0.attn.hook_v"])


def _tl_edits(fam):
    """(our interventions, TL hook list) pairs of the same edit."""
    p = fam.parts
    kvh = p.n_kv_heads - 1
    vec = torch.linspace(-1, 1, p.d_model)

    def zero_head(h):
        def fn(t, hook):
            t = t.clone()
            t[:, :, h] = 0.0
            return t
        return fn

    def set_head(h):
        def fn(t, hook):
            t = t.clone()
            t[1, :, h] = t[0, :, h]
            return t
        return fn

    out = [
        ([K.Zero(hook="blocks.1.hook_k_input", heads=[kvh])],
         [("blocks.1.hook_k_input", zero_head(kvh))]),
        ([K.Set(hook="blocks.0.attn.hook_v", heads=[0], source_prompt=0, prompts=[1])],
         [("blocks.0.attn.hook_v", set_head(0))]),
        ([K.Scale(hook="blocks.0.mlp.hook_pre", factor=0.5)],
         [("blocks.0.mlp.hook_pre", lambda t, hook: t * 0.5)]),
        ([K.Add(hook="blocks.1.hook_resid_pre", vector=vec, scale=2.0)],
         [("blocks.1.hook_resid_pre", lambda t, hook: t + 2.0 * vec)]),
        ([K.Mean(hook="blocks.0.hook_attn_out", over="batch")],
         [("blocks.0.hook_attn_out", lambda t, hook: t.mean(0, keepdim=True).expand_as(t))]),
        ([K.Zero(hook="blocks.1.attn.hook_result", heads=[2])],
         [("blocks.1.attn.hook_result", zero_head(2))]),
        ([K.Scale(hook="blocks.0.ln2.hook_scale", factor=2.0)],  # TL rebuilds normalized * w
         [("blocks.0.ln2.hook_scale", lambda t, hook: t * 2.0)]),
        ([K.Add(hook="ln_final.hook_normalized", vector=vec)],
         [("ln_final.hook_normalized", lambda t, hook: t + vec)]),
        ([K.Set(hook="blocks.1.hook_q_input", heads=[3], source_prompt=0, prompts=[1])],
         [("blocks.1.hook_q_input", set_head(3))]),
        # the rotary tables: every layer's (rotary_emb), one layer's (attn)
        ([K.Scale(hook="rotary_emb.hook_sin", factor=0.0)],
         [("rotary_emb.hook_sin", lambda t, hook: t * 0.0)]),
        ([K.Scale(hook="blocks.1.attn.hook_cos", factor=0.5)],
         [("blocks.1.attn.hook_cos", lambda t, hook: t * 0.5)]),
    ]
    if fam.family != "gpt_neox":
        out.append(([K.Scale(hook="blocks.0.attn.hook_rot_k", factor=0.0, heads=[0])],
                    [("blocks.0.attn.hook_rot_k", zero_head(0))]))
        out.append(([K.Scale(hook="blocks.1.mlp.hook_pre_linear", factor=-1.0)],
                    [("blocks.1.mlp.hook_pre_linear", lambda t, hook: -t)]))
    return out


def test_interventions_equal_transformerlens_run_with_hooks(fam):
    with torch.no_grad():
        clean = fam.tl(IDS)
    for ivs, hooks in _tl_edits(fam):
        with torch.no_grad():
            ref = fam.tl.run_with_hooks(IDS, fwd_hooks=hooks)
        ours = K.run(fam.parts, IDS, interventions=ivs).logits
        assert float((ref - clean).abs().max()) > 1e-4, ivs  # the edit does something
        assert _diff(ours, ref) <= 2 * _bound(ref), (ivs, _diff(ours, ref))


# ------------------------------------------------------------------ configs refused

def _model_with(family, tmp_path, **overrides):
    """A random ``family`` model with config ``overrides`` (dict values, which
    family_checkpoint's directory name cannot hash), saved and loaded back eager."""
    import transformers as tf

    torch.manual_seed(0)
    m = tf.AutoModelForCausalLM.from_config(family_config(family, **overrides),
                                            attn_implementation="eager")
    m.save_pretrained(tmp_path / family, safe_serialization=True)
    return tf.AutoModelForCausalLM.from_pretrained(tmp_path / family,
                                                   attn_implementation="eager").eval()


@pytest.mark.parametrize("family,overrides,words", [
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                    "rope_theta": 10000.0}), "rope_type='dynamic'"),
])
def test_a_switch_not_implemented_is_unsupported_model_config(tmp_path, family, overrides,
                                                              words):
    hf = _model_with(family, tmp_path, **overrides)
    with pytest.raises(UnsupportedModelConfig) as e:
        K.parts(hf)
    assert words in str(e.value)


def test_llama3_rope_scaling_is_hf_exact(tmp_path):
    """A static rope scaling (llama3) reads HF's own inv_freq: bit for bit."""
    hf = _model_with("llama", tmp_path, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8})
    with torch.inference_mode():
        ref = hf(IDS, use_cache=False).logits
    assert torch.equal(K.run(hf, IDS).logits, ref)


def test_parts_of_every_family(fam):
    """gpt2_parts (the callers' entry point) and parts give the family's parts; the GPT-2-only
    attributes (learned positions; the fused W_QKV of /v1/circuits) are a named 422."""
    assert isinstance(K.gpt2_parts(fam.hf), HF.FamilyParts)
    assert isinstance(K.parts(fam.hf), HF.FamilyParts)
    assert torch.equal(K.embedding(fam.parts, IDS), fam.hf.get_input_embeddings()(IDS))
    with pytest.raises(UnsupportedModelConfig, match="attn_w"):
        fam.parts.blocks[0].attn_w
    with pytest.raises(UnsupportedModelConfig, match="rotary"):
        fam.parts.wpe


# ------------------------------------------------------------------ through the app

_RT: dict = {}


@pytest.fixture
def served(fam, make_client):
    """(client, runtime) of the real app in-process on the family's checkpoint."""
    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime

    if fam.family not in _RT:
        _RT[fam.family] = Runtime.load(Settings(model=str(fam.path)))
    rt = _RT[fam.family]
    return make_client(rt, model=str(fam.path)), rt


def test_hooks_and_run_through_the_app(fam, served):
    """GET /v1/hooks lists the family's catalogue (kv heads on k/v); POST /v1/run's cache and
    logits equal HF eager and the hooked forward; an intervention over HTTP equals the same
    HF hook loop (head 2 of layer 1 zeroed at o_proj's input)."""
    from attnscope.client import Client

    client, rt = served
    api = Client("http://testserver", http_client=client, max_retries=0)
    hooks = {h.name: h for h in api.hooks().hooks}
    assert list(hooks) == [h.name for h in K.hook_points(fam.parts)]
    ids = IDS.tolist()
    out = api.run(tokens=ids, cache=["blocks.0.attn.hook_k", "blocks.0.attn.hook_pattern",
                                      "blocks.1.hook_resid_pre"],
                  logits={"positions": None, "full": True, "top_k": None})
    ref = fam.hf_logits(output_hidden_states=True, output_attentions=True)
    assert out.cache["blocks.0.attn.hook_k"].shape == (2, 13, fam.parts.n_kv_heads,
                                                        fam.parts.d_head)
    assert np.array_equal(out.cache["blocks.0.attn.hook_pattern"], ref.attentions[0].numpy())
    assert np.array_equal(out.cache["blocks.1.hook_resid_pre"], ref.hidden_states[1].numpy())
    assert np.array_equal(out.logits, ref.logits.numpy())
    r = client.post("/v1/run", json={"token_lists": ids, "interventions": [
        {"kind": "zero", "hook": "blocks.1.attn.hook_z", "heads": [2]}],
        "logits": {"positions": None, "full": True, "top_k": None}})
    assert r.status_code == 200, r.text
    h = _o_hook(fam, 1, lambda z: z.index_fill(2, torch.tensor([2]), 0.0))
    try:
        abl = fam.hf_logits().logits
    finally:
        h.remove()
    got = api.run(tokens=ids, interventions=[{"kind": "zero", "hook": "blocks.1.attn.hook_z",
                                              "heads": [2]}],
                  logits={"positions": None, "full": True, "top_k": None}).logits
    assert np.array_equal(got, abl.numpy())


def test_rotary_hooks_through_the_app_equal_transformerlens(fam, served):
    """TL 4.3's rotary hooks are served: GET /v1/hooks lists rotary_emb.hook_cos / hook_sin
    and blocks.{l}.attn.hook_cos / hook_sin as [batch, pos, d_rotary] (d_rotary = the rotated
    dims: NeoX 0.25 x d_head); /v1/run caches each prompt's row equal to TL's broadcast
    table; an edit through /v1/run equals TL's run_with_hooks. Planted: a catalogue serving
    sin under cos's name is caught by the same comparison."""
    client, rt = served
    hooks = {h["name"]: h for h in client.get("/v1/hooks").json()["hooks"]}
    rd = fam.parts.rotary_dim
    assert rd == (4 if fam.family == "gpt_neox" else 16)
    names = ["rotary_emb.hook_cos", "rotary_emb.hook_sin", "blocks.0.attn.hook_cos",
             "blocks.1.attn.hook_sin"]
    for n in names:
        assert hooks[n]["axes"] == ["batch", "pos", "d_rotary"], hooks[n]
        assert hooks[n]["shape"] == [None, None, rd], hooks[n]
    with torch.no_grad():
        _, cache = fam.tl.run_with_cache(IDS)
    from attnscope.client import Client

    api = Client("http://testserver", http_client=client, max_retries=0)
    out = api.run(tokens=IDS.tolist(), cache=names)
    for n in names:
        got = out.cache[n]
        assert got.shape == (2, 13, rd), (n, got.shape)
        for row in got:  # TL: [1, pos, d_rotary], one table for every prompt
            assert np.array_equal(row, cache[n][0].numpy()), n
    r = client.post("/v1/run", json={"token_lists": IDS.tolist(), "interventions": [
        {"kind": "scale", "hook": "blocks.0.attn.hook_cos", "factor": 0.5}],
        "logits": {"positions": None, "full": True, "top_k": None}})
    assert r.status_code == 200, r.text
    with torch.no_grad():
        ref = fam.tl.run_with_hooks(IDS, fwd_hooks=[("blocks.0.attn.hook_cos",
                                                     lambda t, hook: t * 0.5)])
    from attnscope.client.run import run_output

    got = torch.as_tensor(run_output(r.json()).logits)
    with torch.no_grad():
        assert float((ref - fam.tl(IDS)).abs().max()) > 1e-2  # the edit does something
    assert _diff(got, ref) <= 2 * _bound(ref)
    bad = K.with_names(fam.parts, dict(fam.parts.names, rot_cos="rotary_emb.hook_sin",
                                       rot_sin="rotary_emb.hook_cos"))
    swapped = K.run(bad, IDS, cache={"rotary_emb.hook_cos": None}).cache["rotary_emb.hook_cos"]
    assert _diff(swapped, cache["rotary_emb.hook_cos"].expand_as(swapped)) > 0.1


@pytest.mark.parametrize("path, body, param", [
    ("/v1/run", {"cache": ["blocks.1.hook_resid_mid"]}, "cache.0.hook"),
    ("/v1/run", {"cache": [{"hook": "blocks.*.hook_resid_mid"}]}, "cache.0.hook"),
    ("/v1/run", {"interventions": [{"kind": "zero", "hook": "blocks.0.hook_resid_mid"}]},
     "interventions.0.hook"),
    ("/v1/patch", {"hook": "resid_mid", "metric": {"kind": "loss", "terms": [{"position": 1}]}},
     "hook"),
])
def test_resid_mid_on_the_parallel_residual_is_a_family_named_422(fam, served, path, body,
                                                                   param):
    """GPT-NeoX's parallel residual has no hook_resid_mid: a 422 unsupported_model_config
    naming the family and the reason (it was a validation_error listing close names); the
    other families serve it; a misspelt name still gets the closest names."""
    from conftest import assert_error

    client, rt = served
    ids = IDS[:1, :6].tolist()
    b = dict(body, **({"token_lists": ids} if path == "/v1/run" else
                      {"clean_tokens": ids[0], "corrupted_tokens": IDS[1, :6].tolist()}))
    r = client.post(path, json=b)
    if fam.family != "gpt_neox":
        assert r.status_code == 200, r.text
        return
    e = assert_error(r, 422, type_="unsupported_model_config", param=param)
    assert "gpt_neox has a parallel residual: no blocks." in e["message"], e
    assert "hook_resid_pre" in e["message"], e
    r = client.post("/v1/run", json={"token_lists": ids, "cache": ["blocks.0.hook_resid_mdi"]})
    e = assert_error(r, 422, type_="validation_error", param="cache.0.hook")
    assert "closest: blocks.0.hook_resid_pre" in e["message"], e


def test_ablate_endpoint_equals_an_hf_hook_loop(fam, served):
    """/v1/ablate zeroing heads (1, 0) and (0, 3): its KL and ablated top tokens equal an HF
    forward with those heads' slices of o_proj's (dense's) input zeroed."""
    client, rt = served
    ids = IDS[0].tolist()
    r = client.post("/v1/ablate", json={"tokens": ids, "heads": [[1, 0], [0, 3]], "top_k": 3})
    assert r.status_code == 200, r.text
    b = r.json()
    hs = [_o_hook(fam, 1, lambda z: z.index_fill(2, torch.tensor([0]), 0.0)),
          _o_hook(fam, 0, lambda z: z.index_fill(2, torch.tensor([3]), 0.0))]
    try:
        abl = fam.hf_logits(IDS[:1]).logits[0].double()
    finally:
        for h in hs:
            h.remove()
    clean = fam.hf_logits(IDS[:1]).logits[0].double()
    lc, la = torch.log_softmax(clean, -1), torch.log_softmax(abl, -1)
    kl = (lc.exp() * (lc - la)).sum(-1)
    assert float(kl.max()) > 1e-3  # the ablation matters
    for p in b["positions"]:
        i = p["position"]
        assert p["kl"] == pytest.approx(float(kl[i]), abs=1e-5, rel=2e-6)
        assert [t["id"] for t in p["top_ablated"]] == abl[i].topk(3).indices.tolist()


def test_predictions_endpoint_equals_hf_logits(fam, served):
    client, rt = served
    ids = IDS[1].tolist()
    r = client.post("/v1/predictions", json={"tokens": ids, "top_k": 4})
    assert r.status_code == 200, r.text
    logits = fam.hf_logits(IDS[1:]).logits[0]
    logp = torch.log_softmax(logits.double(), -1)
    for p in r.json()["predictions"]["positions"]:
        i = p["position"]
        top = torch.topk(logits[i], 4)
        assert [t["id"] for t in p["top"]] == top.indices.tolist()
        assert [t["logit"] for t in p["top"]] == pytest.approx(top.values.tolist(), abs=1e-5)
        if i < len(ids) - 1:
            assert p["next_logprob"] == pytest.approx(float(logp[i, ids[i + 1]]), abs=1e-5)


def test_patch_endpoint_equals_hf_hook_loop(fam, served):
    """/v1/patch (metric loss of the clean text's next tokens): every head's raw value equals
    an HF forward of the corrupted text with that head's z (o_proj's / dense's input slice)
    replaced by the clean run's."""
    client, rt = served
    clean, corrupt = IDS[0].tolist(), IDS[1].tolist()
    pos = list(range(6, 12))
    r = client.post("/v1/patch", json={"clean_tokens": clean, "corrupted_tokens": corrupt,
                                       "metric": "loss", "positions": pos})
    assert r.status_code == 200, r.text
    b = r.json()
    tgt = torch.tensor([clean[p + 1] for p in pos])

    def loss(logits):
        lp = torch.log_softmax(logits[0, pos].double(), -1)
        return float(-lp[torch.arange(len(pos)), tgt].mean())
    p = fam.parts
    zs = []
    hs = [_o_hook(fam, layer, lambda z: (zs.append(z), z)[1]) for layer in range(p.n_layers)]
    try:
        c = loss(fam.hf_logits(IDS[:1]).logits)
    finally:
        for h in hs:
            h.remove()
    k = loss(fam.hf_logits(IDS[1:]).logits)
    assert b["clean_value"] == pytest.approx(c, abs=1e-5)
    assert b["corrupted_value"] == pytest.approx(k, abs=1e-5)
    for layer in range(p.n_layers):
        for head in range(p.n_heads):
            def put(z, layer=layer, head=head):
                z[:, :, head] = zs[layer][:, :, head]
                return z
            h = _o_hook(fam, layer, put)
            try:
                v = loss(fam.hf_logits(IDS[1:]).logits)
            finally:
                h.remove()
            assert b["heads_raw"][layer][head] == pytest.approx(v, abs=1e-5), (layer, head)


# /v1/path-patch on the families: tests/test_path_patch_families.py


def test_logit_lens_on_the_families(fam, served):
    """Every family (LayerNorm and RMSNorm, Gemma 2's soft-cap): the lens' final state equals
    the served logits (more in tests/test_lens_families.py)."""
    client, rt = served
    r = client.post("/v1/logit-lens", json={"token_lists": [IDS[0].tolist()], "top_k": 1})
    assert r.status_code == 200, r.text
    final = r.json()["prompts"][0]["states"][-1]  # final_post, ln "own" = ln_final: the logits
    lp = torch.log_softmax(fam.hf_logits(IDS[:1]).logits[0].double(), -1)
    loss = float(-lp[:-1].gather(-1, IDS[0, 1:, None]).mean())
    assert final["loss"] == pytest.approx(loss, abs=1e-5)
    assert [row["top"][0]["id"] for row in final["positions"]] == lp.argmax(-1).tolist()
