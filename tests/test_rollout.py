"""Attention rollout and flow (Abnar & Zuidema 2020): service.analysis.rollout and POST
/v1/rollout, against the authors' formula written here in numpy over Hugging Face's own
attentions, and against networkx maximum_flow run here on a layered graph built in this file."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
import torch

from attnscope.service.analysis import rollout as RO

from conftest import SENTENCE

SHORT = ["The cat sat on the mat.", "Alice gave Bob a book.", "It rains."]


def hf_attentions(rt, text: str, add_bos: bool = False) -> np.ndarray:
    """Hugging Face's eager ``output_attentions`` of one text, float64 ``[layer, head, q, k]``
    (``add_bos``: BOS first, as the endpoint's default for GPT-2)."""
    tt = rt.tokenize(text, add_bos=add_bos)
    ids = torch.tensor([list(tt.input_ids)])
    kw = {"token_type_ids": torch.zeros_like(ids)} if rt.adapter.family == "bert" else {}
    base = getattr(rt.model, "transformer", None) or getattr(rt.model, "bert", rt.model)
    with torch.no_grad():
        out = base(input_ids=ids, output_attentions=True, **kw)
    return torch.stack([a[0] for a in out.attentions]).double().numpy()


def authors_joint_attention(att_mat: np.ndarray) -> np.ndarray:
    """The paper's rollout: residual added, rows renormalised, products over layers
    (att_mat: the head mean per layer, [layer, T, T])."""
    aug = att_mat + np.eye(att_mat.shape[1])[None]
    aug = aug / aug.sum(axis=-1)[..., None]
    joint = np.zeros(aug.shape)
    joint[0] = aug[0]
    for i in range(1, aug.shape[0]):
        joint[i] = aug[i].dot(joint[i - 1])
    return joint


def np_augmented(att, causal, fusion="mean", w=0.5, discard=0.0, sink="keep"):
    """The documented steps in numpy (fusion, sink drop, discard, residual, row norm)."""
    F = {"mean": att.mean(1), "max": att.max(1), "min": att.min(1)}[fusion].copy()
    L, T, _ = F.shape
    cand = np.tril(np.ones((T, T), bool)) if causal else np.ones((T, T), bool)
    if sink == "drop":
        F[:, 1:, 0] = 0
        cand[1:, 0] = False
    idx = np.flatnonzero(cand)
    n = int(discard * len(idx))
    for layer in range(L):
        flat = F[layer].reshape(-1)
        order = np.argsort(flat[idx], kind="stable")
        flat[idx[order[:n]]] = 0
    A = (1 - w) * F + w * np.eye(T)
    s = A.sum(-1, keepdims=True)
    A = np.where(s > 0, A, np.eye(T))
    return A / A.sum(-1, keepdims=True)


def np_rollout(aug):
    out, acc = [], None
    for a in aug:
        acc = a if acc is None else a @ acc
        out.append(acc)
    return np.stack(out)


def nx_flow(aug: np.ndarray, top: int) -> np.ndarray:
    """Flow of layer ``top``'s outputs to the inputs: adjacency over (L+1)*T nodes, edge from
    node (l, q) to (l-1, k) with capacity aug[l-1][q, k], networkx Edmonds-Karp (another
    algorithm than the service's preflow-push), rows normalised."""
    L, T, _ = aug.shape
    adj = np.zeros(((L + 1) * T, (L + 1) * T))
    for i in range(1, L + 1):
        for kf in range(T):
            for kt in range(T):
                adj[i * T + kf, (i - 1) * T + kt] = aug[i - 1][kf][kt]
    G = nx.from_numpy_array(adj, create_using=nx.DiGraph(), edge_attr="capacity")
    out = np.zeros((T, T))
    for q in range(T):
        for k in range(T):
            out[q, k] = nx.maximum_flow_value(G, (top + 1) * T + q, k, capacity="capacity",
                                              flow_func=nx.algorithms.flow.edmonds_karp)
    return out / out.sum(-1, keepdims=True)


@pytest.fixture(params=["gpt2", "minilm"])
def rt(request):
    return request.getfixturevalue({"gpt2": "gpt2_runtime", "minilm": "bert_runtime"}[request.param])


def _pattern(rt, text):
    return rt.forward_many([rt.tokenize(text)])[0].pattern


def test_rollout_equals_the_authors_formula(rt):
    causal = rt.adapter.causal
    for text in [SENTENCE, *SHORT]:
        att = hf_attentions(rt, text)
        ours = RO.rollout(RO.augmented_matrices(_pattern(rt, text), causal)).numpy()
        ref = authors_joint_attention(att.mean(1))
        np.testing.assert_allclose(ours, ref, atol=1e-6, rtol=0)
        np.testing.assert_allclose(ours.sum(-1), 1.0, atol=1e-12)
        if causal:
            assert np.triu(ours, 1).max() == 0.0  # never weight on a later token
        # the comparison discriminates: the product in the wrong order is not the rollout
        aug = np_augmented(att, causal)
        wrong = aug[0]
        for a in aug[1:]:
            wrong = wrong @ a  # R_{l-1} Â_l instead of Â_l R_{l-1}
        assert np.abs(wrong - ref[-1]).max() > 1e-3


@pytest.mark.parametrize("fusion, w, discard, sink", [
    ("max", 0.5, 0.0, "keep"), ("min", 0.5, 0.0, "keep"), ("mean", 0.2, 0.0, "keep"),
    ("mean", 0.5, 0.9, "keep"), ("max", 0.3, 0.5, "drop"), ("mean", 0.0, 0.0, "drop"),
    ("mean", 0.0, 0.95, "keep"), ("mean", 1.0, 0.0, "keep"),
])
def test_rollout_options_equal_numpy(rt, fusion, w, discard, sink):
    causal = rt.adapter.causal
    att = hf_attentions(rt, SENTENCE)
    aug = RO.augmented_matrices(_pattern(rt, SENTENCE), causal, fusion, w, discard, sink)
    ref_aug = np_augmented(att, causal, fusion, w, discard, sink)
    np.testing.assert_allclose(aug.numpy(), ref_aug, atol=1e-6, rtol=0)
    ours = RO.rollout(aug).numpy()
    np.testing.assert_allclose(ours, np_rollout(ref_aug), atol=1e-6, rtol=0)
    np.testing.assert_allclose(ours.sum(-1), 1.0, atol=1e-12)
    if causal:
        assert np.triu(ours, 1).max() == 0.0
    if sink == "drop" and w < 1:
        assert (aug[:, 1:, 0] == 0).all()  # every query >= 1 ignores the first token
    if w == 1.0:
        np.testing.assert_allclose(ours, np.broadcast_to(np.eye(att.shape[-1]), ours.shape))


def test_flow_equals_networkx_on_the_layered_graph(rt):
    causal = rt.adapter.causal
    for text in SHORT[1:]:
        pattern = _pattern(rt, text)
        aug = RO.augmented_matrices(pattern, causal)
        L = aug.shape[0]
        layers = [0, L - 1]
        ours = RO.attention_flow(aug, layers).numpy()
        for i, top in enumerate(layers):
            ref = nx_flow(aug.numpy(), top)
            np.testing.assert_allclose(ours[i], ref, atol=1e-6, rtol=0)
            np.testing.assert_allclose(ours[i].sum(-1), 1.0, atol=1e-9)
            if causal:
                assert np.triu(ours[i], 1).max() == 0.0
        # the last layer by default
        np.testing.assert_allclose(RO.attention_flow(aug).numpy()[0], ours[-1], atol=1e-12)
    # layer 0's flow is the first layer's capacities themselves (one hop, rows sum to 1)
    np.testing.assert_allclose(ours[0], aug[0].numpy(), atol=1e-9)


def test_bad_arguments_raise():
    p = torch.full((2, 2, 3, 3), 1 / 3)
    with pytest.raises(ValueError, match="fusion"):
        RO.augmented_matrices(p, False, fusion="median")
    with pytest.raises(ValueError, match="discard"):
        RO.augmented_matrices(p, False, discard=1.0)
    with pytest.raises(ValueError, match="residual"):
        RO.augmented_matrices(p, False, residual=1.5)
    with pytest.raises(ValueError, match="sink"):
        RO.augmented_matrices(p, False, sink="hide")
    big = torch.full((1, 1, 20, 20), 1 / 20)
    with pytest.raises(ValueError, match="limited to 16 tokens"):
        RO.attention_flow(RO.augmented_matrices(big, False))


# ------------------------------------------------------------------------- the endpoint
def test_endpoint_equals_the_authors_formula_and_networkx(client, gpt2_runtime):
    from attnscope.client import wire
    from attnscope.schemas import RolloutResponse

    rt = gpt2_runtime
    text = SHORT[0]
    # the reference on the tokens the response reports (add_bos null: BOS first for GPT-2)
    att = hf_attentions(rt, text, add_bos=True)
    ref = authors_joint_attention(att.mean(1))
    r = client.post("/v1/rollout", json={"text": text, "flow": True})
    assert r.status_code == 200, r.text
    body = RolloutResponse.model_validate(r.json())
    assert body.add_bos is True
    assert [t.id for t in body.rollout.tokens] == list(rt.tokenize(text, add_bos=True).input_ids)
    assert body.flow_max_tokens == RO.FLOW_MAX_TOKENS and body.fusion == "mean"
    res = body.rollout
    np.testing.assert_allclose(wire.decode_tensor(res.rollout), ref, atol=1e-6)
    assert res.flow_layers == [rt.adapter.n_layers - 1]
    aug = np_augmented(att, True)
    np.testing.assert_allclose(wire.decode_tensor(res.flow)[0], nx_flow(aug, len(aug) - 1), atol=1e-6)
    # every wire form gives the same rollout
    for opts, tol in (({"encoding": "base64"}, 1e-6), ({"layout": "tril"}, 1e-6),
                      ({"encoding": "base64", "dtype": "float16", "layout": "tril"}, 1e-3)):
        got = client.post("/v1/rollout", json={"text": text, **opts}).json()["rollout"]
        np.testing.assert_allclose(wire.decode_tensor(got["rollout"]), ref, atol=tol)
    got = client.post("/v1/rollout", json={"text": text, "sparse": {"top_k": 2}}).json()["rollout"]
    sp = got["rollout"]
    dense = wire.decode_tensor(sp)
    keep = dense > 0
    np.testing.assert_allclose(dense[keep], ref[keep], atol=1e-6)
    np.testing.assert_allclose(wire.decode_tensor(sp["row_mass"]), dense.sum(-1), atol=1e-6)
    r = client.post("/v1/rollout", json={"text": text, "flow": True},
                    headers={"accept": "application/x-safetensors"})
    got = wire.decode_binary_response(r.content)["rollout"]
    np.testing.assert_allclose(got["rollout"], ref, atol=1e-6)
    assert got["flow"].shape == (1, len(aug[0]), len(aug[0]))


def test_endpoint_options_batches_and_encoder(client, bert_client, gpt2_runtime, bert_runtime):
    from attnscope.client import wire

    opts = {"fusion": "max", "residual": 0.3, "discard": 0.5, "sink": "drop"}
    r = client.post("/v1/rollout", json={"texts": SHORT[:2], "layers": [1, 0], **opts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert {k: body[k] for k in opts} == opts
    for text, res in zip(SHORT, body["results"]):
        # the reference on the tokens the response reports (BOS first by default)
        assert [t["id"] for t in res["tokens"]] == list(gpt2_runtime.tokenize(text, True).input_ids)
        want = np_rollout(np_augmented(hf_attentions(gpt2_runtime, text, add_bos=True), True, "max",
                                       0.3, 0.5, "drop"))
        assert res["layers"] == [1, 0] and res["flow"] is None
        np.testing.assert_allclose(wire.decode_tensor(res["rollout"]), want[[1, 0]], atol=1e-6)
    text = SHORT[1]
    r = bert_client.post("/v1/rollout", json={"text": text, "flow": True, "flow_layers": [0, 2]})
    assert r.status_code == 200, r.text
    res = r.json()["rollout"]
    att = hf_attentions(bert_runtime, text)
    np.testing.assert_allclose(wire.decode_tensor(res["rollout"]), authors_joint_attention(att.mean(1)),
                               atol=1e-6)
    aug = np_augmented(att, False)
    flow = wire.decode_tensor(res["flow"])
    for i, top in enumerate([0, 2]):
        np.testing.assert_allclose(flow[i], nx_flow(aug, top), atol=1e-6)


def test_bad_input_gets_a_named_4xx(client, bert_client, gpt2_runtime):
    from conftest import assert_error

    post = lambda **kw: client.post("/v1/rollout", json={"text": SENTENCE, **kw})  # noqa: E731
    long_text = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    n = len(gpt2_runtime.tokenize(long_text, add_bos=True))  # as analysed: BOS first by default
    assert n > RO.FLOW_MAX_TOKENS
    before = gpt2_runtime.forward_count
    e = assert_error(client.post("/v1/rollout", json={"text": long_text, "flow": True}),
                     422, "validation_error", "flow")
    assert f"limited to {RO.FLOW_MAX_TOKENS} tokens" in e["message"] and f"{n} tokens" in e["message"]
    assert gpt2_runtime.forward_count == before  # refused before the forward
    e = assert_error(client.post("/v1/rollout", json={"texts": ["short", long_text], "flow": True}),
                     422, "validation_error", "flow")
    assert "texts.1" in e["message"]
    assert client.post("/v1/rollout", json={"text": long_text}).status_code == 200  # no flow: fine
    assert_error(post(fusion="median"), 422, "validation_error", "fusion")
    assert_error(post(discard=1.0), 422, "validation_error", "discard")
    assert_error(post(discard=-0.1), 422, "validation_error", "discard")
    assert_error(post(residual=1.5), 422, "validation_error", "residual")
    assert_error(post(sink="hide"), 422, "validation_error", "sink")
    assert_error(post(layers=[]), 422, "out_of_range", "layers")
    assert_error(post(layers=[5]), 422, "out_of_range", "layers.0")
    assert_error(post(flow_layers=[0]), 422, "validation_error", "flow_layers")
    assert_error(post(flow=True, flow_layers=[]), 422, "out_of_range", "flow_layers")
    assert_error(bert_client.post("/v1/rollout", json={"text": "hi", "layout": "tril"}),
                 422, "validation_error", "layout")
    assert post().status_code == 200  # still serving


def test_memory_estimate_covers_the_rollout_before_any_forward(make_client, gpt2_runtime):
    from conftest import assert_error

    from attnscope.schemas import RolloutRequest
    from attnscope.service.serving.core.memory import forward_bytes
    from attnscope.service.serving import rollout as serving

    rt = gpt2_runtime
    text = "Another fresh text for the rollout memory check, not seen before. " * 3
    T = len(rt.tokenize(text))
    a = rt.adapter
    fwd = forward_bytes(a.n_layers, a.n_heads, a.d_model, [T], 4, rt.settings.forward_batch_size)
    extra = serving.estimate(rt, RolloutRequest(text=text), [T], "json")
    c = make_client(rt, max_request_bytes=fwd + extra // 2)
    before = rt.forward_count
    assert_error(c.post("/v1/rollout", json={"text": text}), 422, "memory_limit_exceeded")
    assert rt.forward_count == before
