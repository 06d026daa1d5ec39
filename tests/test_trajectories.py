"""POST /v1/trajectories against scikit-learn run directly, as 000_1c89b6c8c2a32040.txt does."""

from __future__ import annotations

import base64
import math

import numpy as np
import pytest
import torch
from sklearn.decomposition import PCA
from sklearn.preprocessing import StandardScaler

from attnscope.schemas import TrajectoriesResponse
from attnscope.service.analysis.trajectories import trajectories
from attnscope.service.errors import InvalidRequest, NonFiniteValues
from attnscope.client import wire

from conftest import SENTENCE

URL = "/v1/trajectories"


def arr(t):
    if isinstance(t, dict):
        dt = {"float32": "<f4", "float16": "<f2"}[t["dtype"]]
        return np.frombuffer(base64.b64decode(t["data"]), dtype=dt).reshape(t["shape"]).astype(np.float64)
    return np.array(t, dtype=np.float64)


def block_outputs(rt, ids):
    """Independent of the runtime's recording: Hugging Face's forward with a hook on every
    block's output. Returns (the embeddings + each block's output ``[L+1, T, D]``, HF's own
    ``hidden_states`` ``[L+1, T, D]`` whose last entry is ln_f's output for GPT-2)."""
    base = rt.adapter.base()
    blocks = base.h if rt.adapter.causal else base.encoder.layer
    seen = []
    hooks = [b.register_forward_hook(lambda m, a, o: seen.append(o[0] if isinstance(o, tuple) else o))
             for b in blocks]
    try:
        with torch.no_grad():
            out = base(input_ids=torch.tensor([ids]), output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    hf = torch.stack(out.hidden_states).squeeze(1)
    return torch.cat([hf[:1], torch.stack(seen).squeeze(1)]), hf


def reference(rt, text, include_final=False, n_components=2):
    """The source's steps, run directly (Hugging Face forward + scikit-learn) on the L+1
    residual-stream states (embeddings, each block's output), plus HF's last hidden state
    (ln_f's output) with include_final."""
    ids = rt.tokenize(text).input_ids
    states, hf = block_outputs(rt, ids)
    trajectory_states = torch.cat([states, hf[-1:]]) if include_final else states
    n_state, n_token, n_dim = trajectory_states.shape
    flat = trajectory_states.reshape(n_state * n_token, n_dim).to(torch.float64).numpy()
    scaled = StandardScaler().fit_transform(flat)
    pca = PCA(n_components=n_components, random_state=0)
    hidden_2d = pca.fit_transform(scaled).reshape(n_state, n_token, n_components)
    start, end = hidden_2d[0], hidden_2d[-1]
    distances = [math.sqrt(sum((end[t, c] - start[t, c]) ** 2 for c in range(n_components)))
                 for t in range(n_token)]
    return trajectory_states.double().numpy(), hidden_2d, pca.explained_variance_ratio_, distances


@pytest.mark.parametrize("fixture", ["gpt2", "bert"])
def test_matches_sklearn_directly(fixture, request):
    rt = request.getfixturevalue(f"{fixture}_runtime")
    c = request.getfixturevalue("client" if fixture == "gpt2" else "bert_client")
    # the source document's steps on the text's own tokens (no BOS): add_bos false
    r = c.post(URL, json={"text": SENTENCE, "add_bos": False})
    assert r.status_code == 200, r.text
    body = TrajectoriesResponse.model_validate(r.json())
    t = body.trajectories
    assert t.add_bos is False
    states, hidden_2d, evr, distances = reference(rt, SENTENCE)
    n_state, n_token, _ = hidden_2d.shape
    assert t.states == list(range(rt.adapter.n_layers + 1)) and len(t.states) == n_state
    assert t.state_names[0] == "embeddings" and t.state_names[-1] == f"block {rt.adapter.n_layers - 1} output"
    assert t.positions == list(range(n_token)) and len(t.tokens) == n_token
    paths = arr(t.paths)
    assert paths.shape == (n_token, n_state, 2)
    # the model's hidden states are float32: agree to float32 precision after standardising
    assert np.abs(paths - hidden_2d.transpose(1, 0, 2)).max() < 1e-4
    assert np.abs(np.array(t.explained_variance_ratio) - evr).max() < 1e-6
    assert np.abs(np.array(t.distance_projected) - distances).max() < 1e-4
    full = np.linalg.norm(states[-1] - states[0], axis=-1)
    assert np.abs(np.array(t.distance_full) - full).max() < 1e-4 * max(1.0, full.max())
    cos = (states[0] * states[-1]).sum(-1) / (
        np.linalg.norm(states[0], axis=-1) * np.linalg.norm(states[-1], axis=-1))
    assert np.abs(np.array(t.cosine_first_last) - cos).max() < 1e-6
    assert 0 < sum(t.explained_variance_ratio) <= 1 + 1e-9
    assert t.explained_variance_ratio == sorted(t.explained_variance_ratio, reverse=True)


def test_include_final_more_components_selection(client, gpt2_runtime):
    states, proj, evr, distances = reference(gpt2_runtime, SENTENCE, include_final=True, n_components=5)
    sel = [11, 8, 9]
    # the source's steps on the text's own tokens (no BOS): add_bos false
    r = client.post(URL, json={"text": SENTENCE, "include_final": True, "n_components": 5,
                               "positions": sel, "encoding": "base64", "add_bos": False})
    assert r.status_code == 200, r.text
    t = r.json()["trajectories"]
    L = gpt2_runtime.adapter.n_layers
    assert t["states"] == list(range(L + 2)) and t["positions"] == sel
    assert t["state_names"][-2:] == [f"block {L - 1} output", "final LayerNorm output"]
    paths = arr(t["paths"])
    assert paths.shape == (3, proj.shape[0], 5)
    assert np.abs(paths - proj[:, sel, :].transpose(1, 0, 2)).max() < 1e-4
    assert np.abs(np.array(t["explained_variance_ratio"]) - evr).max() < 1e-6
    assert np.abs(np.array(t["distance_projected"]) - np.array(distances)[sel]).max() < 1e-4
    # the final state differs from the default's: dropping it is not a no-op
    d = client.post(URL, json={"text": SENTENCE, "positions": sel,
                               "add_bos": False}).json()["trajectories"]
    assert len(d["states"]) == len(t["states"]) - 1


def test_independent_svd_cross_check(gpt2_runtime):
    """Explained variance and projections equal an eigendecomposition done with numpy."""
    fw = gpt2_runtime.forward_many([gpt2_runtime.tokenize(SENTENCE)])[0]
    r = trajectories(fw.hidden_states, n_components=3)
    X = fw.hidden_states.reshape(-1, fw.hidden_states.shape[-1]).double().numpy()
    Z = (X - X.mean(0)) / np.where(X.std(0) > 0, X.std(0), 1)
    U, S, Vt = np.linalg.svd(Z, full_matrices=False)
    ratio = S**2 / (S**2).sum()
    assert np.abs(r["explained_variance_ratio"] - ratio[:3]).max() < 1e-9
    P = (Z @ Vt[:3].T).reshape(-1, fw.n_tokens, 3).transpose(1, 0, 2)
    for c in range(3):  # equal up to the sign of each component
        a, b = r["paths"][..., c], P[..., c]
        assert min(np.abs(a - b).max(), np.abs(a + b).max()) < 1e-8


@pytest.mark.parametrize("fixture", ["gpt2", "bert"])
def test_recorded_states_are_the_block_outputs_and_the_final_is_hugging_faces(fixture, request):
    """The runtime's L+1 states equal a hook on each block's output (the last one BEFORE
    ln_f), and its final state equals Hugging Face's last hidden_states entry; the response
    lists the states it used."""
    rt = request.getfixturevalue(f"{fixture}_runtime")
    c = request.getfixturevalue("client" if fixture == "gpt2" else "bert_client")
    tt = rt.tokenize(SENTENCE)
    fw = rt.forward_many([tt])[0]
    states, hf = block_outputs(rt, tt.input_ids)
    L = rt.adapter.n_layers
    assert fw.hidden_states.shape[0] == L + 1
    torch.testing.assert_close(fw.hidden_states, states, atol=0, rtol=0)
    torch.testing.assert_close(fw.tensors.final_hidden_state, hf[-1], atol=0, rtol=0)
    if fixture == "gpt2":  # they differ: ln_f is not the identity
        assert (fw.hidden_states[-1] - hf[-1]).abs().max() > 1.0
        assert fw.tensors.final_state is not None
    else:  # no final LayerNorm: HF's last entry IS the last block's output
        assert fw.tensors.final_state is None
        r = c.post(URL, json={"text": SENTENCE, "include_final": True})
        assert r.status_code == 422 and r.json()["error"]["param"] == "include_final"
        assert "no final LayerNorm" in r.json()["error"]["message"]
    t = c.post(URL, json={"text": SENTENCE}).json()["trajectories"]
    # add_bos null: the model's convention (GPT-2: BOS first; encoders: their own framing)
    assert t["states"] == list(range(L + 1)) and t["add_bos"] is (fixture == "gpt2")
    assert t["dtype"] == "float32"
    assert t["state_names"] == ["embeddings"] + [f"block {i} output" for i in range(L)]


def test_texts_batch(client):
    r = client.post(URL, json={"texts": [SENTENCE, "And God said, Let there be light."]})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert len(res) == 2 and r.json().get("trajectories") is None
    one = client.post(URL, json={"text": "And God said, Let there be light."}).json()["trajectories"]
    assert np.abs(arr(res[1]["paths"]) - arr(one["paths"])).max() < 1e-9


def test_one_token_text(client):
    # "And" is one token (the text's own tokens, add_bos false): 3 states x 1 token = 3
    # samples, enough for up to 3 components
    r = client.post(URL, json={"text": "And", "add_bos": False})
    assert r.status_code == 200, r.text
    t = r.json()["trajectories"]
    assert len(t["tokens"]) == 1 and arr(t["paths"]).shape == (1, 3, 2)
    r = client.post(URL, json={"text": "And", "n_components": 4, "add_bos": False})
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["param"] == "n_components" and "min(n_samples, d_model)" in err["message"]
    assert "= 3" in err["message"]


@pytest.mark.parametrize(
    "payload, status, param, words",
    [
        ({"text": SENTENCE, "n_components": 129}, 422, "n_components", "at most"),
        ({"text": SENTENCE, "n_components": 0}, 422, "n_components", ""),
        ({"text": SENTENCE, "positions": [0, 99]}, 422, "positions.1", "out of range"),
        ({"text": SENTENCE, "positions": [-1]}, 422, "positions.0", "out of range"),
        ({"texts": [SENTENCE, "And"], "positions": [3]}, 422, "positions.0", "texts.1"),
        ({"texts": [SENTENCE, "And"], "n_components": 20}, 422, "n_components", "texts.1"),
        ({"text": SENTENCE, "bogus": 1}, 422, "bogus", ""),
    ],
)
def test_bad_requests(client, payload, status, param, words):
    r = client.post(URL, json=payload)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_pure_function_edges():
    hs = torch.randn(1, 1, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(InvalidRequest, match="at least 2 samples"):
        trajectories(hs)  # one state x one token
    fin = torch.randn(1, 8, generator=torch.Generator().manual_seed(1))
    r = trajectories(hs, include_final=True, n_components=1, final_state=fin)
    assert r["paths"].shape == (1, 2, 1) and r["state_names"] == ["embeddings", "final LayerNorm output"]
    with pytest.raises(ValueError, match="final_state"):
        trajectories(hs, include_final=True)
    with pytest.raises(InvalidRequest, match="do not vary"):
        trajectories(torch.ones(3, 4, 8))
    bad = torch.randn(3, 4, 8)
    bad[1, 2, 3] = float("nan")
    with pytest.raises(NonFiniteValues):
        trajectories(bad)
    r = trajectories(torch.randn(3, 4, 8), positions=[])
    assert r["paths"].shape == (0, 3, 2) and r["distance_projected"].shape == (0,)
    for dtype in (torch.float32, torch.float64, torch.float16):
        for value in (float("inf"), float("-inf"), float("nan")):
            bad = torch.randn(3, 4, 8).to(dtype)
            bad[0, 3, 5] = value
            with pytest.raises(NonFiniteValues):
                trajectories(bad)
    big = torch.randn(3, 4, 8, dtype=torch.float64)
    big[1, 1, 1] = 1e308  # finite, but a column sum overflows float64
    big[1, 2, 1] = 1e308
    with pytest.raises(NonFiniteValues, match="beyond float64"):
        trajectories(big)


def _sklearn_recipe(hidden_states, include_final=False, n_components=2, final_state=None):
    """000_1c89b6c8c2a32040.txt's steps on the same tensor, scikit-learn end to end."""
    states = torch.cat([hidden_states, final_state[None]]) if include_final else hidden_states
    flat = states.reshape(-1, states.shape[-1]).to(torch.float64).numpy()
    scaled = StandardScaler().fit_transform(flat)
    pca = PCA(n_components=n_components, random_state=0)
    return scaled, pca.fit_transform(scaled).reshape(states.shape[0], states.shape[1], -1), pca


@pytest.mark.parametrize("fixture", ["gpt2", "bert"])
def test_same_numbers_as_scikit_learn_in_process(fixture, request):
    """The whole function equals the recipe to float64 rounding (the PCA runs with one BLAS
    thread here), also with constant and near-constant features (StandardScaler gives them
    scale 1)."""
    rt = request.getfixturevalue(f"{fixture}_runtime")
    fw = rt.forward_many([rt.tokenize(SENTENCE + " And God said, Let there be light.")])[0]
    hs = fw.hidden_states
    fin = fw.tensors.final_hidden_state  # ln_f's output (GPT-2); BERT: its last state again
    for kw in ({}, {"include_final": True, "n_components": 5, "final_state": fin}):
        scaled, proj, pca = _sklearn_recipe(hs, **kw)
        r = trajectories(hs, **kw)
        np.testing.assert_allclose(r["paths"], proj.transpose(1, 0, 2), rtol=0, atol=1e-12)
        np.testing.assert_allclose(r["explained_variance_ratio"], pca.explained_variance_ratio_,
                                   rtol=1e-12, atol=0)
    x = np.random.default_rng(0).normal(size=(50, 6))
    x[:, 2] = 3.25
    x[:, 4] = 1e8 + np.arange(50) * 1e-9
    hx = torch.from_numpy(x.reshape(2, 25, 6))
    _, proj, pca = _sklearn_recipe(hx)
    r = trajectories(hx)
    np.testing.assert_allclose(r["paths"], proj.transpose(1, 0, 2), rtol=0, atol=1e-12)
    np.testing.assert_allclose(r["explained_variance_ratio"], pca.explained_variance_ratio_,
                               rtol=1e-12, atol=0)


def test_one_blas_thread_nests_restores_and_works_from_any_thread():
    import threading

    from threadpoolctl import threadpool_info

    from attnscope.service.analysis._blas import one_blas_thread

    def blas():
        return {i["filepath"]: i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}

    before = blas()
    assert before
    seen = []
    release = threading.Event()

    def worker(done):
        with one_blas_thread():
            with one_blas_thread():
                seen.append(blas())
            seen.append(blas())
        seen.append(blas())
        done.set()
        release.wait(10)  # stays alive, like a pooled worker thread of the server

    # one live thread, then another: the first must not keep control of OpenBLAS's threads
    threads = []
    for _ in range(2):
        done = threading.Event()
        threads.append(threading.Thread(target=worker, args=(done,)))
        threads[-1].start()
        assert done.wait(10)
        assert [set(s.values()) for s in seen[:2]] == [{1}, {1}] and seen[2] == before
        seen.clear()
    with one_blas_thread():  # and the main thread afterwards
        assert set(blas().values()) == {1}
    assert blas() == before
    release.set()
    for t in threads:
        t.join()


# --- trajectories: the PCA's SVD under multi-threaded BLAS took ~1 s per text on a busy box -

@pytest.mark.regression
def test_trajectories_batch_fits_its_pca_on_one_blas_thread(client, monkeypatch):
    """The cause, not a stopwatch: every PCA fit of a served batch runs with one BLAS thread
    (the speed itself is in bench/run.py). Planted fault: without the limit the fits see the
    process's default BLAS threads (one per core)."""
    from sklearn.decomposition import PCA
    from threadpoolctl import threadpool_info

    fit = PCA.fit_transform
    seen = []

    def recording(self, *a, **k):
        seen.append({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"})
        return fit(self, *a, **k)

    monkeypatch.setattr(PCA, "fit_transform", recording)
    texts = [" ".join(f"w{i}x{j}" for i in range(40)) for j in range(8)]
    r = client.post("/v1/trajectories", json={"texts": texts, "encoding": "base64"})
    assert r.status_code == 200, r.text
    assert len(r.json()["results"]) == 8
    assert len(seen) == 8 and all(s == {1} for s in seen), seen


# ------------------------------------------------------------------ base64 round trips
@pytest.mark.regression
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_trajectories_and_scratch_base64(client, dtype):
    r = client.post("/v1/trajectories", json={"texts": [SENTENCE, "one two three"],
                                              "encoding": "base64", "dtype": dtype})
    assert r.status_code == 200, r.text
    rj = client.post("/v1/trajectories", json={"texts": [SENTENCE, "one two three"]})
    for a, b in zip(r.json()["results"], rj.json()["results"]):
        got = wire.decode_tensor(a["paths"]).astype(np.float32)
        want = np.asarray(b["paths"], np.float32)
        if dtype == "float32":
            assert np.array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------------ trajectories
@pytest.mark.regression
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("include_final", [False, True])
def test_trajectories_equal_the_scikit_learn_pipeline(dtype, include_final):
    from attnscope.service.analysis.trajectories import trajectories
    from sklearn.decomposition import PCA
    from sklearn.preprocessing import StandardScaler

    g = torch.Generator().manual_seed(3)
    h = (torch.randn(4, 9, 24, generator=g) * 3 + 1).to(dtype)
    h[:, :, 5] = 2.0  # a constant feature (scale 1)
    before = h.clone()
    pos = [8, 0, 3]
    fin = (torch.randn(9, 24, generator=g) * 2).to(dtype)
    r = trajectories(h, include_final, 3, pos, final_state=fin)
    assert torch.equal(h, before)  # the recorded hidden states are never changed
    n = 5 if include_final else 4  # every residual state, plus the final LayerNorm's output
    x = torch.cat([h, fin[None]])[:n].reshape(n * 9, 24).to(torch.float64).numpy()
    proj = PCA(n_components=3, random_state=0).fit_transform(StandardScaler().fit_transform(x))
    paths = proj.reshape(n, 9, 3)[:, pos].transpose(1, 0, 2)
    np.testing.assert_allclose(r["paths"], paths, rtol=1e-9, atol=1e-9)
    first, last = x[pos], x[(n - 1) * 9 + np.array(pos)]
    np.testing.assert_allclose(r["distance_full"], np.linalg.norm(last - first, axis=-1),
                               rtol=1e-12)
