"""POST /v1/verify: attention recomputed from the model's own q/k/v (DESIGN.md, "verification")
equals Hugging Face's attention on the bundled GPT-2 and on MiniLM, honours GPT-2's config
switches, and fails -- naming the layer and head -- when the output projection changes after the
forward, when a recorded tensor is altered, or when a NaN appears. A change of the q/k/v weights
after the forward is seen only with ``projections: true``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnscope.schemas import VerifyResponse
from attnscope.service.analysis.verify import recompute_layer, verify
from attnscope.service.config import BUNDLED_MODEL_DIR, Settings
from attnscope.service.runtime import Runtime
from attnscope.service.runtime.adapters import ADAPTERS

from conftest import SENTENCE

URL = "/v1/verify"


def all_params(rt):
    return {layer: rt.adapter.attention_params(layer) for layer in range(rt.adapter.n_layers)}


@pytest.mark.parametrize("fixture", ["gpt2", "bert"])
def test_passes_on_real_models(fixture, request):
    rt = request.getfixturevalue(f"{fixture}_runtime")
    c = request.getfixturevalue("client" if fixture == "gpt2" else "bert_client")
    r = c.post(URL, json={"text": SENTENCE})
    assert r.status_code == 200, r.text
    v = VerifyResponse.model_validate(r.json()).verification
    assert v.passed and v.failed_layers == [] and v.message.startswith("passed")
    assert v.tolerance == 1e-5 and v.dtype == "float32" and v.projections is False
    assert 0 <= v.max_abs_diff <= 1e-5
    assert [lyr.layer for lyr in v.layers] == list(range(rt.adapter.n_layers))
    assert all(len(lyr.heads) == rt.adapter.n_heads and lyr.passed for lyr in v.layers)
    assert all(lyr.qkv_max_abs_diff is None for lyr in v.layers)  # not requested
    # with the projections checked too
    r = c.post(URL, json={"text": SENTENCE, "projections": True})
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
            pattern, attn_out = recompute_layer(q, k, v, rt.adapter.attention_params(layer))
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
    r = client.post(URL, json={"texts": [SENTENCE, "And"], "layers": [1], "projections": True})
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
        ({"text": SENTENCE, "projections": 1}, "projections"),
        ({"text": SENTENCE, "projections": "yes"}, "projections"),
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
    assert c.post(URL, json={"text": SENTENCE}).json()["verification"]["passed"]  # forward cached
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
    v = c.post(URL, json={"text": SENTENCE}).json()["verification"]
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
    assert c.post(URL, json={"text": SENTENCE}).json()["verification"]["passed"]  # forward cached
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
    v = c.post(URL, json={"text": SENTENCE}).json()["verification"]
    assert v["passed"] is True
    v = c.post(URL, json={"text": SENTENCE, "projections": True}).json()["verification"]
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
    c.post(URL, json={"text": SENTENCE})  # forward cached before the NaN
    # a NaN in the output projection's bias: the default sees it
    perturb(rt.adapter.base().h[0].attn.c_proj.bias, lambda b: b.__setitem__(3, float("nan")))
    res = verify(fw.tensors, all_params(rt))
    assert not res["passed"] and res["max_abs_diff"] is None and res["failed_layers"] == [0]
    assert res["layers"][0]["output_max_abs_diff"] is None and "NaN" in res["message"]
    assert res["layers"][1]["passed"]
    r = c.post(URL, json={"text": SENTENCE})
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
