"""/v1/patch over a dataset of (clean, corrupted) pairs (issue 27 item 4): the dataset's means
equal numpy's mean of the single-pair requests' values EXACTLY (float64 mean of the same float32
numbers, same numpy reduction), its spread equals numpy's std(ddof=1) and std / sqrt(n), the
two normalisations (of the means, Wang et al. 2022; the mean of per-pair values, Heimersheim &
Nanda 2024) are what they say, a planted fault (one pair's clean and corrupted swapped) is
caught by the same comparison, and bad input is named. Real bundled GPT-2, in-process app."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import assert_error
from interventions_reference import induction_ids


def _np(nested) -> np.ndarray:
    def conv(x):
        return [conv(y) for y in x] if isinstance(x, list) else (np.nan if x is None else x)
    return np.array(conv(nested), dtype=np.float64)


def _pair(seed: int, seg: int) -> dict:
    """An induction pair: the corrupted prompt's second half is another random segment, so
    the last token's induction target differs; target = clean's, distractor = corrupted's."""
    clean = induction_ids(seed, seg, 2)
    other = induction_ids(seed + 100, seg, 1)
    corrupted = clean[: 1 + seg] + other[1:]
    return {"clean_tokens": clean, "corrupted_tokens": corrupted,
            "metric": {"kind": "logit_diff", "terms": [
                {"position": -2, "target": clean[-1], "distractor": corrupted[-1]}]}}


METRIC = {"kind": "logit_diff", "terms": [{"position": -2, "target": 1, "distractor": 2}]}


def _single(pr: dict, swapped: bool = False, **kw) -> dict:
    c, k = pr["clean_tokens"], pr["corrupted_tokens"]
    if swapped:
        c, k = k, c
    return {"clean_tokens": c, "corrupted_tokens": k, "metric": pr["metric"], **kw}


@pytest.fixture(scope="module")
def pairs_same():
    return [_pair(s, 5) for s in range(4)]


@pytest.fixture(scope="module")
def pairs_mixed():
    return [_pair(s, 4 + s % 3) for s in range(5)]  # 9, 11, 13, 9, 11 tokens


def _check_dataset(client, pairs, key_raw, key_norm, **kw):
    r = client.post("/v1/patch", json={"pairs": pairs, "metric": METRIC, "per_pair": True, **kw})
    assert r.status_code == 200, r.text
    d = r.json()
    singles = []
    for pr in pairs:
        s = client.post("/v1/patch", json=_single(pr, **kw))
        assert s.status_code == 200, s.text
        singles.append(s.json())
    get_raw = key_raw
    raw = np.stack([_np(get_raw(s)) for s in singles])
    nrm = np.stack([_np(key_norm(s)) for s in singles])
    cv = np.array([s["clean_value"] for s in singles])
    kv = np.array([s["corrupted_value"] for s in singles])
    n = len(pairs)
    # means: exactly numpy's mean of the single requests' served numbers
    assert d["clean_value"] == cv.mean() and d["corrupted_value"] == kv.mean()
    np.testing.assert_array_equal(_np(get_raw(d)), raw.mean(0))
    ds = d["dataset"]
    assert ds["n_pairs"] == n and [p["n_tokens"] for p in ds["pairs"]] == [
        len(p["clean_tokens"]) for p in pairs]
    # spread: numpy's sample std (ddof 1) and std / sqrt(n)
    np.testing.assert_array_equal(_np(ds["grid"]["raw_std"]), raw.std(0, ddof=1))
    np.testing.assert_array_equal(_np(ds["grid"]["raw_sem"]), raw.std(0, ddof=1) / math.sqrt(n))
    assert ds["clean"]["std"] == cv.std(ddof=1) and ds["clean"]["values"] == cv.tolist()
    assert ds["corrupted"]["sem"] == kv.std(ddof=1) / math.sqrt(n)
    # normalised of the means vs the mean of per-pair normalised
    of_means = (raw.mean(0) - kv.mean()) / (cv.mean() - kv.mean())
    np.testing.assert_allclose(_np(key_norm(d)), of_means, rtol=0, atol=1e-12)
    assert ds["grid"]["n_normalized"] == n
    np.testing.assert_array_equal(_np(ds["grid"]["normalized_mean"]), nrm.mean(0))
    np.testing.assert_array_equal(_np(ds["grid"]["normalized_std"]), nrm.std(0, ddof=1))
    np.testing.assert_array_equal(_np(ds["grid"]["per_pair_raw"]), raw)
    # the two normalisations are different numbers on this dataset (gaps differ per pair)
    assert np.nanmax(np.abs(of_means - nrm.mean(0))) > 1e-4
    return d, raw


def test_head_grid_over_pairs_of_different_lengths(client, pairs_mixed):
    """The head grid (no hook: z at every position, [layer, head]) over pairs of 9, 11, 13
    tokens."""
    d, _ = _check_dataset(client, pairs_mixed, lambda b: b["heads_raw"], lambda b: b["heads"])
    assert d["grid"] is None and len(d["heads"]) == 2


@pytest.mark.parametrize("kw", [{"hook": "resid_pre"}, {"hook": "z", "by_position": True},
                                {"hook": "mlp_out", "patch_layers": [1]}])
def test_hook_grids_over_pairs(client, pairs_same, kw):
    d, raw = _check_dataset(client, pairs_same, lambda b: b["grid"]["raw"],
                            lambda b: b["grid"]["normalized"], **kw)
    assert d["grid"]["shape"] == list(raw.shape[1:])
    if "patch_layers" in kw:  # the cells not computed stay null in every statistic
        g = d["dataset"]["grid"]
        assert all(v is None for v in g["raw_std"][0] + g["normalized_mean"][0])
        assert all(v is not None for v in g["raw_std"][1][len(raw[0][1]) // 2:])


def test_planted_fault_one_pair_swapped_is_caught(client, pairs_same):
    """One pair's clean and corrupted prompts swapped: the mean of single requests then
    differs from the dataset's (so the equality checks above can fail)."""
    kw = {"hook": "resid_pre"}
    d = client.post("/v1/patch", json={"pairs": pairs_same, "metric": METRIC, **kw}).json()
    singles = [client.post("/v1/patch", json=_single(pr, swapped=(i == 2), **kw)).json()
               for i, pr in enumerate(pairs_same)]
    raw = np.stack([_np(s["grid"]["raw"]) for s in singles])
    assert np.abs(_np(d["grid"]["raw"]) - raw.mean(0)).max() > 1e-3
    assert d["clean_value"] != np.mean([s["clean_value"] for s in singles])


def test_one_pair_equals_the_single_request(client, pairs_same):
    pr = pairs_same[0]
    d = client.post("/v1/patch", json={"pairs": [pr], "metric": METRIC, "hook": "z"}).json()
    s = client.post("/v1/patch", json=_single(pr, hook="z")).json()
    assert d["grid"]["raw"] == s["grid"]["raw"] and d["clean_value"] == s["clean_value"]
    assert d["dataset"]["clean"]["std"] is None and d["dataset"]["clean"]["sem"] is None


def test_texts_as_pairs(client):
    """Pairs given as texts are tokenized with add_bos (as a single request's texts)."""
    pr = {"clean_text": "When Mary and John went to the store, she gave a drink to",
          "corrupted_text": "When Mary and John went to the store, he gave a drink to"}
    body = {"logit_diff": {"target": " him", "distractor": " her"}}
    d = client.post("/v1/patch", json={"pairs": [pr, pr], **body})
    assert d.status_code == 200, d.text
    s = client.post("/v1/patch", json={**pr, **body, "hook": None}).json()
    # the legacy head grid (recorded forwards) vs the dataset's (hooked forwards): float32
    # rounding apart
    assert np.abs(_np(d.json()["heads_raw"]) - _np(s["heads_raw"])).max() <= 1e-5
    assert d.json()["dataset"]["clean"]["std"] == 0.0


def test_bad_input_is_named(client, pairs_same, pairs_mixed, make_client, gpt2_runtime):
    bad = [dict(p) for p in pairs_same]
    bad[3] = dict(bad[3], corrupted_tokens=bad[3]["corrupted_tokens"][:-1])
    e = assert_error(client.post("/v1/patch", json={"pairs": bad, "metric": METRIC}), 422,
                     param="pairs.3.corrupted_tokens")
    assert "11 tokens" in e["message"] and "10" in e["message"]
    r = client.post("/v1/patch", json={"pairs": [], "metric": METRIC})
    assert r.status_code == 422 and "pairs" in str(r.json()["error"]["param"])
    e = assert_error(client.post("/v1/patch", json={"pairs": pairs_mixed, "metric": METRIC,
                                                    "hook": "resid_pre"}), 422, param="pairs.1")
    assert "position axis" in e["message"]
    e = assert_error(client.post("/v1/patch", json={
        "pairs": pairs_same, "clean_tokens": [0, 1], "metric": METRIC}), 422)
    wrong = [dict(p, metric={"kind": "prob", "terms": [{"position": -2, "target": 1}]})
             if i == 1 else p for i, p in enumerate(pairs_same)]
    assert_error(client.post("/v1/patch", json={"pairs": wrong, "metric": METRIC}), 422,
                 param="pairs.1.metric")
    out = [dict(p) for p in pairs_same]
    out[2] = dict(out[2], metric={"kind": "logit_diff", "terms": [
        {"position": 40, "target": 1, "distractor": 2}]})
    e = assert_error(client.post("/v1/patch", json={"pairs": out, "metric": METRIC}), 422,
                     param="pairs.2.metric.terms.0.position")
    assert e["message"].startswith("pairs.2")
    small = make_client(gpt2_runtime, max_request_flops=2e8)
    assert_error(small.post("/v1/patch", json={"pairs": pairs_same, "metric": METRIC,
                                               "hook": "z", "by_position": True}), 422,
                 type_="device_limit_exceeded", param="pairs")


# ------------------------------------------------------------------ /v1/ablate over texts
@pytest.fixture(scope="module")
def texts():
    return [induction_ids(s, 4 + s, 2) for s in range(3)]  # 9, 11, 13 tokens


ABL_METRIC = {"kind": "loss", "terms": [{"position": -3}, {"position": -2}]}


def _ablate_singles(client, texts, **kw):
    out = []
    for ids in texts:
        extra = {"reference_token_lists": texts} if kw.get("method") == "mean" and \
            "reference_token_lists" not in kw else {}
        r = client.post("/v1/ablate", json={"tokens": ids, **kw, **extra})
        assert r.status_code == 200, r.text
        out.append(r.json())
    return out


@pytest.mark.parametrize("kw", [
    {"heads": [[0, 0], [1, 1]], "method": "zero"},
    {"heads": [[0, 1]], "method": "mean"},
    {"components": [{"kind": "mlp", "layer": 0}], "heads": [[1, 0]], "method": "mean"},
])
def test_ablate_dataset_equals_mean_of_single_texts(client, texts, kw):
    """Per text equal to a single request whose mean ablation pools the whole dataset
    (reference_token_lists = the texts); averaged exactly as numpy's mean; spread numpy's."""
    kw = dict(kw, metric=ABL_METRIC, logit_diff={"target": "0", "distractor": "1"})
    r = client.post("/v1/ablate", json={"token_lists": texts, "per_text": True, **kw})
    assert r.status_code == 200, r.text
    d = r.json()
    singles = _ablate_singles(client, texts, **kw)
    st = d["dataset"]["stats"]
    for name, get in (("mean_loss_clean", lambda b: b["mean_loss_clean"]),
                      ("mean_loss_ablated", lambda b: b["mean_loss_ablated"]),
                      ("mean_kl", lambda b: b["mean_kl"]),
                      ("logit_diff_ablated", lambda b: b["logit_diff"]["ablated"]),
                      ("metric_ablated", lambda b: b["metric"]["ablated"])):
        v = np.array([get(b) for b in singles])
        assert st[name]["values"] == v.tolist(), name
        assert st[name]["mean"] == v.mean() and st[name]["std"] == v.std(ddof=1), name
        assert st[name]["sem"] == v.std(ddof=1) / math.sqrt(len(v)), name
    assert d["mean_kl"] == st["mean_kl"]["mean"] and d["metric"]["ablated"] == \
        st["metric_ablated"]["mean"]
    assert d["dataset"]["mean_over"] == ("dataset" if kw["method"] == "mean" else "")
    if kw["method"] == "mean":  # planted fault: each text's own mean instead of the dataset's
        own = [client.post("/v1/ablate", json={"tokens": ids, **kw}).json()["mean_kl"]
               for ids in texts]
        assert np.abs(np.array(own) - np.array(st["mean_kl"]["values"])).max() > 1e-6


def test_ablate_dataset_scan(client, texts):
    kw = {"scan": True, "scan_metric": "metric", "metric": ABL_METRIC, "method": "mean"}
    d = client.post("/v1/ablate", json={"token_lists": texts, "per_text": True, **kw}).json()
    singles = _ablate_singles(client, texts, **kw)
    g = np.stack([_np(b["scan"]["grid"]) for b in singles])
    np.testing.assert_array_equal(_np(d["scan"]["grid"]), g.mean(0))
    np.testing.assert_array_equal(_np(d["dataset"]["scan_std"]), g.std(0, ddof=1))
    np.testing.assert_array_equal(_np(d["dataset"]["per_text_scan"]), g)


def test_ablate_dataset_bad_input(client, texts):
    e = assert_error(client.post("/v1/ablate", json={"token_lists": texts, "heads": [[0, 0]],
                                                     "positions": [10]}), 422)
    assert e["message"].startswith("token_lists.0") and "positions" in e["param"]
    r = client.post("/v1/ablate", json={"token_lists": [], "heads": [[0, 0]]})
    assert r.status_code == 422 and "token_lists" in str(r.json()["error"]["param"])
    assert_error(client.post("/v1/ablate", json={"token_lists": texts, "heads": [[0, 0]],
                                                 "method": "resample",
                                                 "resample_tokens": texts[0]}), 422)
    assert_error(client.post("/v1/ablate", json={"token_lists": texts, "tokens": texts[0],
                                                 "heads": [[0, 0]]}), 422)


def test_client_passes_dataset_fields(client, pairs_same, texts):
    """The Python client's patch/ablate send pairs / token_lists and parse ``dataset``."""
    from attnscope.client import Client

    with Client(base_url="http://testserver", http_client=client) as c:
        p = c.patch(pairs=pairs_same, metric=METRIC, hook="resid_pre")
        assert p.dataset.n_pairs == len(pairs_same) and p.dataset.clean.sem is not None
        a = c.ablate(token_lists=texts, heads=[[0, 0]])
        assert a.dataset.n_texts == 3 and a.dataset.stats["mean_kl"].n == 3


def test_dataset_over_the_memory_limit_is_named(make_client, pairs_same, texts):
    """A dataset whose largest pair's (text's) forwards exceed max_request_bytes: 422
    memory_limit_exceeded before any forward, as the single request is."""
    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime

    tiny = make_client(Runtime.load(Settings(model="bundled", max_request_bytes=200 << 10)),
                       max_request_bytes=200 << 10)
    assert_error(tiny.post("/v1/patch", json={"pairs": pairs_same, "metric": METRIC,
                                              "hook": "z", "by_position": True}), 422,
                 type_="memory_limit_exceeded")
    assert_error(tiny.post("/v1/ablate", json={"token_lists": texts * 4, "scan": True,
                                               "method": "mean"}), 422,
                 type_="memory_limit_exceeded")


def test_ablate_dataset_mean_over_given_references(client, texts):
    refs = [induction_ids(50 + s, 6, 2) for s in range(2)]
    kw = {"heads": [[0, 1], [1, 0]], "method": "mean", "reference_token_lists": refs}
    d = client.post("/v1/ablate", json={"token_lists": texts, "per_text": True, **kw}).json()
    assert d["dataset"]["mean_over"] == "reference_texts"
    singles = _ablate_singles(client, texts, **kw)
    assert d["dataset"]["stats"]["mean_kl"]["values"] == [b["mean_kl"] for b in singles]
    pooled = _ablate_singles(client, texts, heads=kw["heads"], method="mean")
    assert d["dataset"]["stats"]["mean_kl"]["values"] != [b["mean_kl"] for b in pooled]


@pytest.mark.parametrize("extra", [{"components": [{"kind": "mlp", "layer": 0}]},
                                   {"heads": [[0, 1]]}])
def test_a_mean_ablation_dataset_tokenizes_its_references_once(client, monkeypatch, extra):
    """Method 'mean' over a dataset takes every text as a reference text: planning it used to
    tokenize all n references again for each of the n texts (n^2 token lists: 4,000 texts of
    ~80 tokens OOM-killed the server before any forward). Counted here: the references are
    tokenized once for the whole dataset (a planted per-text tokenization fails the count)."""
    from attnscope.service.serving import interventions as SI

    calls = []
    real = SI.tokenized_list

    def counting(rt, req, field):
        out = real(rt, req, field)
        if field == "reference_texts" and out:
            calls.append(len(out))
        return out

    monkeypatch.setattr(SI, "tokenized_list", counting)
    texts = [[100 + i, 200 + i, 300 + i, 400 + i, 500 + i] for i in range(40)]
    r = client.post("/v1/ablate", json={"token_lists": texts, "method": "mean", **extra})
    assert r.status_code == 200, r.text
    assert calls == [40], calls
