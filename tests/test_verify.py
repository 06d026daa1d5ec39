"""POST /v1/verify.

Mode ``from_scratch`` (default): the float64 recomputation from token ids, weights and config
passes with honest nonzero differences on the bundled GPT-2, MiniLM and a GPT-2-small-shaped
random model; it passes on real altered checkpoints (a changed c_attn weight, the inverse-layer
scale, no scale) and reports the scale per layer; it fails, naming the layer, when the served
forward is tampered with (a perturbed q or pattern, a wrong position id) or when the
recomputation ignores a config switch; an unimplemented switch is a 422 naming it.

Mode ``recorded_qkv``: attention recomputed from the model's own recorded q/k/v equals Hugging
Face's attention, honours GPT-2's config switches, and fails -- naming the layer and head --
when the output projection changes after the forward, when a recorded tensor is altered, or
when a NaN appears. A change of the q/k/v weights after the forward is seen only with
``projections: true``."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnscope.schemas import VerifyResponse
from attnscope.service.analysis.verify import (
    TOLERANCES, ScratchModel, check_supported, layer_scale, recompute, verify_from_scratch,
)
from attnscope.service.analysis.verify_recorded import recompute_layer, verify
from attnscope.service.config import BUNDLED_MODEL_DIR, Settings
from attnscope.service.errors import UnsupportedModelConfig
from attnscope.service.runtime import Runtime
from attnscope.service.runtime.adapters import ADAPTERS

from conftest import SENTENCE, assert_error
from attnscope.service.analysis.verify_recorded import AttentionParams

URL = "/v1/verify"
RQ = {"mode": "recorded_qkv"}


def all_params(rt):
    return {layer: AttentionParams.of(rt.adapter, layer) for layer in range(rt.adapter.n_layers)}


def scratch(rt, fw, **kw):
    return verify_from_scratch(fw.tensors, ScratchModel.of(rt.adapter), fw.tokens.input_ids,
                               rt.info["dtype"], **kw)


def _honest_pass(v, rt):
    """A from-scratch pass: every difference within tolerance, the true maxima nonzero."""
    assert v["passed"], v["message"]
    assert v["mode"] == "from_scratch" and v["compute_dtype"] == "float64"
    assert v["failed_layers"] == [] and v["failing_layer"] is None
    assert v["tolerance"] == TOLERANCES["float32"][0] and v["state_tolerance"] == TOLERANCES["float32"][1]
    assert 0 < v["max_abs_diff"] <= v["tolerance"] and 0 < v["max_rel_diff"] <= v["state_tolerance"]
    assert v["mask"] == ("causal" if rt.adapter.causal else "bidirectional")
    assert [lyr["layer"] for lyr in v["layers"]] == list(range(rt.adapter.n_layers))
    for lyr in v["layers"]:
        assert lyr["passed"] and len(lyr["heads"]) == rt.adapter.n_heads
        assert any(h["pattern_max_abs_diff"] > 0 for h in lyr["heads"])
        for key in ("q", "k", "v", "output", "hidden"):
            assert lyr[f"{key}_max_abs_diff"] > 0, key  # float32 vs float64: never exactly 0
    assert v["embeddings"]["passed"]
    if rt.adapter.causal:
        assert v["final"]["passed"] and v["final"]["max_abs_diff"] > 0
    else:
        assert v["final"] is None


# ---------------------------------------------------------------- from scratch: passes
@pytest.mark.parametrize("fixture", ["gpt2", "bert"])
def test_from_scratch_passes_with_honest_differences(fixture, request):
    rt = request.getfixturevalue(f"{fixture}_runtime")
    c = request.getfixturevalue("client" if fixture == "gpt2" else "bert_client")
    r = c.post(URL, json={"text": SENTENCE})
    assert r.status_code == 200, r.text
    v = r.json()["verification"]
    VerifyResponse.model_validate(r.json())
    _honest_pass(v, rt)
    # add_bos null: the model's convention (GPT-2: BOS first; encoders: their own framing)
    assert v["add_bos"] is (fixture == "gpt2") and v["dtype"] == "float32"
    d_head = rt.adapter.d_head
    assert [lyr["scale"] for lyr in v["layers"]] == pytest.approx([d_head ** -0.5] * rt.adapter.n_layers)
    assert v["message"].startswith("passed")
    if fixture == "gpt2":  # BOS first by default; and the text's own tokens (add_bos false) too
        assert v["tokens"][0]["special"]
        v = c.post(URL, json={"text": SENTENCE, "add_bos": False}).json()["verification"]
        _honest_pass(v, rt)
        assert v["add_bos"] is False and not v["tokens"][0]["special"]


def test_from_scratch_passes_on_gpt2_small_shaped_random_model(gpt2_small_random_dir):
    rt = Runtime.load(Settings(model=str(gpt2_small_random_dir)))
    assert (rt.adapter.n_layers, rt.adapter.n_heads, rt.adapter.d_model) == (12, 12, 768)
    fw = rt.forward_many([rt.tokenize(SENTENCE, add_bos=True)])[0]
    _honest_pass(scratch(rt, fw), rt)


def test_recomputation_hidden_states_equal_hugging_face(gpt2_runtime, bert_runtime):
    """The float64 recomputation against HF's own forward (float32): every residual state."""
    for rt in (gpt2_runtime, bert_runtime):
        ids = list(rt.tokenize(SENTENCE).input_ids)
        kw = {"token_type_ids": torch.zeros(1, len(ids), dtype=torch.long)} if not rt.adapter.causal else {}
        with torch.no_grad():
            out = rt.adapter.base()(input_ids=torch.tensor([ids]), output_hidden_states=True,
                                    output_attentions=True, **kw)
        rc = recompute(ScratchModel.of(rt.adapter), ids)
        assert rc.embeddings.dtype == torch.float64
        torch.testing.assert_close(rc.embeddings, out.hidden_states[0][0].double(), atol=1e-5, rtol=0)
        L = rt.adapter.n_layers
        for st in rc.layers:
            torch.testing.assert_close(st.pattern, out.attentions[st.layer][0].double(), atol=1e-5, rtol=0)
            if st.layer < L - 1 or not rt.adapter.causal:
                torch.testing.assert_close(st.output, out.hidden_states[st.layer + 1][0].double(),
                                           atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(rc.final[0], out.hidden_states[L][0].double(), atol=1e-4, rtol=1e-5)


# ------------------------------------------------------------------ altered checkpoints
def _copy_bundled(tmp_path, name, config=None, weights=None):
    d = tmp_path / name
    shutil.copytree(BUNDLED_MODEL_DIR, d)
    if config:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(config)
        (d / "config.json").write_text(json.dumps(cfg))
    if weights:
        sd = load_file(d / "model.safetensors")
        weights(sd)
        save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def altered(tmp_path_factory):
    """Real altered copies of the bundled checkpoint, loaded as runtimes (tiny: ~1 s each)."""
    tmp = tmp_path_factory.mktemp("altered")

    def bump(sd):
        key = next(k for k in sd if k.endswith("h.1.attn.c_attn.weight"))
        sd[key][3, 5] += 1e-3

    dirs = {
        "c_attn": _copy_bundled(tmp, "c_attn", weights=bump),
        "inverse": _copy_bundled(tmp, "inverse", config={"scale_attn_by_inverse_layer_idx": True}),
        "unscaled": _copy_bundled(tmp, "unscaled", config={"scale_attn_weights": False}),
    }
    return {k: Runtime.load(Settings(model=str(d))) for k, d in dirs.items()}


@pytest.mark.parametrize("name", ["c_attn", "inverse", "unscaled"])
def test_altered_checkpoints_are_served_and_verified(altered, gpt2_runtime, name):
    rt = altered[name]
    tt = rt.tokenize(SENTENCE)
    fw = rt.forward_many([tt])[0]
    orig = gpt2_runtime.forward_many([gpt2_runtime.tokenize(SENTENCE)])[0]
    moved = (fw.pattern - orig.pattern).abs().amax(dim=(1, 2, 3))  # per layer
    v = scratch(rt, fw)
    _honest_pass(v, rt)
    scales = [lyr["scale"] for lyr in v["layers"]]
    s = 128 // 4  # d_head of the bundled model
    if name == "c_attn":  # a real model: its layer-1 pattern moved, layer 0 did not
        assert moved[0] == 0 and moved[1] > 1e-6
        assert scales == pytest.approx([s ** -0.5] * 2)
    elif name == "inverse":
        assert scales == pytest.approx([s ** -0.5, s ** -0.5 / 2])
        assert moved[0] == 0 and moved[1] > 0.1
    else:
        assert scales == [1.0, 1.0] and moved.min() > 0.1
    # the revision names the altered checkpoint (config and weights hashed)
    assert rt.info["revision"] != gpt2_runtime.info["revision"]


def test_revision_hashes_weights_config_and_tokenizer(tmp_path, gpt2_runtime):
    from attnscope.service.runtime.loading import _weights_revision

    d = _copy_bundled(tmp_path, "copy")
    rev = _weights_revision(d)
    assert rev == _weights_revision(BUNDLED_MODEL_DIR) == gpt2_runtime.info["revision"]
    (d / "README.md").write_text("a model card does not change the numbers")
    assert _weights_revision(d) == rev
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "layer_norm_epsilon": 1e-6}))
    rev_cfg = _weights_revision(d)
    assert rev_cfg != rev
    tc = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tc, "add_prefix_space": True}))
    assert _weights_revision(d) not in (rev, rev_cfg)


def test_recomputation_that_ignores_the_inverse_layer_flag_fails_at_layer_1(altered):
    rt = altered["inverse"]
    fw = rt.forward_many([rt.tokenize(SENTENCE)])[0]
    m = ScratchModel.of(rt.adapter)
    plain = [layer_scale(dataclasses.replace(m, config={**m.config, "scale_attn_by_inverse_layer_idx": False}), i)
             for i in range(2)]
    v = scratch(rt, fw, scales=plain)
    assert not v["passed"] and v["failing_layer"] == 1 and v["failed_layers"] == [1]
    assert v["layers"][0]["passed"] and not v["layers"][1]["passed"]
    assert v["layers"][1]["pattern_max_abs_diff"] > 0.1
    assert "layer 1" in v["message"] and "pattern of head" in v["message"]


# --------------------------------------------------------------- tampering: it fails
def test_perturbed_recorded_q_or_pattern_fails_at_that_layer(gpt2_runtime):
    rt = gpt2_runtime
    fw = rt.forward_many([rt.tokenize(SENTENCE)])[0]
    t = fw.tensors
    _honest_pass(scratch(rt, fw), rt)
    q = t.q.clone()
    q[1, 2, 4] += 0.05
    v = scratch(rt, dataclasses.replace(fw, tensors=t.replace(q=q)))
    assert not v["passed"] and v["failed_layers"] == [1] and v["failing_layer"] == 1
    assert v["layers"][1]["q_max_abs_diff"] == pytest.approx(0.05, rel=1e-3)
    assert "layer 1" in v["message"] and "q differs" in v["message"]
    pat = t.pattern.clone()
    pat[0, 3, 5, 0] -= 1e-3
    pat[0, 3, 5, 1] += 1e-3
    v = scratch(rt, dataclasses.replace(fw, tensors=t.replace(pattern=pat)))
    assert not v["passed"] and v["failed_layers"] == [0]
    bad = [h["head"] for h in v["layers"][0]["heads"] if h["pattern_max_abs_diff"] > v["tolerance"]]
    assert bad == [3] and "layer 0: pattern of head 3" in v["message"]


def test_wrong_position_id_in_the_served_forward_fails_at_the_embeddings(make_client,
                                                                        monkeypatch):
    """Planted in the forward that serves (the hooked one, service/runtime/hooked.py, which
    records for every causal endpoint): every position reads the next position's embedding,
    as if each position id were one too high; the model's weights (what verify reads) are
    untouched."""
    import dataclasses

    rt = Runtime.load(Settings(model="bundled"))  # its forwards are tampered with below
    p = rt.hooked_parts()
    shifted = torch.cat([p.wpe[1:], p.wpe[-1:]])  # row i = wpe[i + 1]
    monkeypatch.setitem(rt.memo, "hooked_parts", dataclasses.replace(p, wpe=shifted))
    c = make_client(rt)
    v = c.post(URL, json={"text": SENTENCE}).json()["verification"]
    assert not v["passed"] and v["failing_layer"] == 0 and not v["embeddings"]["passed"]
    assert "embeddings" in v["message"] and v["embeddings"]["max_abs_diff"] > 1e-3
    assert v["failed_layers"] == [0, 1]  # it propagates; the first is named
    # recorded_qkv cannot see it: everything after the embeddings is self-consistent
    rq = c.post(URL, json={"text": SENTENCE, **RQ}).json()["verification"]
    assert rq["passed"], rq["message"]


def test_weight_changed_after_the_forward_and_nan_fail(fresh_gpt2, perturb):
    rt = fresh_gpt2
    fw = rt.forward_many([rt.tokenize(SENTENCE)])[0]
    d = rt.adapter.d_model
    perturb(rt.adapter.base().h[1].attn.c_attn.weight, lambda w: w[:, :d].add_(0.01))  # W_q
    v = scratch(rt, fw)
    assert not v["passed"] and v["failing_layer"] == 1 and "q differs" in v["message"]
    perturb(rt.adapter.base().h[0].mlp.c_fc.bias, lambda b: b.__setitem__(3, float("nan")))
    v = scratch(rt, fw)
    assert not v["passed"] and v["failing_layer"] == 0 and "NaN" in v["message"]
    assert v["max_rel_diff"] is None


# ---------------------------------------------------------------- unimplemented switches
def test_unimplemented_config_switch_is_a_422_naming_it(tmp_path, make_client, bert_runtime):
    d = _copy_bundled(tmp_path, "mish", config={"activation_function": "mish"})
    rt = Runtime.load(Settings(model=str(d)))
    c = make_client(rt)
    r = c.post(URL, json={"text": SENTENCE})
    assert r.status_code == 422, r.text
    e = r.json()["error"]
    assert e["type"] == "unsupported_model_config" and e["param"] == "mode"
    assert "activation_function" in e["message"] and "mish" in e["message"]
    assert c.post(URL, json={"text": SENTENCE, **RQ}).status_code == 200  # the cheap mode works
    assert c.get("/healthz").status_code in (200, 404)
    m = ScratchModel.of(bert_runtime.adapter)
    for key, value in (("position_embedding_type", "relative_key"), ("is_decoder", True),
                       ("add_cross_attention", True), ("hidden_act", "mish")):
        with pytest.raises(UnsupportedModelConfig, match=key):
            check_supported(dataclasses.replace(m, config={**m.config, key: value}))
    check_supported(m)
    with pytest.raises(UnsupportedModelConfig, match="model_type"):
        check_supported(ScratchModel("falcon", {}, m.weights, 1, 1))  # llama: issue 28


def test_float16_model_passes_at_its_tolerance():
    rt = Runtime.load(Settings(model="bundled", dtype="float16"))
    fw = rt.forward_many([rt.tokenize(SENTENCE)])[0]
    v = scratch(rt, fw)
    assert v["passed"], v["message"]
    assert v["dtype"] == "float16" and v["tolerance"] == TOLERANCES["float16"][0]
    assert v["max_abs_diff"] > TOLERANCES["float32"][0] / 100  # half precision drifts visibly


# ------------------------------------------------------------------- mode recorded_qkv
@pytest.mark.parametrize("fixture", ["gpt2", "bert"])
def test_recorded_qkv_passes_on_real_models(fixture, request):
    rt = request.getfixturevalue(f"{fixture}_runtime")
    c = request.getfixturevalue("client" if fixture == "gpt2" else "bert_client")
    r = c.post(URL, json={"text": SENTENCE, **RQ})
    assert r.status_code == 200, r.text
    v = VerifyResponse.model_validate(r.json()).verification
    assert v.passed and v.failed_layers == [] and v.message.startswith("passed")
    assert v.tolerance == 1e-5 and v.dtype == "float32" and v.projections is False
    assert 0 <= v.max_abs_diff <= 1e-5 and v.mode == "recorded_qkv"
    assert [lyr.layer for lyr in v.layers] == list(range(rt.adapter.n_layers))
    assert all(len(lyr.heads) == rt.adapter.n_heads and lyr.passed for lyr in v.layers)
    assert all(lyr.qkv_max_abs_diff is None for lyr in v.layers)  # not requested
    # with the projections checked too
    r = c.post(URL, json={"text": SENTENCE, "projections": True, **RQ})
    assert r.status_code == 200, r.text
    v = VerifyResponse.model_validate(r.json()).verification
    assert v.passed and v.projections is True
    assert all(0 <= lyr.qkv_max_abs_diff <= 1e-5 for lyr in v.layers)


def _hf_qkv(fixture, base, layer, h):
    """q, k, v [head, pos, d_head] from HF's own modules on HF's own hidden state ``h``
    (independent of the runtime's hooks), and the attention input."""
    if fixture == "gpt2":
        attn = base.h[layer].attn
        x = base.h[layer].ln_1(h)
        q, k, v = attn.c_attn(x).split(attn.embed_dim, dim=-1)
        H = attn.num_heads
    else:
        sa = base.encoder.layer[layer].attention.self
        x = h
        q, k, v = sa.query(x), sa.key(x), sa.value(x)
        H = base.config.num_attention_heads
    T = x.shape[0]
    return [t.view(T, H, -1).transpose(0, 1) for t in (q, k, v)], x


def _hf_next_hidden(fixture, base, layer, h, attn_out):
    """The next hidden state from an attention output, through HF's own block modules."""
    if fixture == "gpt2":
        block = base.h[layer]
        r = h + attn_out
        nxt = r + block.mlp(block.ln_2(r))
        return base.ln_f(nxt) if layer == len(base.h) - 1 else nxt  # HF's last state is ln_f'd
    lyr = base.encoder.layer[layer]
    a = lyr.attention.output.LayerNorm(attn_out + h)
    return lyr.output(lyr.intermediate(a), a)


@pytest.mark.parametrize("fixture", ["gpt2", "bert"])
def test_recomputation_equals_hugging_face(fixture, request):
    """Independent of the runtime's recording: q/k/v from HF's own modules on HF's hidden
    states, pattern compared with ``output_attentions``, the output (after our output
    projection) carried through HF's own MLP/LayerNorm to the next ``hidden_states``."""
    rt = request.getfixturevalue(f"{fixture}_runtime")
    ids = torch.tensor([rt.tokenize(SENTENCE).input_ids])
    base = rt.adapter.base()
    with torch.no_grad():
        out = base(input_ids=ids, output_attentions=True, output_hidden_states=True)
        for layer in range(rt.adapter.n_layers):
            h = out.hidden_states[layer][0]
            (q, k, v), _ = _hf_qkv(fixture, base, layer, h)
            pattern, attn_out = recompute_layer(q, k, v, AttentionParams.of(rt.adapter, layer))
            assert (pattern - out.attentions[layer][0]).abs().max().item() <= 1e-5
            nxt = _hf_next_hidden(fixture, base, layer, h, attn_out)
            assert (nxt - out.hidden_states[layer + 1][0]).abs().max().item() <= 1e-4
            if fixture == "gpt2":
                assert pattern[:, 0, 1:].abs().max().item() == 0.0  # causal: no future keys
            else:
                assert pattern[:, 0, 1:].min().item() > 0  # bidirectional
            # negative control: a wrong output projection is visible in the next hidden state
            bad = _hf_next_hidden(fixture, base, layer, h, attn_out * 1.01)
            assert (bad - out.hidden_states[layer + 1][0]).abs().max().item() > 1e-4


def test_layers_selection_and_batch(client):
    # the text's own tokens (add_bos false): "And" is one token
    r = client.post(URL, json={"texts": [SENTENCE, "And"], "layers": [1], "projections": True,
                               "add_bos": False, **RQ})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert [lyr["layer"] for lyr in res[0]["layers"]] == [1] and all(x["passed"] for x in res)
    assert all(x["projections"] and x["layers"][0]["qkv_max_abs_diff"] is not None for x in res)
    assert len(res[1]["tokens"]) == 1  # one token: a 1x1 pattern of 1.0, still checked


@pytest.mark.parametrize(
    "payload, param",
    [
        ({"text": SENTENCE, "layers": [2]}, "layers.0"),
        ({"text": SENTENCE, "layers": [0, -1]}, "layers.1"),
        ({"text": SENTENCE, "layers": []}, "layers"),
        ({"text": SENTENCE, "tolerance": 0}, "tolerance"),
        ({"text": SENTENCE, "tolerance": 2}, "tolerance"),
        ({"text": SENTENCE, "projections": 1, **RQ}, "projections"),
        ({"text": SENTENCE, "projections": "yes", **RQ}, "projections"),
        ({"text": SENTENCE, "projections": True}, "projections"),  # from_scratch: not applicable
        ({"text": SENTENCE, "mode": "exact"}, "mode"),
        ({"text": ""}, "text"),
    ],
)
def test_bad_requests(client, payload, param):
    r = client.post(URL, json=payload)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == param


# ------------------------------------------------------- a fresh runtime we may break
@pytest.fixture(scope="module")
def fresh_gpt2():
    """A separate bundled runtime: these tests change its weights (and restore them)."""
    return Runtime.load(Settings(model="bundled"))


@pytest.fixture
def perturb():
    """``perturb(tensor, fn)``: change a parameter in place (under no_grad); restored after
    the test, whatever happens."""
    saved = []

    def apply(t, fn):
        saved.append((t, t.detach().clone()))
        with torch.no_grad():
            fn(t)

    yield apply
    with torch.no_grad():
        for t, s in reversed(saved):
            t.copy_(s)


def test_output_projection_change_fails_by_default(fresh_gpt2, make_client, perturb):
    rt = fresh_gpt2
    c = make_client(rt)
    assert c.post(URL, json={"text": SENTENCE, **RQ}).json()["verification"]["passed"]  # forward cached
    fw = rt.forward_many([rt.tokenize(SENTENCE)])[0]
    assert fw.cached
    perturb(rt.adapter.base().h[1].attn.c_proj.weight, lambda w: w[:, 7].add_(0.05))
    res = verify(fw.tensors, all_params(rt))
    assert not res["passed"] and res["failed_layers"] == [1]
    lyr1 = res["layers"][1]
    assert res["layers"][0]["passed"] and not lyr1["passed"]
    assert lyr1["pattern_max_abs_diff"] <= 1e-5 and lyr1["output_max_abs_diff"] > 1e-3
    assert "layer 1" in res["message"] and "output differs" in res["message"]
    # the same through the API (the recorded forward comes from the cache)
    v = c.post(URL, json={"text": SENTENCE, **RQ}).json()["verification"]
    assert v["passed"] is False and v["failed_layers"] == [1] and "layer 1" in v["message"]


def test_output_bias_is_checked(fresh_gpt2, perturb):
    rt = fresh_gpt2
    fw = rt.forward_many([rt.tokenize(SENTENCE)])[0]
    perturb(rt.adapter.base().h[0].attn.c_proj.bias, lambda b: b[5].add_(1e-3))
    res = verify(fw.tensors, all_params(rt))
    lyr0 = res["layers"][0]
    assert not res["passed"] and res["failed_layers"] == [0]
    assert lyr0["pattern_max_abs_diff"] <= 1e-5 and lyr0["output_max_abs_diff"] > 5e-4


def test_weights_restored_pass_again(fresh_gpt2):
    """After the perturbing tests (their fixture restored the weights) the check passes."""
    rt = fresh_gpt2
    fw = rt.forward_many([rt.tokenize(SENTENCE)])[0]
    assert verify(fw.tensors, all_params(rt), projections=True)["passed"]


def test_qkv_weight_change_needs_projections(fresh_gpt2, make_client, perturb):
    """The default starts from the RECORDED q/k/v -- what the model actually used in this
    forward -- so a q/k/v weight change made after the forward cannot show in it (the pattern
    and output are still consistent with the recorded q/k/v). ``projections`` recomputes q/k/v
    from the recorded attention input with the current weights and catches it."""
    rt = fresh_gpt2
    c = make_client(rt)
    assert c.post(URL, json={"text": SENTENCE, **RQ}).json()["verification"]["passed"]  # forward cached
    fw = rt.forward_many([rt.tokenize(SENTENCE)])[0]
    assert fw.cached
    d = rt.adapter.d_model
    perturb(rt.adapter.base().h[1].attn.c_attn.weight, lambda w: w[:, :d].add_(0.05))  # W_q
    res = verify(fw.tensors, all_params(rt))
    assert res["passed"], res["message"]  # by design: see the docstring
    res = verify(fw.tensors, all_params(rt), projections=True)
    assert not res["passed"] and res["failed_layers"] == [1]
    assert res["layers"][1]["qkv_max_abs_diff"] > 1e-3 and res["layers"][0]["qkv_max_abs_diff"] <= 1e-5
    assert res["layers"][1]["pattern_max_abs_diff"] <= 1e-5  # the pattern link still holds
    assert "layer 1" in res["message"] and "q/k/v projections differ" in res["message"]
    # through the API (cached forward)
    v = c.post(URL, json={"text": SENTENCE, **RQ}).json()["verification"]
    assert v["passed"] is True
    v = c.post(URL, json={"text": SENTENCE, "projections": True, **RQ}).json()["verification"]
    assert v["passed"] is False and v["failed_layers"] == [1] and "layer 1" in v["message"]


def test_altered_recorded_tensors_fail_at_that_layer_and_head(gpt2_runtime):
    """Hand-made recordings: the model's pattern (or its queries) changed in one layer/head."""
    rt = gpt2_runtime
    fw = rt.forward_many([rt.tokenize(SENTENCE)])[0]
    t = fw.tensors
    params = all_params(rt)
    assert verify(t, params)["passed"]
    # move 0.01 of query 5's attention from key 0 to key 1 in layer 1, head 2 (row still sums to 1)
    pat = t.pattern.clone()
    pat[1, 2, 5, 0] -= 0.01
    pat[1, 2, 5, 1] += 0.01
    res = verify(t.replace(pattern=pat), params)
    assert not res["passed"] and res["failed_layers"] == [1]
    heads = res["layers"][1]["heads"]
    assert [h["head"] for h in heads if h["pattern_max_abs_diff"] > 1e-5] == [2]
    assert abs(heads[2]["pattern_max_abs_diff"] - 0.01) < 1e-6
    assert res["layers"][1]["output_max_abs_diff"] <= 1e-5  # the recorded output is intact
    assert res["message"].startswith("failed in layer(s) [1]")
    assert "layer 1: pattern of head 2" in res["message"]
    # queries of layer 0, head 3 scaled: its pattern (and so the output) no longer match
    q = t.q.clone()
    q[0, 3] *= 1.5
    res = verify(t.replace(q=q), params)
    assert res["failed_layers"] == [0] and "layer 0: pattern of head 3" in res["message"]
    assert [h["head"] for h in res["layers"][0]["heads"] if h["pattern_max_abs_diff"] > 1e-5] == [3]


def test_nan_fails_never_passes(fresh_gpt2, make_client, perturb):
    rt = fresh_gpt2
    fw = rt.forward_many([rt.tokenize(SENTENCE)])[0]
    c = make_client(rt)
    c.post(URL, json={"text": SENTENCE, **RQ})  # forward cached before the NaN
    # a NaN in the output projection's bias: the default sees it
    perturb(rt.adapter.base().h[0].attn.c_proj.bias, lambda b: b.__setitem__(3, float("nan")))
    res = verify(fw.tensors, all_params(rt))
    assert not res["passed"] and res["max_abs_diff"] is None and res["failed_layers"] == [0]
    assert res["layers"][0]["output_max_abs_diff"] is None and "NaN" in res["message"]
    assert res["layers"][1]["passed"]
    r = c.post(URL, json={"text": SENTENCE, **RQ})
    assert r.status_code == 200
    v = r.json()["verification"]
    assert v["passed"] is False and v["max_abs_diff"] is None


def test_nan_in_qkv_weights_fails_with_projections(fresh_gpt2, perturb):
    rt = fresh_gpt2
    fw = rt.forward_many([rt.tokenize(SENTENCE)])[0]
    perturb(rt.adapter.base().h[0].attn.c_attn.bias, lambda b: b.__setitem__(3, float("nan")))
    assert verify(fw.tensors, all_params(rt))["passed"]  # recorded q/k/v predate the NaN
    res = verify(fw.tensors, all_params(rt), projections=True)
    assert not res["passed"] and res["max_abs_diff"] is None and res["failed_layers"] == [0]
    assert res["layers"][0]["qkv_max_abs_diff"] is None and "NaN" in res["message"]


def test_nan_in_recorded_pattern_fails(gpt2_runtime):
    rt = gpt2_runtime
    fw = rt.forward_many([rt.tokenize(SENTENCE)])[0]
    bad = fw.pattern.clone()
    bad[1, 2, 3, 0] = float("nan")
    res = verify(fw.tensors.replace(pattern=bad), all_params(rt), tolerance=1.0)
    assert not res["passed"] and res["failed_layers"] == [1] and res["max_abs_diff"] is None
    assert res["layers"][1]["heads"][2]["pattern_max_abs_diff"] is None
    assert res["layers"][1]["pattern_max_abs_diff"] is None


# ------------------------------------------------------------ GPT-2's config switches
@pytest.mark.parametrize(
    "switches",
    [
        dict(scale_attn_weights=True, scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True),
        dict(scale_attn_weights=False, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False),
    ],
)
def test_config_switches_are_honoured(switches):
    """A tiny seeded random GPT-2 (HF's GPT2ModelTester pattern) with the switches set."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=2048, n_positions=64, n_embd=32, n_layer=3, n_head=4,
                     initializer_range=0.3, **switches)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval()
    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    rt = Runtime(model, tok, ADAPTERS["gpt2"](model), {"id": "tiny-random-gpt2", "revision": "none"},
                 Settings(model="bundled"))
    fw = rt.forward_many([rt.tokenize(SENTENCE)])[0]
    params = all_params(rt)
    for projections in (False, True):
        res = verify(fw.tensors, params, projections=projections)
        assert res["passed"], res["message"]
    # negative control: ignoring the switches (plain 1/sqrt(d_head) everywhere) is detected
    plain = {lyr: dataclasses.replace(p, scaling=rt.adapter.d_head ** -0.5) for lyr, p in params.items()}
    res = verify(fw.tensors, plain)
    expect = [1, 2] if switches["scale_attn_by_inverse_layer_idx"] else [0, 1, 2]
    assert not res["passed"] and res["failed_layers"] == expect


# ------------------------------------------------------------------ verify
@pytest.mark.regression
@pytest.mark.parametrize("which", ["gpt2", "bert"])
@pytest.mark.parametrize("projections", [False, True])
def test_verify_projections_both_models(client, bert_client, which, projections):
    c = client if which == "gpt2" else bert_client
    r = c.post("/v1/verify", json={"texts": [SENTENCE, "hi there"], "projections": projections,
                                   "layers": [1, 0], "mode": "recorded_qkv"})
    assert r.status_code == 200, r.text
    for res in r.json()["results"]:
        v = res
        assert v["passed"], v["message"]
        assert v["projections"] is projections
        assert [l["layer"] for l in v["layers"]] == [1, 0]
        for l in v["layers"]:
            assert (l["qkv_max_abs_diff"] is not None) is projections
    for tol in (0, -1, 1.5):
        assert_error(c.post("/v1/verify", json={"text": "hi", "tolerance": tol}),
                     param="tolerance")
    r = c.post("/v1/verify", json={"text": "hi", "tolerance": 1e-300})
    assert r.status_code == 200


@pytest.mark.regression
def test_verify_projections_sees_a_qkv_weight_change(gpt2_runtime, make_client):
    c = make_client(gpt2_runtime)
    text = "weight change seen by projections only"
    assert c.post("/v1/verify", json={"text": text}).json()["verification"]["passed"]
    p = AttentionParams.of(gpt2_runtime.adapter, 0)
    W = p.W_q
    with torch.no_grad():
        saved = W.clone()
        W.add_(0.01)
    try:
        r1 = c.post("/v1/verify", json={"text": text, "mode": "recorded_qkv"}).json()["verification"]
        r2 = c.post("/v1/verify", json={"text": text, "projections": True,
                                        "mode": "recorded_qkv"}).json()["verification"]
        r3 = c.post("/v1/verify", json={"text": text}).json()["verification"]
    finally:
        with torch.no_grad():
            W.copy_(saved)
    assert r1["passed"]  # documented: recorded q/k/v
    assert not r2["passed"] and r2["failed_layers"] == [0]
    assert not r3["passed"] and r3["failing_layer"] == 0  # from scratch: seen by default


# ------------------------------------------------ from scratch: the served logits (LM head)
def _scaled_attention(monkeypatch, rt, factor=1.10):
    """Plant a fault in the attention function the recorded forward calls through transformers'
    AttentionInterface (the model's registered implementation): scores scaled by ``factor``."""
    from transformers import AttentionInterface

    name = rt.model.config._attn_implementation
    orig = AttentionInterface._global_mapping[name]

    def faulty(module, q, k, v, mask, scaling=None, **kw):
        return orig(module, q, k, v, mask, scaling=scaling * factor, **kw)
    monkeypatch.setitem(AttentionInterface._global_mapping, name, faulty)


def _hooked_fault(monkeypatch, rt, *, attention=1.0, logits=1.0):
    """Plant a fault in the hooked forward only (the served logits' path): its parts' per-block
    q.k scaling times ``attention``, its unembedding a copy times ``logits``; the model's
    weights (what verify reads) untouched."""
    from attnscope.service.runtime import interventions as I

    p = I.lm_parts(rt)
    bad = dataclasses.replace(p, unembed=p.unembed * logits, blocks=tuple(
        dataclasses.replace(b, scaling=b.scaling * attention) for b in p.blocks))
    monkeypatch.setitem(rt.memo, "hooked_parts", bad)


def test_served_logits_are_checked_and_pass(client, gpt2_runtime):
    v = client.post(URL, json={"text": SENTENCE}).json()["verification"]
    assert v["passed"], v["message"]
    lg = v["logits"]
    assert lg["passed"] and 0 < lg["max_abs_diff"] <= lg["tolerance"] * max(1, lg["scale"])
    assert lg["tolerance"] == TOLERANCES["float32"][2] and lg["scale"] > 1
    assert "LM head logits" in v["message"]
    # encoders have no LM head; recorded_qkv does not recompute it
    assert client.post(URL, json={"text": SENTENCE, **RQ}).json()["verification"].get("logits") is None


def test_bert_has_no_logits_check(bert_client):
    v = bert_client.post(URL, json={"text": SENTENCE}).json()["verification"]
    assert v["passed"] and v["logits"] is None


@pytest.mark.parametrize("recorded_by", ["hooked", "hf"])
def test_attention_fault_in_transformers(monkeypatch, make_client, recorded_by):
    """Planted fault (a), transformers' eager attention function (the model's registered
    implementation, scores x1.10). ``hooked``: no served path of a causal LM calls it any more
    (the recorded forward, predictions, ablation, patching and /v1/run all run the hooked
    forward): verify passes and /v1/run is unchanged; the fault of the path that serves is
    planted in the hooked forward's attention below. ``hf``: the same model recording through
    Hugging Face's modules (encoders, configurations the hooked forward does not implement):
    the recorded patterns and states fail at layer 0, the logits (hooked) pass."""
    rt = Runtime.load(Settings(model="bundled"))
    c = make_client(rt)
    honest = c.post("/v1/run", json={"text": SENTENCE}).json()
    if recorded_by == "hf":
        monkeypatch.setitem(rt.memo, "hooked_unsupported", "test: Hugging Face's modules")
    _scaled_attention(monkeypatch, rt)
    rt.cache.clear()
    v = c.post(URL, json={"text": SENTENCE}).json()["verification"]
    if recorded_by == "hooked":
        assert v["passed"], v["message"]
    else:
        assert not v["passed"] and v["failing_layer"] == 0 and "pattern" in v["message"]
    assert v["logits"]["passed"], v["logits"]  # the hooked forward never called it
    assert c.post("/v1/run", json={"text": SENTENCE}).json() == honest


@pytest.mark.parametrize("fault", [{"attention": 1.10}, {"logits": 1.05}])
def test_fault_in_the_hooked_forward_fails_at_the_lm_head(monkeypatch, make_client, fault):
    """Planted faults (a) in the hooked forward's attention (scores x1.10) and (b) in its
    logits (x1.05): the predictions move and the logits check fails, and with it ``passed``.
    The hooked forward is also the recorded one: (a) fails at layer 0's pattern already,
    (b) leaves every recorded layer passing (the LM head is not part of the recording)."""
    rt = Runtime.load(Settings(model="bundled"))
    c = make_client(rt)
    body = {"text": SENTENCE, "top_k": 1}
    before = c.post("/v1/predictions", json=body).json()["predictions"]["positions"]
    _hooked_fault(monkeypatch, rt, **fault)
    rt.cache.clear()
    after = c.post("/v1/predictions", json=body).json()["predictions"]["positions"]
    moved = max(abs(a["top"][0]["logit"] - b["top"][0]["logit"]) for a, b in zip(after, before))
    assert moved > 0.1
    v = c.post(URL, json={"text": SENTENCE}).json()["verification"]
    assert not v["passed"] and not v["logits"]["passed"]
    if "attention" in fault:  # the recorded forward is the faulty one: its pattern fails
        assert v["failing_layer"] == 0 and "pattern" in v["message"], v["message"]
    else:
        assert all(layer["passed"] for layer in v["layers"]) and v["final"]["passed"]
        assert v["failing_layer"] is None and v["failed_layers"] == []
        assert v["message"].startswith("failed: first at LM head: LM head logits differ")
    lg = v["logits"]
    assert lg["max_abs_diff"] / max(1, lg["scale"]) > 3 * lg["tolerance"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_passes_and_fails_an_attention_fault(monkeypatch, dtype):
    """The half-precision tolerances come from measured drift (bench/precision_faults.py):
    honest passes; the 1.10x attention-scale fault fails, planted in the hooked forward (the
    recorded forward and the logits' both) and, with the model recording through Hugging
    Face's modules, in transformers' attention (the recorded forward alone)."""
    from attnscope.service.runtime import interventions as I

    rt = Runtime.load(Settings(model="bundled", dtype=dtype))
    tt = rt.tokenize(SENTENCE, add_bos=True)

    def check():
        rt.cache.clear()
        fw = rt.forward_many([tt])[0]
        return scratch(rt, fw, logits=I.served_logits(rt, tt.input_ids))
    v = check()
    assert v["passed"], v["message"]
    assert v["logits"]["tolerance"] == TOLERANCES[dtype][2]
    with monkeypatch.context() as mp:
        mp.setitem(rt.memo, "hooked_unsupported", "test: Hugging Face's modules")
        _scaled_attention(mp, rt)
        v = check()
        # float16 sees it in layer 0's pattern already; bfloat16 in layer 1's hidden state
        # (6.4e-2 relative > 5e-2; its pattern moves by 7.6e-2, under MiniLM's noise of 8.0e-2)
        assert not v["passed"] and v["failing_layer"] in (0, 1), v["message"]
    with monkeypatch.context() as mp:
        _hooked_fault(mp, rt, attention=1.10)
        v = check()
        assert not v["passed"] and not v["logits"]["passed"], v["message"]
        assert v["failing_layer"] in (0, 1), v["message"]  # the recorded forward's too


def test_logits_of_another_shape_or_nan_fail(gpt2_runtime):
    from attnscope.service.runtime import interventions as I

    rt = gpt2_runtime
    tt = rt.tokenize(SENTENCE)
    fw = rt.forward_many([tt])[0]
    lg = I.served_logits(rt, tt.input_ids)
    assert scratch(rt, fw, logits=lg)["passed"]
    for bad in (lg[:-1], lg[:, :-1], lg.clone().index_fill_(1, torch.tensor([5]), float("nan"))):
        v = scratch(rt, fw, logits=bad)
        assert not v["passed"] and not v["logits"]["passed"] and v["logits"]["max_abs_diff"] is None
