"""POST /v1/path-patch on the bundled model (layer 0 head 1 a previous-token head, every layer-1
head an induction head), through the real app in-process and the Python client:

* equal to a hand-written TransformerLens 4.3 loop that FREEZES every other component (every
  head's ``attn.hook_result`` and every MLP's ``hook_mlp_out`` set to the base run's, the
  senders' to the other run's), caches the receivers' inputs and runs the base prompt again
  with them set: the README's example (L0H1 -> layer-1 keys), MLP senders and receivers, the
  logits, positions, both directions, every metric kind; and two grid cells;
* planted faults in that reference (MLP 0 not frozen; the q input instead of k) are caught;
* the grid equals the single requests cell by cell; a dataset's mean equals the mean of its
  single-pair requests (pairs of different lengths, per-pair metrics), its std numpy's; chunked
  by a small memory limit it gives the same numbers;
* bad input is a named 4xx; over the memory budget 429.

Bound vs TL: 1e-5 absolute on raw metrics (measured max ~2e-6 on losses up to 18 nats)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from interventions_reference import tl_hooked_bridge
from conftest import assert_error

from attnscope import schemas
from attnscope.client import Client

pytest.importorskip("transformer_lens")

SEG = [211, 1030, 77, 1499, 603, 1877, 342, 958]
CLEAN = [0] + SEG + SEG
CORRUPT = [0] + [1210, 45, 1600, 388, 1777, 90, 1402, 633] + SEG
SECOND = list(range(len(SEG) + 1, len(CLEAN) - 1))
LOSS = {"kind": "loss", "terms": [{"position": p} for p in SECOND]}
TOL = 1e-5  # raw metrics vs TransformerLens 4.3 (float32 both; see the module docstring)
#: one request's numbers vs the same cells in other batches (float32 kernels differ with the
#: batch's shape: a few ulps of values up to ~20, measured 8e-6)
BATCH_TOL = 1e-5
L, NH = 2, 4


@pytest.fixture(scope="module")
def tl(bundled_dir):
    return tl_hooked_bridge(bundled_dir)


@pytest.fixture(scope="module")
def api(client):
    return Client("http://testserver", http_client=client, max_retries=0)


def post(client, **body):
    r = client.post("/v1/path-patch", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# ------------------------------------------------------------------ the reference
def tl_metric(logits: torch.Tensor, ids: list[int], metric: dict, base_logits=None) -> float:
    """A /v1/run metric on one run's logits ``[pos, vocab]`` (KL: run 0 = this one, 1 = base)."""
    T = len(ids)
    lp = torch.log_softmax(logits.double(), -1)
    vals = []
    for t in metric["terms"]:
        p = t["position"] % T
        if metric["kind"] == "loss":
            vals.append(-lp[p, ids[p + 1]])
        elif metric["kind"] == "logit_diff":
            vals.append(logits[p, t["target"]].double() - logits[p, t["distractor"]].double())
        elif metric["kind"] == "logprob":
            vals.append(lp[p, t["target"]])
        elif metric["kind"] == "prob":
            vals.append(lp[p, t["target"]].exp())
        else:
            lb = torch.log_softmax(base_logits.double(), -1)
            la_, lb_ = [lp, lb][t["prompt"]][p], [lp, lb][t["reference_prompt"]][p]
            vals.append((la_.exp() * (la_ - lb_)).sum())
    v = torch.stack(vals)
    return float(v.mean() if metric.get("reduce", "mean") == "mean" else v.sum())


def tl_path_patch(tl, base: list[int], other: list[int], senders, receivers, metric, *,
                  sender_positions=None, receiver_positions=None, freeze_mlps=True,
                  input_override=None, mlp_input="mlp.hook_in") -> dict:
    """Path patching by hand with TransformerLens hooks (Wang et al. 2022's three steps):
    (1) both runs cached; (2) the base run with every head's result and every MLP's output set
    to the base run's values except the senders' (the other run's, at the sender positions),
    the receivers' inputs cached; (3) the base run with the receivers' inputs set to those (at
    the receiver positions). ``freeze_mlps=False``, ``input_override`` (q/k/v for every head
    receiver) and ``mlp_input`` (the hook an MLP receiver is set at, e.g. ``hook_resid_pre``:
    the whole block reads it) plant faults."""
    bt, ot = torch.tensor([base]), torch.tensor([other])
    T = len(base)
    sp = list(range(T)) if sender_positions is None else [p % T for p in sender_positions]
    rp = list(range(T)) if receiver_positions is None else [p % T for p in receiver_positions]
    with torch.no_grad():
        base_logits, cb = tl.run_with_cache(bt)
        other_logits, co = tl.run_with_cache(ot)

        def freeze(name, head_of=None):
            def hook(t, hook):
                t[:] = cb[name]
                for s in senders:
                    if s["kind"] == "head" and name == f"blocks.{s['layer']}.attn.hook_result":
                        t[:, sp, s["head"]] = co[name][:, sp, s["head"]]
                    if s["kind"] == "mlp" and name == f"blocks.{s['layer']}.hook_mlp_out":
                        t[:, sp] = co[name][:, sp]
                return t
            return hook

        step2 = [(f"blocks.{lyr}.attn.hook_result", freeze(f"blocks.{lyr}.attn.hook_result"))
                 for lyr in range(L)]
        if freeze_mlps:
            step2 += [(f"blocks.{lyr}.hook_mlp_out", freeze(f"blocks.{lyr}.hook_mlp_out"))
                      for lyr in range(L)]
        else:  # planted fault: MLPs recompute, except a sender MLP's own output
            step2 += [(f"blocks.{s['layer']}.hook_mlp_out", freeze(f"blocks.{s['layer']}.hook_mlp_out"))
                      for s in senders if s["kind"] == "mlp"]
        with tl.hooks(fwd_hooks=step2):
            _, c2 = tl.run_with_cache(bt)
        step3 = []
        for r in receivers:
            if r["kind"] == "head":
                heads = r.get("heads")  # None: every head of the hook (kv heads for k/v on GQA)
                name = f"blocks.{r['layer']}.hook_{input_override or r['input']}_input"
            elif r["kind"] == "mlp":
                # the MLP's own input (ln2's output): TL 4.3's bridge edits the MLP alone
                # there (an edit of ln2.hook_in / hook_resid_mid reaches the residual stream,
                # not the MLP: measured)
                heads, name = None, f"blocks.{r['layer']}.{mlp_input}"
            else:
                heads, name = None, "ln_final.hook_in"

            def hook(t, hook, name=name, heads=heads):
                if heads is None:
                    t[:, rp] = c2[name][:, rp]
                else:  # the receiver heads alone (t [batch, pos, head, d_model])
                    for h in heads:
                        t[:, rp, h] = c2[name][:, rp, h]
                return t
            step3.append((name, hook))
        patched_logits = tl.run_with_hooks(bt, fwd_hooks=step3)
    return {"base": tl_metric(base_logits[0], base, metric, base_logits[0]),
            "other": tl_metric(other_logits[0], other, metric, base_logits[0]),
            "patched": tl_metric(patched_logits[0], base, metric, base_logits[0])}


README_CASE = dict(senders=[{"kind": "head", "layer": 0, "head": 1}],
                   receivers=[{"kind": "head", "layer": 1, "input": "k"}], metric=LOSS)


def test_readme_example_equals_a_hand_written_transformerlens_loop(client, tl):
    out = post(client, pairs=[{"clean_tokens": CLEAN, "corrupted_tokens": CORRUPT}], **README_CASE)
    ref = tl_path_patch(tl, CLEAN, CORRUPT, **README_CASE)
    assert out["base_run"] == "clean" and out["other_run"] == "corrupted"
    for k in ("base", "other", "patched"):
        assert abs(out[k]["mean"] - ref[k]) <= TOL, (k, out[k], ref[k])
    assert out["patched"]["n"] == 1 and out["patched"]["std"] is None
    # the README's story: L0H1 hardly reaches the induction heads' keys directly
    assert out["patched"]["mean"] == pytest.approx(0.0341, abs=5e-4)
    assert out["normalized"] == pytest.approx(
        (out["patched"]["mean"] - out["base"]["mean"]) / (out["other"]["mean"] - out["base"]["mean"]),
        rel=1e-5)
    assert out["receivers"] == [{"kind": "head", "layer": 1, "heads": [0, 1, 2, 3], "input": "k",
                                 "head_axis": "head"}]


def test_planted_faults_in_the_reference_are_caught(client, tl):
    """The comparison is sharp: a reference that lets MLP 0 recompute (the path through MLP 0,
    README: 17.8 nats) or patches the queries instead of the keys disagrees by far more than
    the bound."""
    out = post(client, pairs=[{"clean_tokens": CLEAN, "corrupted_tokens": CORRUPT}], **README_CASE)
    loose = tl_path_patch(tl, CLEAN, CORRUPT, **README_CASE, freeze_mlps=False)
    assert abs(out["patched"]["mean"] - loose["patched"]) > 1.0
    wrong_input = tl_path_patch(tl, CLEAN, CORRUPT, **README_CASE, input_override="q")
    assert abs(out["patched"]["mean"] - wrong_input["patched"]) > 100 * TOL


LD = {"kind": "logit_diff", "terms": [{"position": -1, "target": SEG[0], "distractor": 1210},
                                      {"position": 12, "target": SEG[4], "distractor": 1777}]}
CASES = {
    "mlp0->L1 q": dict(senders=[{"kind": "mlp", "layer": 0}],
                       receivers=[{"kind": "head", "layer": 1, "heads": [0, 2], "input": "q"}],
                       metric=LOSS),
    "L0H1+MLP0->logits": dict(senders=[{"kind": "head", "layer": 0, "head": 1},
                                       {"kind": "mlp", "layer": 0}],
                              receivers=[{"kind": "logits"}], metric=LD),
    "L0H1->MLP0 (same layer), positions": dict(
        senders=[{"kind": "head", "layer": 0, "head": 1}], receivers=[{"kind": "mlp", "layer": 0}],
        metric=LOSS, sender_positions=list(range(1, 9)), receiver_positions=[2, 3, 4, -9]),
    "L0H0+L0H1->L1 v + MLP1, logprob sum": dict(
        senders=[{"kind": "head", "layer": 0, "head": 0}, {"kind": "head", "layer": 0, "head": 1}],
        receivers=[{"kind": "head", "layer": 1, "heads": [3], "input": "v"},
                   {"kind": "mlp", "layer": 1}],
        metric={"kind": "logprob", "reduce": "sum",
                "terms": [{"position": p, "target": CLEAN[p + 1]} for p in SECOND]}),
    "L0H1->L1 k, kl": dict(
        senders=[{"kind": "head", "layer": 0, "head": 1}],
        receivers=[{"kind": "head", "layer": 1, "input": "k"}, {"kind": "head", "layer": 1,
                                                              "heads": [1], "input": "q"}],
        metric={"kind": "kl", "terms": [{"prompt": 1, "reference_prompt": 0, "position": p}
                                        for p in (10, 14, -1)]}),
    "prob, clean_to_corrupted": dict(
        senders=[{"kind": "mlp", "layer": 0}],
        receivers=[{"kind": "head", "layer": 1, "input": "k"}, {"kind": "mlp", "layer": 1}],
        metric={"kind": "prob", "terms": [{"position": p, "target": CLEAN[p + 1]} for p in SECOND]},
        direction="clean_to_corrupted"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_equals_transformerlens_for_each_component_kind_and_metric(client, tl, name):
    case = dict(CASES[name])
    direction = case.pop("direction", "corrupted_to_clean")
    out = post(client, pairs=[{"clean_tokens": CLEAN, "corrupted_tokens": CORRUPT}],
               direction=direction, **case)
    base, other = (CLEAN, CORRUPT) if direction == "corrupted_to_clean" else (CORRUPT, CLEAN)
    ref = tl_path_patch(tl, base, other, **case)
    for k in ("base", "other", "patched"):
        assert abs(out[k]["mean"] - ref[k]) <= TOL, (name, k, out[k], ref[k])
    assert abs(out["patched"]["mean"] - out["base"]["mean"]) > 1e-4, name  # the path did something


def grid_body(**kw) -> dict:
    return dict(pairs=[{"clean_tokens": CLEAN, "corrupted_tokens": CORRUPT}], grid=True,
                metric=LOSS, **kw)


def test_grid_cells_equal_transformerlens(client, tl):
    out = post(client, **grid_body())
    g = out["grid"]
    assert g["inputs"] == ["q", "k", "v"]
    raw = np.array(g["raw"], dtype=object)
    assert raw.shape == (L, NH, L, NH, 3)
    assert all(v is None for v in raw[1].ravel()) and all(v is None for v in raw[0, :, 0].ravel())
    for (hs, hr, k) in [(1, 2, "k"), (3, 0, "v"), (1, 1, "q")]:
        ref = tl_path_patch(tl, CLEAN, CORRUPT, [{"kind": "head", "layer": 0, "head": hs}],
                            [{"kind": "head", "layer": 1, "heads": [hr], "input": k}], LOSS)
        cell = g["raw"][0][hs][1][hr]["qkv".index(k)]
        assert abs(cell - ref["patched"]) <= TOL, (hs, hr, k, cell, ref)
        z = g["normalized"][0][hs][1][hr]["qkv".index(k)]
        assert z == pytest.approx((cell - out["base"]["mean"]) /
                                  (out["other"]["mean"] - out["base"]["mean"]), rel=1e-4, abs=1e-7)


def test_the_grid_equals_the_single_requests_cell_by_cell(client):
    out = post(client, **grid_body(grid_inputs=["v", "k", "q"]))
    for hs in range(NH):
        for hr in range(NH):
            for ki, k in enumerate(["v", "k", "q"]):
                one = post(client, pairs=[{"clean_tokens": CLEAN, "corrupted_tokens": CORRUPT}],
                           senders=[{"kind": "head", "layer": 0, "head": hs}],
                           receivers=[{"kind": "head", "layer": 1, "heads": [hr], "input": k}],
                           metric=LOSS)
                assert out["grid"]["raw"][0][hs][1][hr][ki] == pytest.approx(
                    one["patched"]["mean"], abs=BATCH_TOL), (hs, hr, k)


def _pairs():
    """Four pairs: two lengths, token ids and texts, each pair its own logit-diff tokens."""
    rng = np.random.default_rng(0)
    out = []
    for n in (6, 6, 9):
        seg = rng.choice(np.arange(100, 2000), n, replace=False).tolist()
        alt = rng.choice(np.arange(100, 2000), n, replace=False).tolist()
        out.append({"clean_tokens": [0] + seg + seg, "corrupted_tokens": [0] + alt + seg,
                    "metric": {"kind": "logit_diff", "terms": [
                        {"position": -2, "target": seg[-1], "distractor": alt[-1]}]}})
    out.append({"clean_text": "The cat sat on the mat and the dog sat on the",
                "corrupted_text": "The dog sat on the mat and the cat sat on the",
                "metric": {"kind": "logit_diff", "terms": [
                    {"position": -1, "target": " the", "distractor": " a"}]}})
    return out


DEFAULT_LD = {"kind": "logit_diff", "terms": [{"position": -1, "target": 5, "distractor": 6}]}


def test_a_dataset_mean_equals_the_mean_of_single_pair_requests(client):
    pairs = _pairs()
    case = dict(senders=[{"kind": "head", "layer": 0, "head": 1}],
                receivers=[{"kind": "head", "layer": 1, "input": "q"},
                           {"kind": "head", "layer": 1, "input": "k"}], metric=DEFAULT_LD)
    out = post(client, pairs=pairs, per_pair=True, **case)
    assert len({p["n_tokens"] for p in out["pairs"]}) == 3  # grouped by length
    singles = [post(client, pairs=[p], **case) for p in pairs]
    for k in ("base", "other", "patched"):
        vals = np.array([s[k]["mean"] for s in singles])
        assert out[k]["n"] == len(pairs)
        assert out[k]["values"] == pytest.approx(vals.tolist(), abs=BATCH_TOL)
        assert out[k]["mean"] == pytest.approx(vals.mean(), abs=BATCH_TOL)
        assert out[k]["std"] == pytest.approx(vals.std(ddof=1), abs=BATCH_TOL)
    assert out["normalized"] == pytest.approx(
        (out["patched"]["mean"] - out["base"]["mean"]) / (out["other"]["mean"] - out["base"]["mean"]),
        rel=1e-5)
    # the grid over the dataset: the mean and std of the single pairs' grids
    grid = post(client, pairs=pairs, grid=True, metric=DEFAULT_LD)["grid"]
    per = np.array([np.array(post(client, pairs=[p], grid=True, metric=DEFAULT_LD)["grid"]["raw"],
                             dtype=object)[0, :, 1].astype(float) for p in pairs])
    assert np.allclose(np.array(grid["raw"], dtype=object)[0, :, 1].astype(float),
                       per.mean(0), atol=BATCH_TOL)
    assert np.allclose(np.array(grid["std"], dtype=object)[0, :, 1].astype(float),
                       per.std(0, ddof=1), atol=2 * BATCH_TOL)


def test_chunked_by_a_small_memory_estimate_gives_the_same_numbers(client, monkeypatch,
                                                                   gpt2_runtime):
    """With a 1 MiB chunk size each patched forward holds at most two rows (of 48 cells per
    pair) and the base runs a pair or two: the same numbers as one chunk."""
    from attnscope.service.serving import path_patch as PP

    pairs = _pairs()
    big = post(client, pairs=pairs, grid=True, metric=DEFAULT_LD)
    monkeypatch.setattr(PP, "CHUNK_BYTES", 1 << 20)
    req = schemas.PathPatchRequest(pairs=pairs, grid=True, metric=DEFAULT_LD)
    import re

    detail = PP.plan(gpt2_runtime, req, []).detail
    assert int(re.search(r"chunks of up to (\d+) rows", detail).group(1)) <= 2, detail
    out = post(client, pairs=pairs, grid=True, metric=DEFAULT_LD)
    a = np.array(big["grid"]["raw"], dtype=object)[0, :, 1].astype(float)
    b = np.array(out["grid"]["raw"], dtype=object)[0, :, 1].astype(float)
    assert np.allclose(a, b, atol=BATCH_TOL)
    assert out["base"] == big["base"]


def test_client_method(api):
    out = api.path_patch(clean=CLEAN, corrupted=CORRUPT, senders=[(0, 1)],
                         receivers=[(1, "k")], metric=LOSS)
    assert isinstance(out, schemas.PathPatchResponse)
    assert out.patched.mean == pytest.approx(0.0341, abs=5e-4)
    g = api.path_patch(pairs=[(CLEAN, CORRUPT)], grid=True, metric=LOSS)
    assert g.grid.raw[0][1][1][0][1] is not None and g.patched is None


# ------------------------------------------------------------------ refusals
PAIR = {"clean_tokens": CLEAN, "corrupted_tokens": CORRUPT}
H01 = {"kind": "head", "layer": 0, "head": 1}
K1 = {"kind": "head", "layer": 1, "input": "k"}


@pytest.mark.parametrize("body, status, type_, param, words", [
    ({"pairs": [{"clean_tokens": CLEAN, "corrupted_tokens": CORRUPT[:-1]}], "senders": [H01],
      "receivers": [K1]}, 422, "validation_error", "pairs.0.corrupted_tokens", "same token count"),
    ({"pairs": [PAIR], "senders": [{"kind": "head", "layer": 1, "head": 0}], "receivers": [K1]},
     422, "validation_error", "receivers.0", "not after sender 0"),
    ({"pairs": [PAIR], "senders": [{"kind": "mlp", "layer": 1}],
      "receivers": [{"kind": "mlp", "layer": 1}]}, 422, "validation_error", "receivers.0",
     "not after"),
    ({"pairs": [PAIR], "senders": [{"kind": "attn", "layer": 0}], "receivers": [K1]},
     422, "validation_error", None, "kind"),
    ({"pairs": [PAIR], "senders": [{"kind": "head", "layer": 2, "head": 0}], "receivers": [K1]},
     422, "out_of_range", "senders.0.layer", "2 layers"),
    ({"pairs": [PAIR], "senders": [H01], "receivers": [{"kind": "head", "layer": 1,
                                                       "heads": [4], "input": "q"}]},
     422, "out_of_range", "receivers.0.heads.0", "4 heads"),
    ({"pairs": [PAIR], "senders": [H01], "receivers": [K1], "receiver_positions": [17]},
     422, "out_of_range", "receiver_positions.0", "17"),
    ({"pairs": [PAIR], "senders": [H01], "receivers": [K1], "metric": {
        "kind": "loss", "terms": [{"position": 16}]}}, 422, "validation_error",
     "metric.terms.0.position", "no next token"),
    ({"pairs": [PAIR], "senders": [H01], "receivers": [K1], "metric": {
        "kind": "loss", "terms": [{"prompt": 1, "position": 3}]}}, 422, "validation_error",
     "metric.terms.0.prompt", "null or 0"),
    ({"pairs": [PAIR], "senders": [H01], "receivers": [K1, {"kind": "logits"}]},
     422, "validation_error", "receivers.1", "alone"),
    ({"pairs": [PAIR], "senders": [H01, H01], "receivers": [K1]},
     422, "validation_error", "senders.1", "twice"),
    ({"pairs": [PAIR], "grid": True, "senders": [H01]}, 422, "validation_error", None,
     "leave"),
    ({"pairs": [PAIR], "senders": [H01], "receivers": [K1], "metric": {
        "kind": "logit_diff", "terms": [{"position": -1, "target": " Mary", "distractor": 1}]}},
     422, "validation_error", "metric.terms.0.target", "not one"),
])
def test_bad_input_is_a_named_4xx(client, body, status, type_, param, words):
    body = {"metric": LOSS, **body}
    r = client.post("/v1/path-patch", json=body)
    e = assert_error(r, status, type_=type_, param=param)
    assert words in e["message"], e


def test_over_the_budget_is_429(make_client, gpt2_runtime):
    from attnscope.service.serving import path_patch as PP
    from attnscope.service.serving.core.memory import check_memory

    body = grid_body()
    need = check_memory(gpt2_runtime, [], PP.plan(
        gpt2_runtime, schemas.PathPatchRequest(**body), []).response_bytes)
    c = make_client(gpt2_runtime, memory_budget_bytes=int(need * 1.5), budget_wait_s=0.2)
    assert c.post("/v1/path-patch", json=body).status_code == 200
    held = c.portal.call(c.app.state.budget.acquire, need)
    r = c.post("/v1/path-patch", json=body)
    assert_error(r, 429, type_="overloaded")
    c.portal.call(held.release)
    assert c.post("/v1/path-patch", json=body).status_code == 200
    tiny = make_client(gpt2_runtime, max_request_bytes=200_000)
    assert_error(tiny.post("/v1/path-patch", json=body), 422, type_="memory_limit_exceeded")
