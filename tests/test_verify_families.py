"""/v1/verify from scratch on the rotary families (issue 28 item 2): Llama, Mistral, Qwen2,
Gemma, Gemma 2 and GPT-NeoX (Pythia), random small checkpoints from ``tests/families.py``.

1. The float64 recomputation (service/analysis/verify.py, our own formulas) equals Hugging
   Face's own modules run in TRUE float64 to 1e-12 (measured <= 3e-14): patterns, q/k/v (after RoPE, k/v on the
   key/value heads), attention outputs, every hidden state, the final norm and the logits.
   ``model.double()`` alone is not float64: Hugging Face's eager attention takes the softmax
   with ``dtype=torch.float32``, its RMSNorms and rotary embeddings compute in float32 (the
   agreement is then ~1e-6). :class:`Float64Everywhere` (a ``TorchFunctionMode``) turns every
   float32 those modules ask for into float64, and the rotary inverse frequencies are
   recomputed by Hugging Face's own rope init functions under it.
2. Against Hugging Face's float32 forward (what the service serves; also in float16 and
   bfloat16 through the runtime) verify passes within the dtype's tolerances, with honest
   nonzero differences, the served rotary frequencies checked against the config's formula;
   it fails on planted faults, in the served forward and in the recomputation: a wrong rope
   theta, a wrong kv-head mapping, the sliding window off by one, a missing attention /
   final-logit soft-cap (and Gemma's norm and embedding scale, NeoX's residual form).
3. ``POST /v1/verify`` on an app started on each family's checkpoint passes; served faults
   planted in the runtime's model fail; an unimplemented rope type is the 422.
"""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from attnscope.service.analysis.verify import (
    ROPE_TYPES, TOLERANCES, ScratchModel, check_supported, kv_head_map, layer_windows,
    recompute, rope_inv_freq, verify_from_scratch,
)
from attnscope.service.errors import UnsupportedModelConfig

from conftest import SENTENCE
from families import FAMILIES, family_checkpoint, family_config

TEXT = SENTENCE + " And then, later, I tried once more to find it."

#: (family, config overrides): every family, plus the switches each implements
VARIANTS = [(f, {}) for f in FAMILIES] + [
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}}),
    ("llama", {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 1}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    ("gpt_neox", {"use_parallel_residual": False, "rotary_pct": 0.5}),
]


def _vid(v):
    fam, over = v
    if not over:
        return fam
    rp = over.get("rope_parameters")
    return f"{fam}-{rp['rope_type']}" if rp else f"{fam}-" + "-".join(sorted(over))[:24]


class Float64Everywhere(TorchFunctionMode):
    """Every float32 a torch call asks for becomes float64 (``dtype=`` arguments, ``.to(
    torch.float32)``, ``.float()``): Hugging Face's own modules, computing in float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in kwargs.items()}
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """``ckpt(family, overrides)`` -> a saved checkpoint: ``family_checkpoint``'s; with
    overrides holding a dict (rope_parameters, which it cannot name its folder by) the same
    steps: the family's config with the overrides, seed 0, safetensors, the bundled tokenizer."""
    root = tmp_path_factory.mktemp("families")

    def get(fam, over=None):
        over = over or {}
        if not any(isinstance(x, dict) for x in over.values()):
            return family_checkpoint(fam, root, **over)
        import shutil
        import transformers as tf
        from attnscope.service.config import BUNDLED_MODEL_DIR

        path = root / _vid((fam, over))
        if not (path / "model.safetensors").exists():
            torch.manual_seed(0)
            model = tf.AutoModelForCausalLM.from_config(family_config(fam, **over),
                                                        attn_implementation="eager")
            model.eval().save_pretrained(path, safe_serialization=True)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(BUNDLED_MODEL_DIR / name, path / name)
        return path
    return get


def load_hf(path, dtype=torch.float32):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=dtype)
    return model.eval()


def scratch_of(model) -> ScratchModel:
    """What the runtime adapter hands over (``Adapter.scratch_weights``): the base model's
    parameters by name, the LM head's W_U, the config as plain values."""
    W = {n: p.detach() for n, p in model.base_model.named_parameters()}
    W["lm_head.weight"] = model.get_output_embeddings().weight.detach()
    c = model.config
    return ScratchModel(c.model_type, c.to_dict(), W, c.num_hidden_layers, c.num_attention_heads)


def ids_of(text=TEXT):
    from transformers import AutoTokenizer
    from attnscope.service.config import BUNDLED_MODEL_DIR

    return [0] + AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)(text)["input_ids"]


def _modeling(model):
    return sys.modules[type(model).__module__]


def hf_forward(model, ids, monkeypatch):
    """Hugging Face's forward of ``ids`` in the recording's layout (``ServedForward``): the
    patterns (``output_attentions``), q/k/v as its eager attention function receives them
    (after RoPE; k/v on the key/value heads), each output projection's output, the L+1
    residual states (the last before the final norm), the final norm's output, the logits."""
    mod = _modeling(model)
    base = model.base_model
    layers = list(base.layers)
    rec = {"qkv": [], "out": [None] * len(layers), "last": None}
    orig = mod.eager_attention_forward

    def capture(module, query, key, value, *a, **kw):
        rec["qkv"].append((query[0], key[0], value[0]))
        return orig(module, query, key, value, *a, **kw)

    hooks = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None) or layer.attention
        proj = getattr(attn, "o_proj", None) or attn.dense
        hooks.append(proj.register_forward_hook(
            lambda m, a, o, i=i: rec["out"].__setitem__(i, o[0])))
    final_norm = getattr(base, "norm", None) or base.final_layer_norm
    hooks.append(final_norm.register_forward_pre_hook(lambda m, a: rec.__setitem__("last", a[0][0])))
    with monkeypatch.context() as mp:
        mp.setattr(mod, "eager_attention_forward", capture)
        try:
            with torch.no_grad():
                out = model(input_ids=torch.tensor([ids]), output_attentions=True,
                            output_hidden_states=True)
        finally:
            for h in hooks:
                h.remove()
    L = len(layers)
    q, k, v = (torch.stack([t[j] for t in rec["qkv"]]) for j in range(3))
    tensors = SimpleNamespace(
        pattern=torch.stack([a[0] for a in out.attentions]),
        hidden_states=torch.stack([h[0] for h in out.hidden_states[:L]] + [rec["last"]]),
        q=q, k=k, v=v, attn_output=torch.stack(rec["out"]), final_state=out.hidden_states[L][0],
        inv_freq=base.rotary_emb.inv_freq.clone())  # the frequencies it rotated with
    return tensors, out.logits[0]


def hf_float64_forward(path, ids, monkeypatch):
    """Hugging Face's forward in true float64 (module docstring): the model loaded in float64,
    its rotary inverse frequencies recomputed by its own init function, run under
    :class:`Float64Everywhere`."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = load_hf(path, torch.float64)
    emb = model.base_model.rotary_emb
    with Float64Everywhere():
        fn = (emb.compute_default_rope_parameters if emb.rope_type == "default"
              else ROPE_INIT_FUNCTIONS[emb.rope_type])
        emb.inv_freq = fn(emb.config)[0]
        assert emb.inv_freq.dtype == torch.float64
        tensors, logits = hf_forward(model, ids, monkeypatch)
    assert tensors.pattern.dtype == torch.float64 and logits.dtype == torch.float64
    return model, tensors, logits


# ------------------------------------------------------ 1. against Hugging Face in float64
@pytest.mark.parametrize("variant", VARIANTS, ids=_vid)
def test_recompute_equals_hugging_face_in_float64(variant, ckpt, monkeypatch):
    fam, over = variant
    path = ckpt(fam, over)
    ids = ids_of()
    model, hf, logits = hf_float64_forward(path, ids, monkeypatch)
    m = scratch_of(model)
    assert m.family == fam
    rc = recompute(m, ids)
    T = len(ids)
    assert T > 16  # longer than every window below (8, 6)
    torch.testing.assert_close(rc.embeddings, hf.hidden_states[0], atol=1e-12, rtol=0)
    worst = 0.0
    for st in rc.layers:
        i = st.layer
        for name, ours, theirs in (("pattern", st.pattern, hf.pattern[i]),
                                   ("q", st.q_rot, hf.q[i]), ("k", st.k_rot, hf.k[i]),
                                   ("v", st.v, hf.v[i]), ("attention output", st.attn_output, hf.attn_output[i]),
                                   ("hidden state", st.output, hf.hidden_states[i + 1])):
            assert ours.shape == theirs.shape, (name, ours.shape, theirs.shape)
            d = (ours - theirs).abs().max().item()
            worst = max(worst, d)
            assert d <= 1e-12, (i, name, d)
        if st.window is not None:  # the window really cuts: keys w or more back get 0
            assert st.pattern[:, -1, : T - st.window].abs().max() == 0
            assert hf.pattern[i][:, -1, T - st.window].min() > 0
    torch.testing.assert_close(rc.final[0], hf.final_state, atol=1e-12, rtol=0)
    ours = rc.final[0] @ m.weights["lm_head.weight"].double().t()
    if rc.final_logit_softcap:
        ours = rc.final_logit_softcap * torch.tanh(ours / rc.final_logit_softcap)
    torch.testing.assert_close(ours, logits, atol=1e-11, rtol=0)
    # GQA as Hugging Face's repeat_kv: k/v on the key/value heads, query head h -> h // rep
    H_kv = model.config.num_key_value_heads if fam != "gpt_neox" else model.config.num_attention_heads
    assert hf.k.shape[1] == H_kv == len(set(kv_head_map(m)))
    assert kv_head_map(m) == [h // (m.n_heads // H_kv) for h in range(m.n_heads)]


@pytest.mark.parametrize("variant", VARIANTS, ids=_vid)
def test_inverse_frequencies_and_windows_equal_the_models(variant, ckpt):
    """Our float64 RoPE frequencies against the float32 ones the served model computes (its
    own buffer; 1 float32 ulp apart), and the per-layer windows against its mask builder's."""
    fam, over = variant
    model = load_hf(ckpt(fam, over))
    m = scratch_of(model)
    theirs = model.base_model.rotary_emb.inv_freq.double()
    ours = rope_inv_freq(m)
    assert ours.dtype == torch.float64 and ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=2e-7, atol=0)
    kind = (over.get("rope_parameters") or {}).get("rope_type", "default")
    assert model.base_model.rotary_emb.rope_type == kind and kind in ROPE_TYPES
    c = model.config
    if fam == "mistral":  # Hugging Face's mask: the window on every layer
        expect = [c.sliding_window] * c.num_hidden_layers
    elif fam in ("gemma2", "qwen2"):  # per layer type
        expect = [c.sliding_window if t == "sliding_attention" else None for t in c.layer_types]
    else:
        expect = [None] * c.num_hidden_layers
    assert layer_windows(m) == expect
    if over.get("use_sliding_window"):
        assert expect == [None, 6]


# --------------------------------------- 2. against the float32 forward: passes, planted faults
def _verify(hf, logits, m, ids, exact=False, **kw):
    """verify_from_scratch as the endpoint calls it: with the served model's rotary
    frequencies (checked, then its float32 angle rounding); ``exact``: without them (exact
    float64 angles, the frequencies unchecked)."""
    return verify_from_scratch(hf, m, ids, "float32", logits=logits,
                               served_inv_freq=None if exact else hf.inv_freq, **kw)


def _honest(v, m):
    assert v["passed"], v["message"]
    assert v["tolerance"] == TOLERANCES["float32"][0]
    assert 0 < v["max_abs_diff"] <= v["tolerance"] and 0 < v["max_rel_diff"] <= v["state_tolerance"]
    assert v["logits"]["passed"] and v["logits"]["max_abs_diff"] > 0
    assert v["final"]["passed"] and v["failed_layers"] == []
    for row in v["layers"]:
        assert row["passed"] and len(row["heads"]) == m.n_heads
        for key in ("q", "k", "v", "output", "hidden"):
            assert row[f"{key}_max_abs_diff"] > 0, key  # float32 vs float64: never exactly 0


@pytest.fixture(scope="module")
def served(ckpt):
    """Per family: (HF float32 model, its scratch model, ids) - the served side's pieces."""
    cache = {}

    def get(fam, over=None):
        key = (fam, repr(over))
        if key not in cache:
            model = load_hf(ckpt(fam, over))
            cache[key] = (model, scratch_of(model), ids_of())
        return cache[key]
    return get


@pytest.mark.parametrize("variant", VARIANTS, ids=_vid)
def test_verify_passes_against_the_float32_forward(variant, served, monkeypatch):
    model, m, ids = served(*variant)
    hf, logits = hf_forward(model, ids, monkeypatch)
    v = _verify(hf, logits, m, ids)
    _honest(v, m)
    assert v["rotary"]["passed"] and v["rotary"]["max_rel_diff"] < 2e-7
    _honest(_verify(hf, logits, m, ids, exact=True), m)  # exact angles: T = 38 is short
    a = v["architecture"]
    assert a["family"] == variant[0] and a["positions"] == "rotary"
    assert a["kv_head_of_query_head"] == kv_head_map(m) and a["sliding_window_layers"] == layer_windows(m)
    assert [row["window"] for row in v["layers"]] == layer_windows(m)


def _with_config(m, **changes):
    return dataclasses.replace(m, config={**m.config, **changes})


def _theta(m, factor):
    rp = dict(m.config["rope_parameters"])
    rp["rope_theta"] = rp["rope_theta"] * factor
    return _with_config(m, rope_parameters=rp)


@pytest.mark.parametrize("fam", FAMILIES)
def test_wrong_rope_theta_fails(fam, served, monkeypatch):
    """Planted three ways: (a) the recomputation's config with theta x 1.5 (the served
    frequencies then differ from its formula; with exact angles its q differs too); (b) a
    served model whose inv_freq buffer is theta x 1.5's while the config keeps the true one;
    (c) a served rotary embedding that ignores its buffer and rotates with theta x 1.5."""
    model, m, ids = served(fam)
    hf, logits = hf_forward(model, ids, monkeypatch)
    wrong = _theta(m, 1.5)
    for v in (_verify(hf, logits, wrong, ids), _verify(hf, logits, _theta(m, 1 + 1e-5), ids)):
        assert not v["passed"] and v["failing_layer"] == 0 and not v["rotary"]["passed"]
        assert v["message"].startswith("failed: first at layer 0: rotary frequencies")
    v = _verify(hf, logits, wrong, ids, exact=True)
    assert not v["passed"] and v["failing_layer"] == 0 and "q differs" in v["message"]
    assert v["layers"][0]["q_max_abs_diff"] > 1e-3 and v["layers"][0]["v_max_abs_diff"] < 1e-4
    emb = model.base_model.rotary_emb
    true = emb.inv_freq  # (monkeypatch would delete a module buffer on undo)
    emb.inv_freq = rope_inv_freq(wrong).float()
    try:
        bad, bad_logits = hf_forward(model, ids, monkeypatch)
    finally:
        emb.inv_freq = true
    v = _verify(bad, bad_logits, m, ids)
    assert not v["passed"] and v["failing_layer"] == 0 and v["rotary"]["max_rel_diff"] > 1e-2
    assert "rotary frequencies" in v["message"]
    forward = type(emb).forward

    def rotates_with_wrong_theta(self, x, position_ids):
        self.inv_freq, keep = rope_inv_freq(wrong).float(), self.inv_freq
        try:
            return forward(self, x, position_ids)
        finally:
            self.inv_freq = keep
    with monkeypatch.context() as mp:
        mp.setattr(emb, "forward", rotates_with_wrong_theta.__get__(emb))
        bad, bad_logits = hf_forward(model, ids, monkeypatch)
    assert torch.equal(bad.inv_freq, true)  # the buffer says theta
    v = _verify(bad, bad_logits, m, ids)
    assert not v["passed"] and v["failing_layer"] == 0 and v["rotary"]["passed"]
    assert "q differs" in v["message"] and not v["logits"]["passed"]


def _tiled(m):  # the wrong grouping: query head h -> kv head h % n_kv (tiled, not blocks)
    n_kv = len(set(kv_head_map(m)))
    return [h % n_kv for h in range(m.n_heads)]


@pytest.mark.parametrize("fam", [f for f in FAMILIES if f != "gpt_neox"])  # NeoX: no GQA
def test_wrong_kv_head_mapping_fails(fam, served, monkeypatch):
    """Planted both ways: the recomputation reading kv head h % n_kv instead of h // rep, and a
    served forward whose repeat_kv tiles the kv heads (torch ``repeat`` instead of
    ``repeat_interleave``). q, k and v themselves agree; the pattern of the moved heads fails."""
    model, m, ids = served(fam)
    assert kv_head_map(m) == [0, 0, 1, 1] and _tiled(m) == [0, 1, 0, 1]
    hf, logits = hf_forward(model, ids, monkeypatch)
    v = _verify(hf, logits, m, ids, kv_map=_tiled(m))
    row = v["layers"][0]
    assert not v["passed"] and v["failing_layer"] == 0
    bad = [h["head"] for h in row["heads"] if h["pattern_max_abs_diff"] > v["tolerance"]]
    assert bad == [1, 2]  # heads 0 and 3 read the same kv head either way
    assert max(row[f"{x}_max_abs_diff"] for x in "qkv") < 1e-4

    def tiled_repeat_kv(x, n_rep):
        return x if n_rep == 1 else x.repeat(1, n_rep, 1, 1)
    with monkeypatch.context() as mp:
        mp.setattr(_modeling(model), "repeat_kv", tiled_repeat_kv)
        bad_fw, bad_logits = hf_forward(model, ids, monkeypatch)
    v = _verify(bad_fw, bad_logits, m, ids)
    assert not v["passed"] and v["failing_layer"] == 0
    assert "layer 0: pattern of head 1" in v["message"]


WINDOWED = [("mistral", None), ("gemma2", None),
            ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1})]


@pytest.mark.parametrize("fam,over", WINDOWED, ids=[f for f, _ in WINDOWED])
@pytest.mark.parametrize("delta", [1, -1])
def test_window_off_by_one_fails(fam, over, delta, served, monkeypatch):
    """Planted both ways: the recomputation with sliding_window +- 1, and a served forward
    whose mask is built with sliding_window +- 1 (the config the recomputation reads keeps
    the true window). Only the windowed layers fail."""
    model, m, ids = served(fam, over)
    wins = layer_windows(m)
    first = next(i for i, w in enumerate(wins) if w is not None)
    w = wins[first]
    v = _verify(*hf_forward(model, ids, monkeypatch), _with_config(m, sliding_window=w + delta), ids)
    assert not v["passed"] and v["failing_layer"] == first
    assert "pattern" in v["message"] and v["layers"][first]["window"] == w + delta
    with monkeypatch.context() as mp:
        mp.setattr(model.config, "sliding_window", w + delta)
        bad = hf_forward(model, ids, monkeypatch)
    v = _verify(*bad, m, ids)
    assert not v["passed"] and v["failing_layer"] == first
    assert v["layers"][first]["window"] == w
    assert all(row["passed"] for row in v["layers"][:first])  # Qwen2: layer 0 is full


def test_missing_attention_soft_cap_fails(served, monkeypatch):
    """Gemma 2, planted both ways: the recomputation without attn_logit_softcapping, and a
    served forward whose attention modules skip it."""
    model, m, ids = served("gemma2")
    hf, logits = hf_forward(model, ids, monkeypatch)
    assert _verify(hf, logits, m, ids)["layers"][0]["softcap"] == 50.0
    v = _verify(hf, logits, _with_config(m, attn_logit_softcapping=None), ids)
    assert not v["passed"] and v["failing_layer"] == 0 and "pattern" in v["message"]
    assert v["layers"][0]["softcap"] is None
    with monkeypatch.context() as mp:
        for layer in model.base_model.layers:
            mp.setattr(layer.self_attn, "attn_logit_softcapping", None)
        bad = hf_forward(model, ids, monkeypatch)
    v = _verify(*bad, m, ids)
    assert not v["passed"] and v["failing_layer"] == 0 and "pattern" in v["message"]


def test_missing_final_logit_soft_cap_fails(served, monkeypatch):
    """Gemma 2's final_logit_softcapping: the recomputation without it, and served logits
    without it; every layer still passes, the LM head check fails."""
    model, m, ids = served("gemma2")
    hf, logits = hf_forward(model, ids, monkeypatch)
    v = _verify(hf, logits, _with_config(m, final_logit_softcapping=None), ids)
    assert not v["passed"] and not v["logits"]["passed"] and v["failing_layer"] is None
    assert all(row["passed"] for row in v["layers"]) and "LM head" in v["message"]
    assert v["architecture"]["final_logit_softcap"] is None
    with monkeypatch.context() as mp:
        mp.setattr(model.config, "final_logit_softcapping", None)
        hf2, uncapped = hf_forward(model, ids, monkeypatch)
    assert (uncapped - logits).abs().max() > 1e-3
    v = _verify(hf, uncapped, m, ids)
    assert not v["passed"] and not v["logits"]["passed"] and v["failing_layer"] is None


def test_gemma_norm_and_embedding_scale_are_checked(served, monkeypatch):
    """Gemma = Llama with RMSNorm * (1 + w) and embeddings * sqrt(d_model): read as Llama on
    weights rewritten so (norm weights 1 + w, embedding rows * 8) it passes; with either
    rewrite left out it fails (the embeddings at once; the norms at layer 0's q)."""
    model, m, ids = served("gemma")
    hf, logits = hf_forward(model, ids, monkeypatch)
    assert _verify(hf, logits, m, ids)["passed"]
    d = m.config["hidden_size"] ** 0.5
    norms = {n: 1 + w for n, w in m.weights.items() if n.endswith("norm.weight")}
    emb = {"embed_tokens.weight": m.weights["embed_tokens.weight"] * d}
    assert len(norms) == 2 * m.n_layers + 1

    def as_llama(**weights):
        return dataclasses.replace(m, config={**m.config, "model_type": "llama"},
                                   weights={**m.weights, **weights})
    v = _verify(hf, logits, as_llama(**norms, **emb), ids)
    assert v["passed"], v["message"]
    assert v["architecture"]["norm"] == "rmsnorm" and v["architecture"]["embed_scale"] is None
    v = _verify(hf, logits, as_llama(**norms), ids)
    assert not v["passed"] and v["failing_layer"] == 0 and "embeddings" in v["message"]
    v = _verify(hf, logits, as_llama(**emb), ids)
    assert not v["passed"] and v["failing_layer"] == 0 and v["embeddings"]["passed"]
    assert "q differs" in v["message"]


def test_neox_parallel_residual_is_checked(served, monkeypatch):
    model, m, ids = served("gpt_neox")
    hf, logits = hf_forward(model, ids, monkeypatch)
    v = _verify(hf, logits, _with_config(m, use_parallel_residual=False), ids)
    assert not v["passed"] and v["failing_layer"] == 0 and "hidden state" in v["message"]
    assert v["layers"][0]["pattern_max_abs_diff"] <= v["tolerance"]  # attention itself agrees
    r = dict(m.config["rope_parameters"], partial_rotary_factor=0.5)  # rotary_pct 0.5, not 0.25
    v = _verify(hf, logits, _with_config(m, rope_parameters=r), ids)
    assert not v["passed"] and v["failing_layer"] == 0 and v["rotary"]["max_rel_diff"] is None
    assert "rotary frequencies" in v["message"] and v["layers"][0]["q_max_abs_diff"] > 1e-3


def test_served_tensors_of_another_shape_fail(served, monkeypatch):
    """k recorded per query head instead of per kv head is compared per query head; a k with
    the wrong number of heads is a NaN difference (never a pass)."""
    model, m, ids = served("llama")
    hf, logits = hf_forward(model, ids, monkeypatch)
    rep = torch.tensor(kv_head_map(m))
    per_query = SimpleNamespace(**{**vars(hf), "k": hf.k[:, rep], "v": hf.v[:, rep]})
    assert _verify(per_query, logits, m, ids)["passed"]
    wrong = SimpleNamespace(**{**vars(hf), "k": hf.k[:, :1]})
    v = _verify(wrong, logits, m, ids)
    assert not v["passed"] and v["layers"][0]["k_max_abs_diff"] is None and "NaN" in v["message"]


@pytest.mark.slow
def test_long_text_passes_with_the_served_angle_rounding(monkeypatch):
    """T = 4096 on a one-layer float32 Llama: Hugging Face's rotary angles pos * f are float32
    (error ~pos * 2^-24 rad), so against EXACT float64 angles the honest forward fails the
    float32 tolerance (measured: states 1.2e-4 relative, logits 1.1e-3); with the served
    frequencies checked and the angle rounded as the forward does, it passes (2.7e-6).
    ~20 s and 2.4 GB on 2 CPU cores."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(
        family_config("llama", max_position_embeddings=4096, num_hidden_layers=1),
        attn_implementation="eager").eval()
    m = scratch_of(model)
    ids = torch.randint(1, 2048, (4096,), generator=torch.Generator().manual_seed(1)).tolist()
    hf, logits = hf_forward(model, ids, monkeypatch)
    exact = _verify(hf, logits, m, ids, exact=True)
    assert not exact["passed"] and exact["max_rel_diff"] > exact["state_tolerance"]
    v = _verify(hf, logits, m, ids)
    assert v["passed"], v["message"]
    assert v["max_rel_diff"] < exact["max_rel_diff"] / 10


# ------------------------------------------------------------------ unimplemented switches
@pytest.mark.parametrize("key,value,fam", [
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, "llama"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "qwen2"),
    ("rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}, "gemma2"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, "llama"),
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 1e4}, "mistral"),
    ("hidden_act", "mish", "llama"),
    ("hidden_activation", "mish", "gemma2"),
    ("layer_types", ["chunked_attention", "full_attention"], "qwen2"),
    ("use_bidirectional_attention", True, "gemma"),
    ("num_key_value_heads", 3, "llama"),
    ("model_type", "falcon", None),
])
def test_unimplemented_switch_is_refused_naming_it(key, value, fam, served):
    """A config switch the recomputation does not implement: UnsupportedModelConfig (the 422)
    naming the key, never a pass."""
    model, m, ids = served(fam or "llama")
    bad = _with_config(m, **{key: value})
    if fam is None:
        bad = dataclasses.replace(bad, family="falcon")
    expect = {"rope_parameters": r"rope_parameters"}.get(key, key)
    with pytest.raises(UnsupportedModelConfig, match=expect) as e:
        check_supported(bad)
    assert e.value.args and "mode 'recorded_qkv'" in str(e.value)
    with pytest.raises(UnsupportedModelConfig):
        recompute(bad, ids)
    check_supported(m)


# ------------------------------------------------------ 3. POST /v1/verify on each family's app
def _ready(c, bound=300):  # a safety net against a hang, not a figure
    import time

    deadline = time.monotonic() + bound
    while c.get("/readyz").status_code != 200:
        assert time.monotonic() < deadline, "the model never became ready"
        time.sleep(0.05)


@pytest.mark.parametrize("fam", FAMILIES)
def test_verify_endpoint_passes_on_each_family(fam, ckpt):
    """The app started on the family's checkpoint (it loads the model itself): from_scratch
    passes with honest nonzero differences, the served logits (the hooked forward's)
    included; the architecture it reports is the config's; recorded_qkv answers too."""
    from fastapi.testclient import TestClient

    from attnscope.schemas import VerifyResponse
    from attnscope.service.app import create_app
    from attnscope.service.config import Settings

    path = ckpt(fam)
    model = load_hf(path)
    m = scratch_of(model)
    with TestClient(create_app(Settings(model=str(path))), raise_server_exceptions=False) as c:
        _ready(c)
        r = c.post("/v1/verify", json={"text": TEXT})
        assert r.status_code == 200, r.text
        VerifyResponse.model_validate(r.json())
        v = r.json()["verification"]
        assert v["add_bos"] is True and v["tokens"][0]["special"]
        assert [t["id"] for t in v["tokens"]] == ids_of()
        _honest(v, m)
        assert v["rotary"]["passed"] and v["rotary"]["tolerance"] == 1e-6
        assert v["mode"] == "from_scratch" and v["mask"] == "causal" and v["dtype"] == "float32"
        a = v["architecture"]
        c_ = model.config
        assert a["family"] == fam and a["positions"] == "rotary"
        assert a["rope_theta"] == c_.rope_parameters["rope_theta"]
        assert a["rotary_dim"] == (4 if fam == "gpt_neox" else 16)  # NeoX rotary_pct 0.25
        assert a["n_kv_heads"] == (4 if fam == "gpt_neox" else 2)
        assert a["kv_head_of_query_head"] == ([0, 1, 2, 3] if fam == "gpt_neox" else [0, 0, 1, 1])
        assert a["norm"] == {"gemma": "rmsnorm_1p", "gemma2": "rmsnorm_1p",
                             "gpt_neox": "layernorm"}.get(fam, "rmsnorm")
        assert a["parallel_residual"] is (fam == "gpt_neox")
        assert a["embed_scale"] == (8.0 if fam in ("gemma", "gemma2") else None)
        assert a["sliding_window_layers"] == {"mistral": [8, 8], "gemma2": [8, None]}.get(fam, [None, None])
        assert (a["attn_logit_softcap"], a["final_logit_softcap"]) == (
            (50.0, 30.0) if fam == "gemma2" else (None, None))
        assert [row["scale"] for row in v["layers"]] == pytest.approx([16 ** -0.5] * 2)
        rq = c.post("/v1/verify", json={"text": TEXT, "mode": "recorded_qkv"})
        assert rq.status_code == 200, rq.text
        assert rq.json()["verification"]["passed"]
        assert rq.json()["verification"].get("architecture") is None
        r = c.post("/v1/verify", json={"texts": [TEXT, "hi"], "layers": [1]})  # a batch, one layer
        assert r.status_code == 200, r.text
        for v in r.json()["results"]:
            assert v["passed"], v["message"]
            assert [row["layer"] for row in v["layers"]] == [1]


@pytest.fixture(scope="module")
def family_runtime(ckpt):
    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime

    cache = {}

    def get(fam):
        if fam not in cache:
            cache[fam] = Runtime.load(Settings(model=str(ckpt(fam))))
        return cache[fam]
    return get


def _runtime_verify(rt, exact=False):
    from attnscope.service.runtime import interventions as I

    rt.cache.clear()
    tt = rt.tokenize(TEXT, add_bos=True)
    fw = rt.forward_many([tt])[0]
    return verify_from_scratch(fw.tensors, ScratchModel.of(rt.adapter), tt.input_ids,
                               rt.info["dtype"], logits=I.served_logits(rt, tt.input_ids),
                               served_inv_freq=None if exact else rt.adapter.rotary()["inv_freq"])


@pytest.mark.parametrize("fam", ["llama", "gpt_neox", "gemma2"])
def test_served_rope_theta_fault_fails_through_the_runtime(fam, family_runtime):
    """The resident model's rotary frequencies changed in place to theta x 1.5 (the config
    still says theta): the recorded and the hooked forward rotate with them; verify fails at
    layer 0, naming the rotary frequencies (and, recomputed with exact angles, q after RoPE
    and the LM head's logits). Restored, it passes again."""
    rt = family_runtime(fam)
    assert _runtime_verify(rt)["passed"]
    m = ScratchModel.of(rt.adapter)
    inv = rt.adapter.base().rotary_emb.inv_freq
    true = inv.clone()
    with torch.no_grad():
        inv.copy_(rope_inv_freq(_theta(m, 1.5)).float())
    try:
        v = _runtime_verify(rt)
        exact = _runtime_verify(rt, exact=True)
    finally:
        with torch.no_grad():
            inv.copy_(true)
    assert not v["passed"] and v["failing_layer"] == 0 and not v["rotary"]["passed"]
    assert "rotary frequencies" in v["message"]
    assert not exact["passed"] and "q differs" in exact["message"] and not exact["logits"]["passed"]
    assert _runtime_verify(rt)["passed"] and _runtime_verify(rt, exact=True)["passed"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fam", [f if f in ("llama", "gemma2") else pytest.param(f, marks=pytest.mark.slow)
                                 for f in FAMILIES])  # ~3 s each: two in the fast tier
def test_half_precision_families_pass_at_their_tolerance(fam, dtype, ckpt):
    """Each family served in float16 / bfloat16 passes at the dtype's tolerances (measured on
    these checkpoints: pattern <= 7.5e-3 in float16, <= 7.3e-2 in bfloat16 against 2.5e-2 /
    1.2e-1); the rotary check is dtype-independent (the frequencies stay float32) and still
    fails a theta off by 1e-5; a tiled kv-head map fails too."""
    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime
    from attnscope.service.runtime import interventions as I

    rt = Runtime.load(Settings(model=str(ckpt(fam)), dtype=dtype))
    tt = rt.tokenize(TEXT, add_bos=True)
    fw = rt.forward_many([tt])[0]
    m = ScratchModel.of(rt.adapter)
    inv = rt.adapter.rotary()["inv_freq"]
    assert inv.dtype == torch.float32

    def check(model, **kw):
        return verify_from_scratch(fw.tensors, model, tt.input_ids, dtype, served_inv_freq=inv,
                                   logits=I.served_logits(rt, tt.input_ids), **kw)
    v = check(m)
    assert v["passed"], v["message"]
    assert v["tolerance"] == TOLERANCES[dtype][0] and v["max_abs_diff"] > TOLERANCES["float32"][0]
    assert v["logits"]["passed"] and v["rotary"]["passed"]
    v = check(_theta(m, 1 + 1e-5))
    assert not v["passed"] and not v["rotary"]["passed"] and v["failing_layer"] == 0
    if fam != "gpt_neox":
        v = check(m, kv_map=_tiled(m))
        assert not v["passed"] and v["failing_layer"] == 0 and "pattern" in v["message"]


def _hf_recording(mp, rt):
    """Make ``rt`` record through Hugging Face's modules (the path of encoders and of the
    configurations the hooked forward does not implement, ``Runtime.hooked_parts``)."""
    mp.setitem(rt.memo, "hooked_unsupported", "test: Hugging Face's modules")
    assert rt.hooked_parts() is None


@pytest.mark.parametrize("recorded_by", ["hooked", "hf"])
def test_served_soft_cap_fault_fails_through_the_runtime(recorded_by, family_runtime,
                                                         monkeypatch):
    """Gemma 2's served forward without the soft-cap (the config keeps it): ``hooked``, the
    recorded forward of every causal endpoint (service/runtime/hooked_families.py), its parts
    told the model has none; ``hf``, the same runtime recording through Hugging Face's
    modules, the attention modules told to skip it. The recorded patterns lose it, verify
    fails at layer 0's pattern; restored, it passes."""
    rt = family_runtime("gemma2")
    with monkeypatch.context() as mp:
        if recorded_by == "hooked":
            mp.setitem(rt.memo, "hooked_parts",
                       dataclasses.replace(rt.hooked_parts(), attn_softcap=None))
        else:
            _hf_recording(mp, rt)
            for layer in rt.adapter.base().layers:
                mp.setattr(layer.self_attn, "attn_logit_softcapping", None)
        v = _runtime_verify(rt)
    assert not v["passed"] and v["failing_layer"] == 0 and "pattern" in v["message"]
    assert v["layers"][0]["softcap"] == 50.0
    assert rt.hooked_parts().attn_softcap == 50.0
    assert _runtime_verify(rt)["passed"]


@pytest.mark.parametrize("recorded_by", ["hooked", "hf"])
@pytest.mark.parametrize("fam", ["mistral", "gemma2"])
def test_served_window_off_by_one_fails_through_the_runtime(fam, recorded_by, family_runtime,
                                                            monkeypatch):
    """The served forward's sliding window one too wide while it records (``hooked``: the
    hooked forward's blocks, the recorded forward of every causal endpoint; ``hf``: the
    resident model's config, from which Hugging Face builds the sliding mask, with the
    runtime recording through Hugging Face's modules); verified against the true config: the
    first windowed layer's pattern fails (layer 0 for both)."""
    rt = family_runtime(fam)
    m = ScratchModel.of(rt.adapter)  # the true config, as plain values
    w = rt.model.config.sliding_window
    rt.cache.clear()
    tt = rt.tokenize(TEXT, add_bos=True)
    with monkeypatch.context() as mp:
        if recorded_by == "hooked":
            p = rt.hooked_parts()
            wider = tuple(b if b.window is None else dataclasses.replace(b, window=b.window + 1)
                          for b in p.blocks)
            assert wider != p.blocks
            mp.setitem(rt.memo, "hooked_parts", dataclasses.replace(p, blocks=wider))
        else:
            _hf_recording(mp, rt)
            mp.setattr(rt.model.config, "sliding_window", w + 1)
        fw = rt.forward_many([tt])[0]
    rt.cache.clear()
    v = verify_from_scratch(fw.tensors, m, tt.input_ids, "float32",
                            served_inv_freq=rt.adapter.rotary()["inv_freq"])
    assert not v["passed"] and v["failing_layer"] == 0 and "pattern" in v["message"]
    assert v["layers"][0]["window"] == w and v["layers"][0]["pattern_max_abs_diff"] > 1e-2
    assert _runtime_verify(rt)["passed"]


def test_unimplemented_rope_type_is_a_422_naming_it(ckpt):
    """A served Llama with rope_type 'yarn': from_scratch is the 422 unsupported_model_config
    naming rope_parameters.rope_type; the cheap mode still answers."""
    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app
    from attnscope.service.config import Settings
    from conftest import assert_error

    path = ckpt("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                                              "factor": 2.0, "original_max_position_embeddings": 128}})
    with TestClient(create_app(Settings(model=str(path))), raise_server_exceptions=False) as c:
        _ready(c)
        e = assert_error(c.post("/v1/verify", json={"text": TEXT}), 422,
                         "unsupported_model_config", "mode")
        assert "rope_parameters.rope_type" in e["message"] and "yarn" in e["message"]
        assert c.post("/v1/verify", json={"text": TEXT, "mode": "recorded_qkv"}).status_code == 200
