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
from attnscope.service.analysis.verify_recorded import AttentionParams

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
    p = AttentionParams.of(rt.adapter, layer)
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
            p = AttentionParams.of(rt.adapter, layer)
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


@pytest.mark.parametrize("value_bias, distribute", [("include", False), ("exclude", True)])
def test_norms_without_f_equal_the_norms_of_f(gpt2_runtime, value_bias, distribute):
    """summed=False takes value_norms' quadratic form (no f built): same numbers."""
    rt = gpt2_runtime
    fw = rt.forward_many([rt.tokenize(SENTENCE)])[0]
    ob = "distribute" if distribute else "exclude"
    for layer in range(rt.adapter.n_layers):
        full = _ours(rt, fw, layer, value_bias=value_bias, output_bias=ob)
        quick = _ours(rt, fw, layer, value_bias=value_bias, output_bias=ob, summed=False)
        assert quick.summed is None
        torch.testing.assert_close(quick.value, full.value, atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(quick.head, full.head, atol=1e-5, rtol=1e-6)


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


# ------------------------------------------------------------------------- the endpoint
SAFETENSORS = "application/x-safetensors"


def _wire():
    from attnscope.client import wire

    return wire


def test_endpoint_equals_the_reference_in_every_encoding(client, gpt2_runtime):
    from attnscope.schemas import NormsResponse

    wire = _wire()
    rt = gpt2_runtime
    H = rt.adapter.n_heads
    # the reference on the tokens the response reports (add_bos null: BOS first for GPT-2)
    tt = rt.tokenize(SENTENCE, add_bos=True)
    ref = hf_layers(rt.model, "gpt2", list(tt.input_ids))
    want_head = np.stack([np.linalg.norm(ref_vectors(lay, H), axis=-1) for lay in ref])
    want_sum = np.stack([np.linalg.norm(ref_vectors(lay, H).sum(0), axis=-1) for lay in ref])
    r = client.post("/v1/attention-norms", json={"text": SENTENCE})
    assert r.status_code == 200, r.text
    body = NormsResponse.model_validate(r.json())
    res = body.norms
    assert [t.id for t in res.tokens] == list(tt.input_ids)
    assert body.value_bias == "include" and body.output_bias == "exclude"
    np.testing.assert_allclose(wire.decode_tensor(res.norms), want_head, atol=1e-5)
    np.testing.assert_allclose(wire.decode_tensor(res.summed), want_sum, atol=1e-5)
    vn = wire.decode_tensor(res.value_norms)
    assert vn.shape == (rt.adapter.n_layers, H, len(tt))
    dense = {"norms": want_head, "summed": want_sum}
    # base64 float32 / float16, 'tril' in json and base64, sparse, safetensors
    for opts in ({"encoding": "base64"}, {"encoding": "base64", "dtype": "float16"},
                 {"layout": "tril"}, {"encoding": "base64", "layout": "tril"},
                 {"sparse": {"top_k": 3}}, {"sparse": {"threshold": 0.5, "format": "coo"}}):
        r = client.post("/v1/attention-norms", json={"text": SENTENCE, **opts})
        assert r.status_code == 200, (opts, r.text)
        got = r.json()["norms"]
        tol = 1e-2 * want_sum.max() if opts.get("dtype") == "float16" else 1e-5
        for name, want in dense.items():
            a = wire.decode_tensor(got[name])
            if "sparse" in opts:
                keep = a > 0
                assert keep.any()
                np.testing.assert_allclose(a[keep], want[keep], atol=1e-5)
                sp = opts["sparse"]
                if "top_k" in sp:
                    assert (keep.sum(-1) <= sp["top_k"]).all()
                else:
                    assert (a[keep] >= sp["threshold"]).all()
                    assert ((want >= sp["threshold"] + 1e-5) <= keep).all()
            else:
                np.testing.assert_allclose(a, want, atol=tol)
    r = client.post("/v1/attention-norms", json={"text": SENTENCE}, headers={"accept": SAFETENSORS})
    assert r.status_code == 200 and r.headers["content-type"] == SAFETENSORS
    got = wire.decode_binary_response(r.content)["norms"]
    np.testing.assert_allclose(got["norms"], want_head, atol=1e-5)
    np.testing.assert_allclose(got["summed"], want_sum, atol=1e-5)
    np.testing.assert_allclose(got["value_norms"], vn, atol=1e-6)


def test_endpoint_options_and_batches(client, gpt2_runtime):
    wire = _wire()
    rt = gpt2_runtime
    H = rt.adapter.n_heads
    r = client.post("/v1/attention-norms", json={
        "texts": TEXTS, "layers": [1], "heads": [3, 1], "per_head": False, "value_norms": False,
        "output_bias": "distribute", "value_bias": "exclude"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output_bias"] == "distribute" and body["value_bias"] == "exclude"
    for text, res in zip(TEXTS, body["results"]):
        assert res["norms"] is None and res["value_norms"] is None
        assert res["layers"] == [1] and res["heads"] == [3, 1]
        # the reference on the tokens the response reports (BOS first by default)
        ids = list(rt.tokenize(text, add_bos=True).input_ids)
        assert [t["id"] for t in res["tokens"]] == ids
        ref = hf_layers(rt.model, "gpt2", ids)
        vec = ref_vectors(ref[1], H, value_bias=False, distribute=True)[[3, 1]]
        np.testing.assert_allclose(wire.decode_tensor(res["summed"])[0],
                                   np.linalg.norm(vec.sum(0), axis=-1), atol=1e-5)


def test_minilm_endpoint(bert_client, bert_runtime):
    wire = _wire()
    rt = bert_runtime
    tt = rt.tokenize(SENTENCE)
    ref = hf_layers(rt.model, "bert", list(tt.input_ids))
    r = bert_client.post("/v1/attention-norms", json={"text": SENTENCE, "encoding": "base64"})
    assert r.status_code == 200, r.text
    got = wire.decode_tensor(r.json()["norms"]["summed"])
    want = np.stack([np.linalg.norm(ref_vectors(lay, rt.adapter.n_heads).sum(0), axis=-1) for lay in ref])
    np.testing.assert_allclose(got, want, atol=1e-5)
    from conftest import assert_error

    assert_error(bert_client.post("/v1/attention-norms", json={"text": SENTENCE, "layout": "tril"}),
                 422, "validation_error", "layout")


def test_bad_input_gets_a_named_4xx(client):
    from conftest import assert_error

    post = lambda **kw: client.post("/v1/attention-norms", json={"text": SENTENCE, **kw})  # noqa: E731
    e = assert_error(post(heads=[]), 422, "out_of_range", "heads")
    assert "at least one" in e["message"]
    assert_error(post(layers=[0, 9]), 422, "out_of_range", "layers.1")
    assert_error(post(heads=[1, 1]), 422, "validation_error", "heads.1")
    assert_error(post(value_bias="sometimes"), 422, "validation_error", "value_bias")
    assert_error(post(output_bias="keep"), 422, "validation_error", "output_bias")
    e = assert_error(post(per_head=False, summed=False, value_norms=False), 422, "validation_error")
    assert "nothing to return" in e["message"]
    assert client.post("/v1/attention-norms", json={"text": SENTENCE}).status_code == 200  # still serving


def test_memory_estimate_covers_the_norms_before_any_forward(make_client, gpt2_runtime):
    """A limit the forward fits under but the forward plus the norms do not: 422
    memory_limit_exceeded, and no forward ran; /v1/attention of the same text still passes."""
    from conftest import assert_error

    from attnscope.schemas import NormsRequest
    from attnscope.service.serving.core.memory import forward_bytes
    from attnscope.service.serving import norms as serving

    rt = gpt2_runtime
    text = "A fresh text for the memory check, never analysed before. " * 3
    T = len(rt.tokenize(text))
    a = rt.adapter
    fwd = forward_bytes(a.n_layers, a.n_heads, a.d_model, [T], 4, rt.settings.forward_batch_size)
    extra = serving.estimate(rt, NormsRequest(text=text), [T], "json")
    small = serving.estimate(rt, NormsRequest(text=text, layers=[0], per_head=False,
                                              value_norms=False), [T], "json")
    assert 0 < small < extra
    limit = fwd + (extra + small) // 2  # between the two requests' estimates
    c = make_client(rt, max_request_bytes=limit)
    before = rt.forward_count
    e = assert_error(c.post("/v1/attention-norms", json={"text": text}), 422, "memory_limit_exceeded")
    assert str(limit) in e["message"]
    assert rt.forward_count == before  # refused before any forward
    # the estimate follows the request: one layer, summed only, fits
    r = c.post("/v1/attention-norms", json={"text": text, "layers": [0], "per_head": False,
                                            "value_norms": False})
    assert r.status_code == 200, r.text


# ----------------------------------------------------------- /v1/links by norm, /v1/heads
def test_links_by_norm_rank_by_the_reference_norm(client, gpt2_runtime):
    rt = gpt2_runtime
    H = rt.adapter.n_heads
    # the reference on the tokens the response reports (add_bos null: BOS first for GPT-2)
    tt = rt.tokenize(SENTENCE, add_bos=True)
    ref = hf_layers(rt.model, "gpt2", list(tt.input_ids))
    for head in (None, 2):
        r = client.post("/v1/links", json={"text": SENTENCE, "layer": 1, "head": head, "by": "norm",
                                           "top_k": 2})
        assert r.status_code == 200, r.text
        assert [t["id"] for t in r.json()["links"]["tokens"]] == list(tt.input_ids)
        assert r.json()["by"] == "norm"
        vec = ref_vectors(ref[1], H)
        n = np.linalg.norm(vec.sum(0) if head is None else vec[head], axis=-1)
        w = ref[1]["pattern"].mean(0) if head is None else ref[1]["pattern"][head]
        differs = 0
        for ql in r.json()["links"]["links"]:
            q = ql["query_pos"]
            cand = n[q, :q].copy()  # earlier keys, self excluded
            order = np.argsort(-cand, kind="stable")[:2]
            assert [lk["key_pos"] for lk in ql["links"]] == order.tolist()
            for lk in ql["links"]:
                assert lk["norm"] == pytest.approx(n[q, lk["key_pos"]], abs=1e-4)
                assert lk["weight"] == pytest.approx(w[q, lk["key_pos"]], abs=1e-6)
            differs += int(order[0] != np.argmax(w[q, :q]))
        assert differs > 0  # on this text the norm ranking is not the weight ranking
    r = client.post("/v1/links", json={"text": SENTENCE, "layer": 1})
    assert r.json()["by"] == "weight"
    assert all("norm" not in lk for ql in r.json()["links"]["links"] for lk in ql["links"])


def test_noop_scores_on_hand_made_tensors():
    """Weight on the sink whose value vector is 0 is all 'no-op'; on a sink whose vector is
    as large as the others it is not counted."""
    a = torch.tensor([[[1.0, 0, 0], [0.8, 0.2, 0], [0.6, 0.2, 0.2]]])  # [head, q, k]
    s = N.noop_scores(a, torch.tensor([[0.0, 1.0, 1.0]]))  # ||f(x_0)|| = 0
    # row 0 has no norm at all (share 0 < weight 1): counted; rows 1, 2: share 0 < 0.8, 0.6
    assert s["noop"].item() == pytest.approx((1.0 + 0.8 + 0.6) / 3)
    assert s["sink_norm_share"].item() == 0.0
    s = N.noop_scores(a, torch.full((1, 3), 2.0))  # every ||f|| = 2: norm share = weight share
    assert s["noop"].item() == 0.0
    assert s["sink_norm_share"].item() == pytest.approx((1.0 + 0.8 + 0.6) / 3)
    s = N.noop_scores(a, torch.tensor([[1.0, 4.0, 4.0]]))  # a small sink vector
    share = torch.tensor([1.0, 0.8 / (0.8 + 0.8), 0.6 / (0.6 + 1.6)])
    assert s["sink_norm_share"].item() == pytest.approx(share.mean().item())
    assert s["noop"].item() == pytest.approx((0.8 + 0.6) / 3)  # rows 1, 2 (row 0: 1 = 1)


def test_heads_norm_scores_equal_the_reference(bert_client, bert_runtime):
    rt = bert_runtime
    H = rt.adapter.n_heads
    r = bert_client.post("/v1/heads", json={"texts": TEXTS})
    assert r.status_code == 200, r.text
    got = {(h["layer"], h["head"]): h["norm_scores"] for h in r.json()["heads"]}
    want = {}
    for text in TEXTS:
        ref = hf_layers(rt.model, "bert", list(rt.tokenize(text).input_ids))
        for layer, lay in enumerate(ref):
            n = np.linalg.norm(ref_vectors(lay, H), axis=-1)  # [head, q, k]
            w0 = lay["pattern"][:, :, 0]
            share = n[:, :, 0] / n.sum(-1)
            for h in range(H):
                noop = np.where(share[h] < w0[h] - 1e-6, w0[h], 0).mean()
                acc = want.setdefault((layer, h), [0.0, 0.0])
                acc[0] += noop / len(TEXTS)
                acc[1] += share[h].mean() / len(TEXTS)
    for key, (noop, share) in want.items():
        assert got[key]["noop"] == pytest.approx(noop, abs=1e-5), key
        assert got[key]["sink_norm_share"] == pytest.approx(share, abs=1e-5), key
    # a MiniLM sink head parks weight on [CLS] that contributes little
    assert max(v["noop"] for v in got.values()) > 0.5
    off = bert_client.post("/v1/heads", json={"text": SENTENCE, "norm_scores": False}).json()
    assert all(h.get("norm_scores") is None for h in off["heads"])


def test_heads_norm_scores_follow_a_weight_change(client, gpt2_runtime):
    """W_O W_O^T is kept between requests: an in-place change of the output projection must
    not leave the scores on the old weights (a planted fault for the cache key)."""
    rt = gpt2_runtime
    fw = rt.forward_many([rt.tokenize(SENTENCE)])[0]

    def direct(layer):
        p = AttentionParams.of(rt.adapter, layer)
        vn = N.value_norms(fw.tensors.v[layer], p.W_o)  # no kept Gram
        return N.noop_scores(fw.pattern[layer], vn)["sink_norm_share"]

    def served():
        r = client.post("/v1/heads", json={"text": SENTENCE, "add_bos": False,
                                           "probe": {"enabled": False}})
        assert r.status_code == 200, r.text
        return {(h["layer"], h["head"]): h["norm_scores"]["sink_norm_share"] for h in r.json()["heads"]}

    before = served()
    W = rt.model.transformer.h[1].attn.c_proj.weight
    saved = W.detach().clone()
    g = torch.Generator().manual_seed(1)
    try:
        with torch.no_grad():
            W.add_(torch.randn(W.shape, generator=g) * W.abs().mean())
        after = served()
        want = direct(1)
        for h in range(rt.adapter.n_heads):
            assert after[(1, h)] == pytest.approx(want[h].item(), abs=1e-6)
        assert any(abs(after[(1, h)] - before[(1, h)]) > 1e-4 for h in range(rt.adapter.n_heads))
    finally:
        with torch.no_grad():
            W.copy_(saved)
    assert served() == pytest.approx(before)
