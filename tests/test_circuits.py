"""/v1/circuits against TransformerLens 4.3 and numpy.

* composition scores: TransformerLens ``all_composition_scores(mode)`` of the bridge booted with
  ``enable_compatibility_mode(no_processing=True)`` (raw weights, as served);
* copying scores: numpy eigenvalues of the full OV circuit, the d_vocab x d_vocab matrix
  ``W_E W_V W_O W_U`` (bundled model, vocab 2048, one head) and the d_model x d_model
  rotation ``W_V W_O W_U W_E`` (every head), sliced from Hugging Face's Conv1D weights here;
* singular values and Frobenius norms: numpy's SVD of the full d_model x d_model W_OV, W_QK.

Each to <= 1e-5, on the bundled model and (slow) a random GPT-2-small-shaped one (vocab 50257:
the service never builds a vocab x vocab matrix); a planted wrong head slice fails each.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnscope.service.serving import circuits as S
from conftest import _client

from interventions_reference import gpt2_small_dir

pytest.importorskip("transformer_lens")


def _bridge(path):
    from transformer_lens.model_bridge import TransformerBridge

    b = TransformerBridge.boot_transformers(str(path), device="cpu")
    b.enable_compatibility_mode(no_processing=True, disable_warnings=True)
    return b


class Ref:
    def __init__(self, path):
        from transformers import GPT2LMHeadModel

        self.hf = GPT2LMHeadModel.from_pretrained(str(path), attn_implementation="eager").eval()
        self.tl = _bridge(path)
        cfg = self.hf.config
        self.L, self.H, self.D = cfg.n_layer, cfg.n_head, cfg.n_embd
        self.dh = self.D // self.H
        self._comp: dict = {}

    def composition(self, mode, senders=None, receivers=None):
        """TL's all_composition_scores(mode) ``[layer, head, layer, head]``, computed once; with
        layer lists, TL's own ``utilities.composition_scores`` (the function
        all_composition_scores calls) on those senders' OV and receivers' QK / OV only, masked
        as TL masks (0 unless the receiver's layer is later): on GPT-2 small all 144 x 144
        pairs take TL ~70 s, a 4 x 3 block of layers ~6 s."""
        key = (mode, senders, receivers)
        if key not in self._comp:
            if senders is None:
                sc = self.tl.all_composition_scores(mode).scores
            else:
                from transformer_lens import utilities
                from transformer_lens.FactoredMatrix import FactoredMatrix

                tl, s, r = self.tl, list(senders), list(receivers)
                left = FactoredMatrix(tl.W_V[s], tl.W_O[s])
                qk = FactoredMatrix(tl.W_Q[r], tl.W_K[r].transpose(-2, -1))
                right = {"Q": qk, "K": qk.T, "V": FactoredMatrix(tl.W_V[r], tl.W_O[r])}[mode]
                sc = utilities.composition_scores(left, right, broadcast_dims=True)
                later = torch.tensor(s)[:, None, None, None] < torch.tensor(r)[None, None, :, None]
                sc = torch.where(later, sc, torch.zeros_like(sc))
            self._comp[key] = sc.detach().double()
        return self._comp[key]

    def head(self, layer, h):
        """Numpy float64 W_Q, W_K, W_V [D, dh] and W_O [dh, D] of one head, from HF."""
        blk = self.hf.transformer.h[layer].attn
        w = blk.c_attn.weight.detach().double().numpy()
        o = blk.c_proj.weight.detach().double().numpy()
        D, dh = self.D, self.dh
        cols = slice(h * dh, (h + 1) * dh)
        return (w[:, :D][:, cols], w[:, D:2 * D][:, cols], w[:, 2 * D:][:, cols],
                o[cols, :])

    def embed(self):
        W_E = self.hf.transformer.wte.weight.detach().double().numpy()
        W_U = self.hf.lm_head.weight.detach().double().numpy().T
        return W_E, W_U


@pytest.fixture(scope="module")
def bundled(bundled_dir):
    return Ref(bundled_dir)


def _fresh(client):
    """Drop the kept circuits (so a planted fault, or its removal, is computed anew)."""
    rt = client.app.state.runtime
    for k in [k for k in rt.memo if isinstance(k, tuple) and k[0] == "circuits"]:
        del rt.memo[k]


def _score(lam) -> tuple[float, float]:
    mag = np.abs(lam).sum()
    return float(lam.real.sum() / mag), float(np.clip(lam.real, 0, None).sum() / mag)


def check_circuits(client, ref: Ref, full_vocab_heads=(), heads=None, senders=None,
                   receivers=None) -> dict:
    r = client.post("/v1/circuits", json={"top_k": ref.dh})
    assert r.status_code == 200, r.text
    got = r.json()
    assert "no_processing" in got["weights"]
    assert (got["n_layers"], got["n_heads"], got["d_head"]) == (ref.L, ref.H, ref.dh)
    worst = {}
    for mode in ("Q", "K", "V"):
        tl = ref.composition(mode, senders, receivers)
        ours = torch.tensor(got["composition"][mode.lower()], dtype=torch.float64)
        if senders is not None:
            ours = ours[list(senders)][:, :, list(receivers)]
        worst[f"comp_{mode}"] = float((ours - tl).abs().max())
    W_E, W_U = ref.embed()
    by = {(h["layer"], h["head"]): h for h in got["heads"]}
    worst.update(copy=0.0, share=0.0, sv=0.0, norm=0.0)
    todo = heads if heads is not None else [(la, h) for la in range(ref.L) for h in range(ref.H)]
    G = W_U @ W_E
    for la, h in todo:
        Wq, Wk, Wv, Wo = ref.head(la, h)
        s = by[(la, h)]
        if (la, h) in full_vocab_heads:  # the d_vocab x d_vocab full OV circuit itself
            lam = np.linalg.eigvals(W_E @ Wv @ Wo @ W_U)
        else:
            lam = np.linalg.eigvals(Wv @ Wo @ G)  # d_model x d_model, same nonzero spectrum
        c, p = _score(lam)
        worst["copy"] = max(worst["copy"], abs(c - s["copying_score"]))
        worst["share"] = max(worst["share"], abs(p - s["positive_eigenvalue_share"]))
        for name, M in (("ov", Wv @ Wo), ("qk", Wq @ Wk.T)):
            sv = np.linalg.svd(M, compute_uv=False)[:ref.dh]
            worst["sv"] = max(worst["sv"], float(np.abs(sv - s[f"{name}_singular_values"]).max()))
            worst["norm"] = max(worst["norm"], abs(np.linalg.norm(M) - s[f"{name}_frobenius"]))
    assert max(worst.values()) <= 1e-5, worst
    # zero where the later head is not in a later layer (TL's mask)
    q = np.array(got["composition"]["q"])
    for la in range(ref.L):
        assert (q[la, :, : la + 1] == 0).all()
    return worst


@pytest.mark.slow  # TransformerLens' own all_composition_scores takes ~40 s here
def test_circuits_equal_transformerlens_and_numpy_bundled(client, bundled):
    """Measured: see the report printed by -s (the worst difference of each quantity)."""
    _fresh(client)
    print(check_circuits(client, bundled))


def test_the_layer_block_reference_is_the_full_transformerlens_result(bundled):
    """The GPT-2-small test's reference (TL's composition_scores on chosen sender and
    receiver layers, masked) is the block of TL's all_composition_scores: on the bundled
    model, senders 0, 1 x receivers 0, 1 (the mask's both sides) for Q, K and V."""
    for mode in "QKV":
        full = bundled.composition(mode)
        block = bundled.composition(mode, (0, 1), (0, 1))
        assert torch.equal(block, full[[0, 1]][:, :, [0, 1]]), mode
        assert block.abs().max() > 0.05 and (block[1, :, 0] == 0).all()


@pytest.mark.slow
def test_copying_score_on_the_full_vocab_by_vocab_circuit(client, bundled):
    """numpy eigenvalues of the 2048 x 2048 W_E W_V W_O W_U itself for one head (~30 s)."""
    check_circuits(client, bundled, full_vocab_heads=[(1, 3)], heads=[(1, 3)])


def test_top_k_and_composition_options(client, bundled):
    r = client.post("/v1/circuits", json={"top_k": 3, "composition": False}).json()
    assert r["composition"] is None
    assert all(len(h["ov_singular_values"]) == 3 == len(h["qk_singular_values"])
               for h in r["heads"])
    assert len(r["heads"]) == bundled.L * bundled.H
    big = client.post("/v1/circuits", json={"top_k": 1024}).json()
    assert len(big["heads"][0]["ov_singular_values"]) == bundled.dh
    for h in big["heads"]:
        sv = h["ov_singular_values"]
        assert sv == sorted(sv, reverse=True)
        assert -1 <= h["copying_score"] <= 1 and 0 <= h["positive_eigenvalue_share"] <= 1


def test_circuits_are_kept_per_revision(client, gpt2_runtime):
    _fresh(client)
    client.post("/v1/circuits", json={})
    keys = [k for k in gpt2_runtime.memo if isinstance(k, tuple) and k[0] == "circuits"]
    ref = gpt2_runtime.model_ref()
    assert keys == [("circuits", ref["id"], ref["revision"])]
    kept = gpt2_runtime.memo[keys[0]]
    client.post("/v1/circuits", json={"top_k": 2})
    assert gpt2_runtime.memo[keys[0]] is kept


def test_a_wrong_head_slice_fails_the_comparison(client, bundled, monkeypatch):
    """Planted fault: the value weights split [d_model, d_head, head] instead of [d_model,
    head, d_head] (each 'head' gets strided columns of every head)."""
    real = S.weights

    def wrong(p):
        w = real(p)
        D, Hn, dh = p.d_model, p.n_heads, p.d_head
        W_V = torch.stack([b.attn_w[:, 2 * D:].reshape(D, dh, Hn).permute(2, 0, 1)
                           for b in p.blocks])
        return type(w)(w.W_Q, w.W_K, W_V, w.W_O, w.W_E, w.W_U)

    monkeypatch.setattr(S, "weights", wrong)
    _fresh(client)
    try:
        with pytest.raises(AssertionError):
            check_circuits(client, bundled)
    finally:
        monkeypatch.setattr(S, "weights", real)
        _fresh(client)
    check_circuits(client, bundled)


def test_an_encoder_is_unsupported_and_bad_options_are_named(client, bert_client):
    r = bert_client.post("/v1/circuits", json={})
    assert r.status_code == 422 and r.json()["error"]["type"].startswith("unsupported"), r.text
    for body, param in (({"top_k": 0}, "top_k"), ({"top_k": 2000}, "top_k"),
                        ({"composition": "yes"}, "composition"), ({"text": "a"}, "text")):
        r = client.post("/v1/circuits", json=body)
        assert r.status_code == 422 and param in (r.json()["error"]["param"] or ""), r.text


def test_response_is_inside_its_estimate(client, gpt2_runtime):
    from attnscope.schemas.circuits import CircuitsRequest

    body = {"top_k": 32}
    est = S.plan(gpt2_runtime, CircuitsRequest(**body), []).response_bytes
    r = client.post("/v1/circuits", json=body)
    assert len(r.content) <= est


@pytest.mark.slow
def test_circuits_equal_transformerlens_and_numpy_gpt2_small(tmp_path_factory):
    """GPT-2-small shapes (12 x 12 heads, d_model 768, vocab 50257): composition against TL for
    every pair of sender layers 0, 1, 6, 10 and receiver layers 1, 6, 11 (both sides of the
    mask; the bundled model's test compares every pair), copying scores against numpy
    (d_model x d_model rotation) for six heads."""
    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime

    path = gpt2_small_dir(tmp_path_factory.mktemp("circuits_small"), seed=4, n_positions=32)
    rt = Runtime.load(Settings(model=str(path)))
    with _client(rt, model=str(path)) as c:
        check_circuits(c, Ref(path), heads=[(0, 0), (0, 11), (5, 3), (6, 7), (11, 0), (11, 11)],
                       senders=(0, 1, 6, 10), receivers=(1, 6, 11))


def test_circuits_are_computed_at_start_up_before_ready():
    """A service that loads its model (the lifespan) computes the circuits before /readyz says
    ready, so the first /v1/circuits request only reads them (issue 26: its first request on
    GPT-2-small shapes took seconds); an app whose table has no /v1/circuits skips it."""
    import time

    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app
    from attnscope.service.config import Settings
    from attnscope.service.serving.core.table import default_table

    def started(endpoints=None):
        c = TestClient(create_app(Settings(model="bundled"), endpoints=endpoints))
        c.__enter__()
        while c.get("/readyz").status_code != 200:  # the load runs in the lifespan's task
            assert c.app.state.load_error is None, c.app.state.load_error
            time.sleep(0.05)
        return c

    c = started()
    try:
        rt = c.app.state.runtime
        key = ("circuits", rt.model_ref()["id"], rt.model_ref()["revision"])
        assert key in rt.memo  # already there when ready
        kept = rt.memo[key]
        assert c.post("/v1/circuits").status_code == 200
        assert rt.memo[key] is kept  # read, not computed again
    finally:
        c.__exit__(None, None, None)
    c = started([ep for ep in default_table() if ep.path != "/v1/circuits"])
    try:
        rt = c.app.state.runtime
        assert not any(isinstance(k, tuple) and k[0] == "circuits" for k in rt.memo)
    finally:
        c.__exit__(None, None, None)


def test_start_up_on_an_encoder_skips_the_circuits(bert_runtime):
    from attnscope.service.app import precompute
    from attnscope.service.serving.core.table import default_table

    precompute(bert_runtime, default_table())  # no error: the feature does not serve encoders
    assert not any(isinstance(k, tuple) and k[0] == "circuits" for k in bert_runtime.memo)
