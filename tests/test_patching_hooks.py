"""/v1/patch ``hook``: activation patching at every hook of the hooked forward, each grid equal
to TransformerLens 4.3's ``get_act_patch_*`` of the same name (TransformerBridge on the same
local weights; the metric TL's tutorials use), attribution patching at each hook equal to a
gradient computed through TL's own hooks, declared metrics raw and normalised, cell subsets,
and bad input. resid_mid: TL 4.3's bridge aliases ``hook_resid_mid`` to ``ln2.hook_in`` (an
edit there reaches the MLP's input only), so its reference is an explicit loop on the bridge
that patches the residual stream itself (HookedTransformer's meaning, the service's)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from conftest import assert_error
from interventions_reference import induction_ids, tl_bridge

os.environ.setdefault("TQDM_DISABLE", "1")
pytest.importorskip("transformer_lens")

SEG = 6


@pytest.fixture(scope="module")
def pair():
    clean = induction_ids(0, SEG, 2)
    other = induction_ids(100, SEG, 1)
    corrupted = clean[: 1 + SEG] + other[1:]
    return clean, corrupted


@pytest.fixture(scope="module")
def bridge(bundled_dir):
    return tl_bridge(bundled_dir)


@pytest.fixture(scope="module")
def clean_cache(bridge, pair):
    _, cache = bridge.run_with_cache(torch.tensor([pair[0]]))
    return cache


def _ld_request(pair, **kw):
    clean, corrupted = pair
    T = len(clean)
    return {"clean_tokens": clean, "corrupted_tokens": corrupted,
            "metric": {"kind": "logit_diff", "terms": [
                {"position": T - 2, "target": clean[-1], "distractor": corrupted[-1]}]}, **kw}


def _tl_metric(pair):
    clean, corrupted = pair
    T = len(clean)

    def m(logits):
        return logits[0, T - 2, clean[-1]] - logits[0, T - 2, corrupted[-1]]
    return m


def _arr(nested):
    return np.array([[np.nan if v is None else v for v in row] if isinstance(row, list) and
                     row and not isinstance(row[0], list) else row for row in nested], dtype=object)


def _np(nested) -> np.ndarray:
    def conv(x):
        if isinstance(x, list):
            return [conv(y) for y in x]
        return np.nan if x is None else x
    return np.array(conv(nested), dtype=np.float64)


def _tl_resid_mid(bridge, corrupted, cache, metric):
    """Residual-stream patching at resid_mid on the bridge: attn_out at position p is set so
    that resid_mid[p] = clean resid_mid[p] (resid_mid = resid_pre + attn_out)."""
    L, T = bridge.cfg.n_layers, len(corrupted)
    out = torch.empty(L, T)
    for layer in range(L):
        for p in range(T):
            seen = {}

            def grab(x, hook):
                seen["pre"] = x.detach().clone()
                return x

            def setter(x, hook, p=p, layer=layer):
                x = x.clone()
                x[:, p] = cache[f"blocks.{layer}.hook_resid_mid"][:, p] - seen["pre"][:, p]
                return x
            with torch.no_grad():
                lg = bridge.run_with_hooks(torch.tensor([corrupted]), fwd_hooks=[
                    (f"blocks.{layer}.hook_resid_pre", grab),
                    (f"blocks.{layer}.hook_attn_out", setter)])
            out[layer, p] = metric(lg)
    return out


_GAP: dict = {}


def _tl_gap(bridge, client, pair) -> float:
    """TL's clean gap: the largest |logit| difference between the bridge's unpatched runs and
    Hugging Face's (which the service equals bit for bit) on the two prompts; the bound is
    ``max(1e-5, 2 x gap)`` as for /v1/run's interventions (README, "every hook vs TL")."""
    if "gap" not in _GAP:
        from transformers import GPT2LMHeadModel

        from attnscope.service.config import BUNDLED_MODEL_DIR

        hf = GPT2LMHeadModel.from_pretrained(BUNDLED_MODEL_DIR, attn_implementation="eager")
        with torch.no_grad():
            _GAP["gap"] = max(float((bridge(torch.tensor([x])) - hf(
                torch.tensor([x]), use_cache=False).logits).abs().max()) for x in pair)
    return _GAP["gap"]


CASES = [("z", False), ("z", True), ("q", False), ("q", True), ("k", False), ("k", True),
         ("v", False), ("v", True), ("pattern", False), ("pattern", True), ("resid_pre", True),
         ("resid_mid", True), ("resid_post", True), ("attn_out", True), ("mlp_out", True)]


@pytest.mark.parametrize("hook,by_pos", CASES)
def test_grid_equals_transformerlens(client, bridge, clean_cache, pair, hook, by_pos):
    from transformer_lens import patching

    clean, corrupted = pair
    r = client.post("/v1/patch", json=_ld_request(pair, hook=hook, by_position=by_pos,
                                                  add_bos=False))
    assert r.status_code == 200, r.text
    body = r.json()
    g = body["grid"]
    ours = _np(g["raw"])
    metric = _tl_metric(pair)
    corr = torch.tensor([corrupted])
    if hook == "resid_mid":
        ref = _tl_resid_mid(bridge, corrupted, clean_cache, metric)
    elif hook == "resid_post":
        ref = patching.generic_activation_patch(
            bridge, corr, clean_cache, metric, patch_setter=patching.layer_pos_patch_setter,
            activation_name="resid_post", index_axis_names=("layer", "pos"))
    else:
        assert g["function"].startswith("get_act_patch_")
        ref = getattr(patching, g["function"])(bridge, corr, clean_cache, metric)
    ref = ref.detach().double().numpy()
    assert ours.shape == ref.shape == tuple(g["shape"])
    # TL's own float32 rounding: its unpatched runs differ from ours (HF bit for bit) by a
    # gap; a cell may differ by that much twice (README "every hook vs TL")
    gap = _tl_gap(bridge, client, pair)
    assert np.abs(ours - ref).max() <= max(1e-5, 2 * gap), (hook, by_pos, gap,
                                                          np.abs(ours - ref).max())
    assert np.abs(ref).max() > 0.1  # the grid is not trivially zero
    c, k = body["clean_value"], body["corrupted_value"]
    assert np.allclose(_np(g["normalized"]), (ours - k) / (c - k), atol=1e-5, equal_nan=True)


def test_resid_mid_is_not_the_bridges_mlp_input_alias(client, bridge, clean_cache, pair):
    """The planted fault for the resid_mid reference: TL 4.3's own get_act_patch_resid_mid on
    the bridge (an edit of ln2.hook_in, the MLP's input only) differs from the residual-stream
    patch we serve, so the comparison above can tell the two apart."""
    from transformer_lens import patching

    r = client.post("/v1/patch", json=_ld_request(pair, hook="resid_mid", add_bos=False))
    ours = _np(r.json()["grid"]["raw"])
    alias = patching.get_act_patch_resid_mid(bridge, torch.tensor([pair[1]]), clean_cache,
                                             _tl_metric(pair)).double().numpy()
    assert np.abs(ours - alias).max() > 1e-2


def test_planted_wrong_hook_fails(client, bridge, clean_cache, pair):
    """A grid at q compared with TL's k grid is far off: the comparison tells hooks apart."""
    from transformer_lens import patching

    r = client.post("/v1/patch", json=_ld_request(pair, hook="q", by_position=True,
                                                  add_bos=False))
    ours = _np(r.json()["grid"]["raw"])
    ref = patching.get_act_patch_attn_head_k_by_pos(bridge, torch.tensor([pair[1]]),
                                                    clean_cache, _tl_metric(pair))
    assert np.abs(ours - ref.double().numpy()).max() > 1e-2


@pytest.mark.parametrize("hook,by_pos", [("z", True), ("pattern", True), ("resid_pre", True),
                                         ("k", False), ("mlp_out", True)])
def test_attribution_equals_gradient_through_transformerlens(client, bridge, clean_cache, pair,
                                                              hook, by_pos):
    """Attribution at each hook = corrupted + sum grad * (clean - corrupted), the gradient
    taken by autograd through TL's bridge hooks on the corrupted run."""
    from transformer_lens.utilities import get_act_name

    clean, corrupted = pair
    r = client.post("/v1/patch", json=_ld_request(pair, hook=hook, by_position=by_pos,
                                                  method="attribution", add_bos=False))
    assert r.status_code == 200, r.text
    body = r.json()
    ours = _np(body["grid"]["raw"])
    name = {"pattern": "pattern", "z": "z", "k": "k", "resid_pre": "resid_pre",
            "mlp_out": "mlp_out"}[hook]
    L = bridge.cfg.n_layers
    acts = {}

    def keep(n):
        def fn(x, hook):
            x.retain_grad()
            acts[n] = x
            return x
        return fn
    names = [get_act_name(name, layer) for layer in range(L)]
    lg = bridge.run_with_hooks(torch.tensor([corrupted]),
                               fwd_hooks=[(n, keep(n)) for n in names])
    m = _tl_metric(pair)(lg)
    m.backward()
    rows = []
    for n in names:
        prod = (acts[n].grad * (clean_cache[n] - acts[n]).detach())[0]
        if hook in ("resid_pre", "mlp_out"):
            rows.append(prod.sum(-1))
        elif hook == "pattern":
            rows.append(prod.sum(-1))  # [head, dest]
        elif by_pos:
            rows.append(prod.sum(-1))  # [pos, head]
        else:
            rows.append(prod.sum((0, 2)))  # [head]
    ref = float(m) + torch.stack(rows).double().numpy()
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    assert abs(body["corrupted_value"] - float(m)) <= 1e-5


def test_subsets_equal_the_full_grid(client, pair):
    full = _np(client.post("/v1/patch", json=_ld_request(
        pair, hook="v", by_position=True, add_bos=False)).json()["grid"]["raw"])
    r = client.post("/v1/patch", json=_ld_request(
        pair, hook="v", by_position=True, add_bos=False, patch_layers=[1], patch_heads=[0, 2],
        patch_positions=[3, 9]))
    assert r.status_code == 200, r.text
    sub = _np(r.json()["grid"]["raw"])
    assert sub.shape == full.shape
    want = np.full_like(full, np.nan)
    for p in (3, 9):
        for h in (0, 2):
            want[1, p, h] = full[1, p, h]
    assert np.array_equal(np.isnan(sub), np.isnan(want))
    # the same cells in a smaller batch: float32 matmuls may sum in another order
    assert np.nanmax(np.abs(sub - want)) <= 1e-5


def test_all_pos_subset_patches_the_positions_together(client, pair, bridge, clean_cache):
    """hook z (all positions) with patch_positions: each head's z at those positions patched
    together, equal to a TL hook loop doing the same."""
    clean, corrupted = pair
    ps = [8, 10, 11]
    r = client.post("/v1/patch", json=_ld_request(pair, hook="z", add_bos=False,
                                                  patch_positions=ps))
    ours = _np(r.json()["grid"]["raw"])
    L, H = bridge.cfg.n_layers, bridge.cfg.n_heads
    ref = np.empty((L, H))
    for layer in range(L):
        for h in range(H):
            def setter(x, hook, h=h, layer=layer):
                x = x.clone()
                x[:, ps, h] = clean_cache[f"blocks.{layer}.attn.hook_z"][:, ps, h]
                return x
            with torch.no_grad():
                lg = bridge.run_with_hooks(torch.tensor([corrupted]),
                                           fwd_hooks=[(f"blocks.{layer}.attn.hook_z", setter)])
            ref[layer, h] = float(_tl_metric(pair)(lg))
    assert np.abs(ours - ref).max() <= max(1e-5, 2 * _tl_gap(bridge, client, pair))


@pytest.mark.parametrize("metric", [
    {"kind": "prob", "terms": [{"position": -2, "target": "T"}]},
    {"kind": "logprob", "terms": [{"position": -2, "target": "T"}], "reduce": "sum"},
    {"kind": "loss", "terms": [{"position": 7}, {"position": 9}, {"position": 11}]},
    {"kind": "kl", "terms": [{"prompt": 1, "reference_prompt": 0, "position": -2}]},
])
def test_declared_metrics_equal_transformerlens(client, bridge, clean_cache, pair, metric):
    """Declared metrics on the resid_pre grid, against TL's get_act_patch_resid_pre with the
    same metric written on TL's logits; the normalised values from raw, clean, corrupted."""
    from transformer_lens import patching

    clean, corrupted = pair
    T = len(clean)
    metric = {**metric, "terms": [
        {**t, **({"target": clean[-1]} if t.get("target") == "T" else {})}
        for t in metric["terms"]]}
    r = client.post("/v1/patch", json={"clean_tokens": clean, "corrupted_tokens": corrupted,
                                       "metric": metric, "hook": "resid_pre"})
    assert r.status_code == 200, r.text
    body = r.json()
    with torch.no_grad():
        clean_lp = torch.log_softmax(bridge(torch.tensor([clean]))[0, T - 2], -1)

    def tl_metric(logits):
        lp = torch.log_softmax(logits[0], -1)
        k = metric["kind"]
        if k == "prob":
            return lp[T - 2, clean[-1]].exp()
        if k == "logprob":
            return lp[T - 2, clean[-1]]
        if k == "loss":
            return -torch.stack([lp[p, clean[p + 1]] for p in (7, 9, 11)]).mean()
        return (clean_lp.exp() * (clean_lp - lp[T - 2])).sum()
    ref = patching.get_act_patch_resid_pre(bridge, torch.tensor([corrupted]), clean_cache,
                                           tl_metric).double().numpy()
    ours = _np(body["grid"]["raw"])
    assert np.abs(ours - ref).max() <= 1e-5 * max(1, np.abs(ref).max())
    c, k = body["clean_value"], body["corrupted_value"]
    assert abs(c - float(tl_metric(bridge(torch.tensor([clean])).detach()))) <= 1e-5
    if metric["kind"] == "kl":
        assert c == 0.0 and k > 0
    assert np.allclose(_np(body["grid"]["normalized"]), (ours - k) / (c - k), atol=1e-4)


def test_declared_metric_without_hook_equals_legacy_head_grid(client, pair):
    """A declared loss on the head grid (no hook) gives the legacy 'loss' request's numbers
    (recorded forwards, z masks): heads, heads_raw, heads_per_position [layer, head, pos] and
    residual [layer, pos]."""
    clean, corrupted = pair
    common = {"clean_tokens": clean, "corrupted_tokens": corrupted, "per_position": True,
              "residual": True}
    legacy = client.post("/v1/patch", json={**common, "metric": "loss", "positions": [7, 9, 11]})
    declared = client.post("/v1/patch", json={**common, "metric": {
        "kind": "loss", "terms": [{"position": p} for p in (7, 9, 11)]}})
    assert legacy.status_code == declared.status_code == 200, declared.text
    lg, d = legacy.json(), declared.json()
    assert d["grid"] is None and d["metric"] == "loss"
    assert abs(lg["clean_value"] - d["clean_value"]) <= 1e-6
    assert abs(lg["corrupted_value"] - d["corrupted_value"]) <= 1e-6
    for f in ("heads", "heads_raw", "heads_per_position", "residual"):
        assert np.allclose(_np(lg[f]), _np(d[f]), atol=1e-5, equal_nan=True), f
    assert _np(d["heads_per_position"]).shape == (2, 4, len(clean))


def test_bad_input(client, pair):
    clean, corrupted = pair
    base = _ld_request(pair)
    assert_error(client.post("/v1/patch", json={**base, "hook": "hook_nope"}), 422)
    assert_error(client.post("/v1/patch", json={**base, "hook": "resid_pre",
                                                "patch_heads": [0]}), 422, param="patch_heads")
    assert_error(client.post("/v1/patch", json={**base, "hook": "z", "patch_heads": [9]}), 422,
                 param="patch_heads.0")
    assert_error(client.post("/v1/patch", json={**base, "hook": "z", "patch_layers": [1, 1]}),
                 422, param="patch_layers.1")
    assert_error(client.post("/v1/patch", json={**base, "hook": "z",
                                                "patch_positions": [len(clean)]}),
                 422, param="patch_positions.0")
    assert_error(client.post("/v1/patch", json={**base, "patch_layers": [0]}), 422)
    assert_error(client.post("/v1/patch", json={**base, "hook": "z", "per_position": True}), 422)
    bad = {**base, "metric": {"kind": "logit_diff", "terms": [
        {"position": 99, "target": 1, "distractor": 2}]}}
    assert_error(client.post("/v1/patch", json=bad), 422, param="metric.terms.0.position")
    bad = {**base, "metric": {"kind": "prob", "terms": [{"prompt": 2, "position": 1,
                                                         "target": 1}]}}
    assert_error(client.post("/v1/patch", json=bad), 422, param="metric.terms.0.prompt")
    bad = {**base, "metric": {"kind": "loss", "terms": [{"position": -1}]}}
    assert_error(client.post("/v1/patch", json=bad), 422, param="metric.terms.0.position")
    bad = {**base, "corrupted_tokens": corrupted[:-1], "hook": "z"}
    assert_error(client.post("/v1/patch", json=bad), 422, param="corrupted_tokens")
    assert client.get("/healthz").status_code == 200


def test_grouped_query_k_grid_counts_key_value_heads(tmp_path, make_client):
    """On a Llama checkpoint with 4 query / 2 key-value heads the k grid is [layer, kv_head]
    (TL counts n_key_value_heads for k and v), each cell equal to a forward hook on Hugging
    Face's k_proj that writes the clean run's keys of that kv head (before rotary: the same
    rotation applies to both runs at a position); patch_heads beyond the kv heads is 422."""
    from transformers import AutoModelForCausalLM

    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime
    from families import family_checkpoint

    path = family_checkpoint("llama", tmp_path)
    rt = Runtime.load(Settings(model=str(path)))
    c = make_client(rt, model=str(path))
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    clean = induction_ids(0, 5, 2, vocab=int(hf.config.vocab_size))
    corrupted = clean[:6] + induction_ids(9, 5, 1, vocab=int(hf.config.vocab_size))[1:]
    T = len(clean)
    tgt, dis = clean[-1], corrupted[-1]
    r = c.post("/v1/patch", json={"clean_tokens": clean, "corrupted_tokens": corrupted,
                                  "hook": "k", "metric": {"kind": "logit_diff", "terms": [
                                      {"position": T - 2, "target": tgt, "distractor": dis}]}})
    assert r.status_code == 200, r.text
    g = r.json()["grid"]
    kv, L = hf.config.num_key_value_heads, hf.config.num_hidden_layers
    assert g["shape"] == [L, kv] and kv < hf.config.num_attention_heads
    dh = hf.config.hidden_size // hf.config.num_attention_heads
    keys = {}

    def grab(layer):
        def fn(mod, args, out):
            keys[layer] = out.detach().clone()
        return fn
    hs = [hf.model.layers[i].self_attn.k_proj.register_forward_hook(grab(i)) for i in range(L)]
    with torch.no_grad():
        hf(torch.tensor([clean]))
    for h in hs:
        h.remove()
    ref = np.empty((L, kv))
    for layer in range(L):
        for h in range(kv):
            def put(mod, args, out, layer=layer, h=h):
                out = out.clone()
                out[..., h * dh:(h + 1) * dh] = keys[layer][..., h * dh:(h + 1) * dh]
                return out
            hk = hf.model.layers[layer].self_attn.k_proj.register_forward_hook(put)
            with torch.no_grad():
                lg = hf(torch.tensor([corrupted])).logits[0, T - 2]
            hk.remove()
            ref[layer, h] = float(lg[tgt] - lg[dis])
    assert np.abs(_np(g["raw"]) - ref).max() <= 1e-5
    bad = c.post("/v1/patch", json={"clean_tokens": clean, "corrupted_tokens": corrupted,
                                    "hook": "k", "patch_heads": [kv], "metric": "loss"})
    e = assert_error(bad, 422, param="patch_heads.0")
    assert f"{kv} key/value heads" in e["message"], e  # not "the model has 2 heads" (it has 4)
    z = c.post("/v1/patch", json={"clean_tokens": clean, "corrupted_tokens": corrupted,
                                  "hook": "z", "patch_heads": [4], "metric": "loss"})
    assert "4 heads" in assert_error(z, 422, param="patch_heads.0")["message"]


def test_memory_limit_chunks_the_grid_and_refuses_what_cannot_fit(gpt2_runtime, make_client,
                                                                     client, pair):
    """Under a small max_request_bytes the grid runs in smaller batches with the same numbers
    (n_forwards grows); a limit no single patched row fits is 422 memory_limit_exceeded before
    any forward."""
    body = _ld_request(pair, hook="z", by_position=True)
    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime

    full = client.post("/v1/patch", json=body).json()["grid"]
    # the runtime sizes the batches from its settings (the app's and the runtime's are one
    # Settings in a served process): both small here
    # 1 MiB: below one (layer, window start) group of the KV continuation (3 MiB was not)
    rt = Runtime.load(Settings(model="bundled", max_request_bytes=1 << 20))
    small = make_client(rt, max_request_bytes=1 << 20)
    r = small.post("/v1/patch", json=body)
    assert r.status_code == 200, r.text
    g = r.json()["grid"]
    assert g["n_forwards"] > full["n_forwards"]
    assert np.abs(_np(g["raw"]) - _np(full["raw"])).max() <= 1e-5
    tiny = make_client(Runtime.load(Settings(model="bundled", max_request_bytes=200 << 10)),
                       max_request_bytes=200 << 10)
    e = assert_error(tiny.post("/v1/patch", json=body), 422, type_="memory_limit_exceeded")
    assert "patched forward" in e["message"]


def test_device_work_limit(gpt2_runtime, make_client, pair):
    """The grid's patched rows count as device work: under a small max_request_flops the
    head x position grid is 422 device_limit_exceeded naming the clean prompt, while one
    layer's all-position grid fits."""
    small = make_client(gpt2_runtime, max_request_flops=2e8)
    e = assert_error(small.post("/v1/patch", json=_ld_request(pair, hook="z", by_position=True)),
                     422, type_="device_limit_exceeded", param="clean_tokens")
    assert "the job" in e["message"]
    ok = small.post("/v1/patch", json=_ld_request(pair, hook="z", patch_layers=[1]))
    assert ok.status_code == 200, ok.text


def test_nan_checkpoint_is_500_non_finite(tmp_path, bundled_dir, make_client):
    """The one non-finite rule on the new requests: a checkpoint whose forward makes NaN
    answers 500 non_finite_values (never nulls standing for the model's numbers)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime

    d = tmp_path / "nan-gpt2"
    shutil.copytree(bundled_dir, d)
    w = load_file(str(d / "model.safetensors"))
    key = next(k for k in w if k.endswith("h.1.ln_1.weight"))
    w[key] = w[key].clone()
    w[key][0] = float("nan")
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    c = make_client(Runtime.load(Settings(model=str(d))))
    ids = induction_ids(0, 6, 2)
    other = ids[:7] + induction_ids(100, 6, 1)[1:]
    m = {"kind": "loss", "terms": [{"position": 8}]}
    for path, body in [
        ("/v1/patch", {"clean_tokens": ids, "corrupted_tokens": other, "metric": m, "hook": "z"}),
        ("/v1/patch", {"clean_tokens": ids, "corrupted_tokens": other, "metric": m,
                       "hook": "resid_pre", "method": "attribution"}),
        ("/v1/ablate", {"tokens": ids, "components": [{"kind": "mlp", "layer": 0}]}),
        ("/v1/ablate", {"tokens": ids, "components": [{"kind": "neuron", "layer": 0,
                                                       "neurons": [1]}], "metric": m}),
    ]:
        e = assert_error(c.post(path, json=body), 500, type_="non_finite_values")
        assert "NaN" in e["message"]


def test_cells_that_cannot_change_the_metric_are_skipped(client, pair):
    """The clean and corrupted prompts share BOS + 6 tokens: every z of those positions is the
    same in both runs, so those cells are the corrupted value without a forward (they are
    compared with TL's full forwards in test_grid_equals_transformerlens); so is the last
    position (after the metric's position T - 2). A corrupted prompt that differs from the
    first position skips the last position only."""
    clean, corrupted = pair
    T, L, H = len(clean), 2, 4
    g = client.post("/v1/patch", json=_ld_request(pair, hook="z", by_position=True)).json()
    grid = g["grid"]
    assert grid["cells_skipped"] == L * H * (1 + SEG) + L * H
    raw = _np(grid["raw"])
    assert np.all(raw[:, : 1 + SEG] == g["corrupted_value"])
    assert np.all(raw[:, T - 1] == g["corrupted_value"])
    other = [clean[0] + 1] + corrupted[1:]  # differs at position 0 too
    g2 = client.post("/v1/patch", json={**_ld_request(pair, hook="z", by_position=True),
                                        "corrupted_tokens": other}).json()["grid"]
    assert g2["cells_skipped"] == L * H


@pytest.mark.slow
def test_gpt2_small_grids_equal_transformerlens(tmp_path, make_client):
    """On a random GPT-2-small-shaped model (12 layers, 12 heads, d_model 768, vocabulary
    50257): the [layer, head] grid of q in layers 0, 6 and 11 and the [layer, head, dest_pos]
    pattern grid of heads 0, 5, 11 in layer 7 (TL on those cells through index_df; the bundled
    model's tests run every cell) equal TransformerLens 4.3 to max(1e-5, 2 x TL's clean logit
    gap)."""
    import pandas as pd
    from transformer_lens import patching
    from transformers import GPT2LMHeadModel

    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime
    from interventions_reference import gpt2_small_dir

    d = gpt2_small_dir(tmp_path / "gpt2small")
    c = make_client(Runtime.load(Settings(model=str(d))), model=str(d))
    b = tl_bridge(d)
    clean = induction_ids(1, 4, 2)  # ids of the bundled tokenizer (gpt2_small_dir uses it)
    corrupted = clean[:2] + induction_ids(7, 7, 1)[1:]
    T = len(clean)
    pr = (clean, corrupted)
    _, cache = b.run_with_cache(torch.tensor([clean]))
    metric = _tl_metric(pr)
    hf = GPT2LMHeadModel.from_pretrained(d, attn_implementation="eager").eval()
    with torch.no_grad():
        gap = max(float((b(torch.tensor([x])) - hf(torch.tensor([x]), use_cache=False).logits
                         ).abs().max()) for x in pr)
    bound = max(1e-5, 2 * gap)
    layers, heads = [0, 6, 11], [0, 5, 11]
    r = c.post("/v1/patch", json=_ld_request(pr, hook="q", patch_layers=layers))
    assert r.status_code == 200, r.text
    ours = _np(r.json()["grid"]["raw"])
    assert ours.shape == (12, 12)
    df = pd.DataFrame([(la, h) for la in layers for h in range(12)],
                      columns=["layer", "head_index"])
    ref = patching.get_act_patch_attn_head_q_all_pos(
        b, torch.tensor([corrupted]), cache, metric, index_axis_names=None,
        index_df=df).double().numpy().reshape(len(layers), 12)
    assert np.abs(ours[layers] - ref).max() <= bound, (np.abs(ours[layers] - ref).max(), gap)
    r = c.post("/v1/patch", json=_ld_request(pr, hook="pattern", by_position=True,
                                             patch_layers=[7], patch_heads=heads))
    ours = _np(r.json()["grid"]["raw"])[7][heads]  # TL's [layer, head, dest_pos]
    df = pd.DataFrame([(7, h, q) for h in heads for q in range(T)],
                      columns=["layer", "head_index", "dest_pos"])
    ref = patching.get_act_patch_attn_head_pattern_by_pos(
        b, torch.tensor([corrupted]), cache, metric, index_axis_names=None,
        index_df=df).double().numpy().reshape(len(heads), T)
    assert np.abs(ours - ref).max() <= bound, (np.abs(ours - ref).max(), gap)


def test_attribution_subsets(client, pair):
    """Attribution with subsets: an all-position head cell with patch_positions is the sum of
    its by-position cells over those positions (first order: the estimates add); cells
    outside patch_layers / patch_heads are null, as in the exact grid."""
    ps = [7, 9, 11]
    base = _ld_request(pair, method="attribution", add_bos=False)
    by = _np(client.post("/v1/patch", json={**base, "hook": "z", "by_position": True}
                         ).json()["grid"]["raw"])
    r = client.post("/v1/patch", json={**base, "hook": "z", "patch_positions": ps}).json()
    k = r["corrupted_value"]
    together = _np(r["grid"]["raw"])
    assert np.abs(together - (k + (by[:, ps] - k).sum(1))).max() <= 1e-5
    sub = _np(client.post("/v1/patch", json={**base, "hook": "z", "patch_layers": [0],
                                             "patch_heads": [1, 3]}).json()["grid"]["raw"])
    assert np.isnan(sub[1]).all() and np.isnan(sub[0, [0, 2]]).all()
    assert np.isfinite(sub[0, [1, 3]]).all()
