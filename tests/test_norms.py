"""Value-weighted norms (Kobayashi et al. 2020): service.analysis.norms and POST
/v1/attention-norms, against an einsum over Hugging Face's own eager attentions and the
modules' weights, written here independently of the service (the attention input and output are
hooked on Hugging Face's modules in this file; weights are read from the modules by name)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnscope.service.analysis import norms as N

from conftest import SENTENCE, minilm_dir  # noqa: F401

TEXTS = [SENTENCE, "The cat sat on the mat. The cat sat on the mat again, and again."]


# ----------------------------------------------------------------- the independent reference
def hf_layers(model, family: str, ids: list[int]) -> list[dict]:
    """One Hugging Face eager forward of ``ids``; per layer, float64 numpy: ``pattern``
    ``[head, q, k]`` (output_attentions), ``x`` the attention input ``[T, D]`` (GPT-2: ln_1's
    output; BERT: the layer's input hidden state), ``y`` the attention module's output after
    the output projection ``[T, D]`` (GPT-2 c_proj's, BERT attention.output.dense's output),
    and the weights read from the modules in ``y = x @ W + b`` form."""
    base = getattr(model, "transformer", None) or getattr(model, "bert", model)
    caught: dict = {}
    hooks = []
    if family == "gpt2":
        blocks = list(base.h)
        for i, b in enumerate(blocks):
            hooks.append(b.ln_1.register_forward_hook(lambda m, a, o, i=i: caught.__setitem__(("x", i), o)))
            hooks.append(b.attn.c_proj.register_forward_hook(
                lambda m, a, o, i=i: caught.__setitem__(("y", i), o)))
    else:
        blocks = list(base.encoder.layer)
        for i, b in enumerate(blocks):
            hooks.append(b.attention.output.dense.register_forward_hook(
                lambda m, a, o, i=i: caught.__setitem__(("y", i), o)))
    kw = {"token_type_ids": torch.zeros(1, len(ids), dtype=torch.long)} if family == "bert" else {}
    try:
        with torch.no_grad():
            out = base(input_ids=torch.tensor([ids]), output_attentions=True,
                       output_hidden_states=True, **kw)
    finally:
        for h in hooks:
            h.remove()
    D = model.config.hidden_size
    res = []
    for i, b in enumerate(blocks):
        if family == "gpt2":
            W, bias = b.attn.c_attn.weight, b.attn.c_attn.bias  # Conv1D [D, 3D]: q | k | v
            W_v, b_v = W[:, 2 * D:], bias[2 * D:]
            W_o, b_o = b.attn.c_proj.weight, b.attn.c_proj.bias  # Conv1D [D, D]
            x = caught[("x", i)][0]
        else:
            W_v, b_v = b.attention.self.value.weight.t(), b.attention.self.value.bias
            W_o, b_o = b.attention.output.dense.weight.t(), b.attention.output.dense.bias
            x = out.hidden_states[i][0]
        d = {"pattern": out.attentions[i][0], "x": x, "y": caught[("y", i)][0],
             "W_v": W_v, "b_v": b_v, "W_o": W_o, "b_o": b_o}
        res.append({k: v.detach().double().numpy() for k, v in d.items()})
    return res


def ref_vectors(lay: dict, H: int, value_bias=True, distribute=False) -> np.ndarray:
    """``alpha^h_qk f_h(x_k)`` [head, q, k, D] by einsum, f_h(x) = (x W_V^h + b_V^h) W_O^h."""
    T, D = lay["x"].shape
    dh = D // H
    v = lay["x"] @ lay["W_v"] + (lay["b_v"] if value_bias else 0.0)  # [T, H*dh]
    v = v.reshape(T, H, dh)
    W_o = lay["W_o"].reshape(H, dh, D)
    f = np.einsum("khe,hed->hkd", v, W_o, optimize=True)  # [H, k, D]
    if distribute:
        f = f + lay["b_o"] / H
    return np.einsum("hqk,hkd->hqkd", lay["pattern"], f)


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def gpt2_small_runtime():
    """A randomly initialised GPT-2-small-shaped model (12 layers x 12 heads, d_model 768;
    the bundled tokenizer's 2048-token vocabulary)."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from attnscope.service.config import BUNDLED_MODEL_DIR, Settings
    from attnscope.service.runtime import Runtime
    from attnscope.service.runtime.adapters import ADAPTERS

    cfg = GPT2Config(vocab_size=2048)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    return Runtime(model, tok, ADAPTERS["gpt2"](model), {"id": "random-gpt2-small", "revision": "none"},
                   Settings(model="bundled"))


@pytest.fixture(params=["gpt2", "minilm", "gpt2_small"])
def any_runtime(request):
    name = {"gpt2": "gpt2_runtime", "minilm": "bert_runtime", "gpt2_small": "gpt2_small_runtime"}
    return request.getfixturevalue(name[request.param])


def _ours(rt, fw, layer, **kw):
    p = rt.adapter.attention_params(layer)
    return N.layer_norms(fw.pattern[layer], fw.tensors.v[layer], p.W_o, p.b_v, p.b_o, **kw)


# --------------------------------------------------------------------------------- tests
def test_norms_equal_an_einsum_over_hugging_face(any_runtime):
    rt = any_runtime
    H = rt.adapter.n_heads
    texts = TEXTS[:1] if rt.adapter.n_layers > 6 else TEXTS  # GPT-2 small shape: one text
    for text in texts:
        tt = rt.tokenize(text)
        fw = rt.forward_many([tt])[0]
        ref = hf_layers(rt.model, rt.adapter.family, list(tt.input_ids))
        for layer, lay in enumerate(ref):
            vec = ref_vectors(lay, H)  # [H, q, k, D]
            # 1. the vector identity, before any norm: contributions sum, over keys and heads,
            #    to the attention module's output minus the output-projection bias
            scale = np.abs(lay["y"]).max()
            np.testing.assert_allclose(vec.sum((0, 2)), lay["y"] - lay["b_o"], atol=1e-5 * scale)
            p = rt.adapter.attention_params(layer)
            f = N.transformed_values(fw.tensors.v[layer], p.W_o)
            ours_vec = N.contribution_vectors(fw.pattern[layer], f).double().numpy()  # [q, k, D]
            np.testing.assert_allclose(ours_vec.sum(1), lay["y"] - lay["b_o"], atol=1e-5 * scale)
            np.testing.assert_allclose(ours_vec, vec.sum(0), atol=1e-5 * scale)
            # 2. the norms
            got = _ours(rt, fw, layer)
            np.testing.assert_allclose(got.head.numpy(), np.linalg.norm(vec, axis=-1), atol=1e-5)
            np.testing.assert_allclose(got.summed.numpy(), np.linalg.norm(vec.sum(0), axis=-1),
                                       atol=1e-5)
            dh = lay["x"].shape[1] // H
            v = (lay["x"] @ lay["W_v"] + lay["b_v"]).reshape(-1, H, dh)
            f_ref = np.einsum("khe,hed->hkd", v, lay["W_o"].reshape(H, dh, -1), optimize=True)
            np.testing.assert_allclose(got.value.numpy(), np.linalg.norm(f_ref, axis=-1), atol=1e-5)


def test_bias_options_and_head_selection(gpt2_runtime):
    rt = gpt2_runtime
    H = rt.adapter.n_heads
    tt = rt.tokenize(SENTENCE)
    fw = rt.forward_many([tt])[0]
    ref = hf_layers(rt.model, "gpt2", list(tt.input_ids))
    for layer, lay in enumerate(ref):
        # value bias excluded: f_h(x) = x W_V^h W_O^h
        vec = ref_vectors(lay, H, value_bias=False)
        got = _ours(rt, fw, layer, value_bias="exclude")
        np.testing.assert_allclose(got.head.numpy(), np.linalg.norm(vec, axis=-1), atol=1e-5)
        np.testing.assert_allclose(got.summed.numpy(), np.linalg.norm(vec.sum(0), axis=-1), atol=1e-5)
        # output bias distributed by weight: the contributions then sum to y itself
        vec = ref_vectors(lay, H, distribute=True)
        np.testing.assert_allclose(vec.sum((0, 2)), lay["y"], atol=1e-5 * np.abs(lay["y"]).max())
        got = _ours(rt, fw, layer, output_bias="distribute")
        np.testing.assert_allclose(got.head.numpy(), np.linalg.norm(vec, axis=-1), atol=1e-5)
        np.testing.assert_allclose(got.summed.numpy(), np.linalg.norm(vec.sum(0), axis=-1), atol=1e-5)
        # a subset of heads, in the order given; summed over that subset
        heads = [2, 0]
        vec = ref_vectors(lay, H)[heads]
        got = _ours(rt, fw, layer, heads=heads)
        np.testing.assert_allclose(got.head.numpy(), np.linalg.norm(vec, axis=-1), atol=1e-5)
        np.testing.assert_allclose(got.summed.numpy(), np.linalg.norm(vec.sum(0), axis=-1), atol=1e-5)
        assert got.value.shape == (2, len(tt))


def test_planted_fault_is_caught():
    """The comparison can fail: the norms of a mis-sliced W_O (head 0 reads head 1's rows)
    differ from the reference computed with the right slices."""
    g = torch.Generator().manual_seed(0)
    H, T, dh, D = 3, 5, 4, 12
    v = torch.randn(H, T, dh, generator=g)
    W_o = torch.randn(H * dh, D, generator=g)
    a = torch.randn(H, T, T, generator=g).softmax(-1)
    good = N.layer_norms(a, v, W_o)
    bad = W_o.clone()
    bad[:dh] = W_o[dh : 2 * dh]
    wrong = N.layer_norms(a, v, bad)
    assert not torch.allclose(good.summed, wrong.summed, atol=1e-5)
    assert not torch.allclose(good.head, wrong.head, atol=1e-5)
    # and the Gram path equals the direct vector norm on these hand-made tensors
    f = N.transformed_values(v, W_o)
    torch.testing.assert_close(good.summed, N.contribution_vectors(a, f).norm(dim=-1), atol=1e-5, rtol=0)


def test_bad_options_raise():
    v, W_o, a = torch.zeros(2, 3, 4), torch.zeros(8, 6), torch.full((2, 3, 3), 1 / 3)
    with pytest.raises(ValueError, match="value_bias"):
        N.layer_norms(a, v, W_o, value_bias="maybe")
    with pytest.raises(ValueError, match="output_bias"):
        N.layer_norms(a, v, W_o, output_bias="maybe")
    with pytest.raises(ValueError, match="needs b_o"):
        N.layer_norms(a, v, W_o, output_bias="distribute")
    with pytest.raises(ValueError, match="W_o"):
        N.layer_norms(a, v, torch.zeros(7, 6))


def test_minilm_special_tokens_get_more_weight_than_contribution(bert_runtime):
    """Kobayashi et al. 2020 (section 4): [CLS] and [SEP] receive a large share of BERT's
    attention weight but a smaller share of the contribution norm, layer by layer. Here: the
    share of each query row's head-mean weight on [CLS]/[SEP] vs the share of its head-summed
    norm ||sum_h alpha f|| on them, averaged over queries and over the texts."""
    rt = bert_runtime
    texts = TEXTS + ["A quick brown fox jumps over the lazy dog near the river bank."]
    L = rt.adapter.n_layers
    w_share, n_share = np.zeros(L), np.zeros(L)
    for text in texts:
        tt = rt.tokenize(text)
        fw = rt.forward_many([tt])[0]
        sp = [t.position for t in tt.tokens if t.special]
        assert sp == [0, len(tt) - 1]  # [CLS] ... [SEP]
        for layer in range(L):
            got = _ours(rt, fw, layer, per_head=False)
            w = fw.pattern[layer].double().mean(0)  # [q, k]
            n = got.summed.double()
            w_share[layer] += float(w[:, sp].sum(-1).mean()) / len(texts)
            n_share[layer] += float((n[:, sp].sum(-1) / n.sum(-1)).mean()) / len(texts)
    print("MiniLM weight share on [CLS]/[SEP] per layer:", np.round(w_share, 3).tolist())
    print("MiniLM norm share on [CLS]/[SEP] per layer:  ", np.round(n_share, 3).tolist())
    assert (w_share > n_share).all(), (w_share, n_share)
