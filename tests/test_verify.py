"""POST /v1/verify: the from-scratch recomputation equals Hugging Face's attention on the bundled
GPT-2 and on MiniLM, honours GPT-2's config switches, and fails -- naming the layer -- when the
weights change between the forward and the recomputation, or when a NaN appears."""

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
    assert v.tolerance == 1e-5 and v.dtype == "float32"
    assert 0 <= v.max_abs_diff <= 1e-5
    assert [lyr.layer for lyr in v.layers] == list(range(rt.adapter.n_layers))
    assert all(len(lyr.heads) == rt.adapter.n_heads and lyr.passed for lyr in v.layers)
    # a tolerance below float32 rounding makes MiniLM fail (its differences are ~1e-7, not 0)
    if fixture == "bert":
        r = c.post(URL, json={"text": SENTENCE, "tolerance": 1e-12})
        assert r.json()["verification"]["passed"] is False


@pytest.mark.parametrize("fixture", ["gpt2", "bert"])
def test_recomputation_equals_hugging_face(fixture, request):
    """Independent of the runtime's recording: attention input from HF's own hidden states
    (GPT-2: ln_1 of the block input; BERT: the layer input), pattern from output_attentions."""
    rt = request.getfixturevalue(f"{fixture}_runtime")
    ids = torch.tensor([rt.tokenize(SENTENCE).input_ids])
    base = rt.adapter.base()
    with torch.no_grad():
        out = base(input_ids=ids, output_attentions=True, output_hidden_states=True)
        for layer in range(rt.adapter.n_layers):
            h = out.hidden_states[layer][0]
            x = base.h[layer].ln_1(h) if fixture == "gpt2" else h
            pattern, _ = recompute_layer(x, rt.adapter.attention_params(layer))
            assert (pattern - out.attentions[layer][0]).abs().max().item() <= 1e-5
            if fixture == "gpt2":
                assert pattern[:, 0, 1:].abs().max().item() == 0.0  # causal: no future keys


def test_layers_selection_and_batch(client, gpt2_runtime):
    r = client.post(URL, json={"texts": [SENTENCE, "And"], "layers": [1]})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert [lyr["layer"] for lyr in res[0]["layers"]] == [1] and all(x["passed"] for x in res)
    assert len(res[1]["tokens"]) == 1  # one token: a 1x1 pattern of 1.0, still checked


@pytest.mark.parametrize(
    "payload, param",
    [
        ({"text": SENTENCE, "layers": [2]}, "layers.0"),
        ({"text": SENTENCE, "layers": [0, -1]}, "layers.1"),
        ({"text": SENTENCE, "layers": []}, "layers"),
        ({"text": SENTENCE, "tolerance": 0}, "tolerance"),
        ({"text": SENTENCE, "tolerance": 2}, "tolerance"),
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


def test_fails_naming_the_layer_when_weights_change(fresh_gpt2, make_client):
    rt = fresh_gpt2
    c = make_client(rt)
    assert c.post(URL, json={"text": SENTENCE}).json()["verification"]["passed"]  # forward cached
    fw = rt.forward_many([rt.tokenize(SENTENCE)])[0]
    assert fw.cached
    w = rt.adapter.base().h[1].attn.c_attn.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w[:, : rt.adapter.d_model] += 0.05  # layer 1's W_q only
        res = verify(fw.tensors.attn_input, fw.pattern, fw.tensors.attn_output, all_params(rt))
        assert not res["passed"] and res["failed_layers"] == [1]
        assert "layer 1" in res["message"] and res["max_abs_diff"] > 1e-3
        assert res["layers"][0]["passed"] and not res["layers"][1]["passed"]
        # the same through the API (the recorded forward comes from the cache)
        v = c.post(URL, json={"text": SENTENCE}).json()["verification"]
        assert v["passed"] is False and v["failed_layers"] == [1] and "layer 1" in v["message"]
    finally:
        with torch.no_grad():
            w.copy_(saved)
    res = verify(fw.tensors.attn_input, fw.pattern, fw.tensors.attn_output, all_params(rt))
    assert res["passed"]


def test_output_projection_is_checked(fresh_gpt2):
    rt = fresh_gpt2
    fw = rt.forward_many([rt.tokenize(SENTENCE)])[0]
    b = rt.adapter.base().h[0].attn.c_proj.bias
    saved = b.detach().clone()
    try:
        with torch.no_grad():
            b[5] += 1e-3
        res = verify(fw.tensors.attn_input, fw.pattern, fw.tensors.attn_output, all_params(rt))
    finally:
        with torch.no_grad():
            b.copy_(saved)
    lyr0 = res["layers"][0]
    assert not res["passed"] and res["failed_layers"] == [0]
    assert lyr0["pattern_max_abs_diff"] <= 1e-5 and lyr0["output_max_abs_diff"] > 5e-4
    assert "output differs" in res["message"]


def test_nan_fails_never_passes(fresh_gpt2, make_client):
    rt = fresh_gpt2
    fw = rt.forward_many([rt.tokenize(SENTENCE)])[0]
    b = rt.adapter.base().h[0].attn.c_attn.bias
    saved = b.detach().clone()
    c = make_client(rt)
    try:
        with torch.no_grad():
            b[3] = float("nan")  # a query bias of head 0 in layer 0
        res = verify(fw.tensors.attn_input, fw.pattern, fw.tensors.attn_output, all_params(rt))
        r = c.post(URL, json={"text": SENTENCE})
    finally:
        with torch.no_grad():
            b.copy_(saved)
    assert not res["passed"] and res["max_abs_diff"] is None and res["failed_layers"] == [0]
    assert res["layers"][0]["heads"][0]["pattern_max_abs_diff"] is None and "NaN" in res["message"]
    assert res["layers"][1]["passed"]
    assert r.status_code == 200
    v = r.json()["verification"]
    assert v["passed"] is False and v["max_abs_diff"] is None
    # a NaN in the recorded pattern fails too, even with a huge tolerance
    bad = fw.pattern.clone()
    bad[1, 2, 3, 0] = float("nan")
    res = verify(fw.tensors.attn_input, bad, fw.tensors.attn_output, all_params(rt), tolerance=1.0)
    assert not res["passed"] and res["failed_layers"] == [1]


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
    res = verify(fw.tensors.attn_input, fw.pattern, fw.tensors.attn_output, params)
    assert res["passed"], res["message"]
    # negative control: ignoring the switches (plain 1/sqrt(d_head) everywhere) is detected
    plain = {lyr: dataclasses.replace(p, scaling=rt.adapter.d_head ** -0.5) for lyr, p in params.items()}
    res = verify(fw.tensors.attn_input, fw.pattern, fw.tensors.attn_output, plain)
    expect = [1, 2] if switches["scale_attn_by_inverse_layer_idx"] else [0, 1, 2]
    assert not res["passed"] and res["failed_layers"] == expect
