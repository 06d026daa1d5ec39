"""One rule for non-finite values (issue 29 item 1): a checkpoint whose forward produces NaN
makes every /v1 POST endpoint that reports the model's numbers answer the documented 500
``non_finite_values`` (service/errors.py ``NonFiniteValues``), never 200 with null in place
of a number; endpoints that report no number of the model's forward (tokenize; scratch
attention on given matrices or on the static embeddings, which stay finite; circuits, from
the weights) answer 200, and /v1/verify, a check, answers that it failed (by NaN).

The checkpoint: the bundled GPT-2 with one weight of layer 0's first LayerNorm set to NaN,
saved to a tmp dir (every attention pattern, hidden state and logit after it is NaN). The
table names every endpoint of the endpoint table: a new endpoint without an entry fails
test_every_post_endpoint_has_an_entry, so it cannot skip the rule."""

from __future__ import annotations

import functools
import shutil

import pytest
import torch

from attnscope.service.config import Settings
from attnscope.service.runtime import Runtime

A = "The cat sat on the mat and the cat slept."
B = "The dog sat on the rug and the dog slept."  # the same token count as A (checked)
NAN = {"status": 500, "type": "non_finite_values"}
OK = {"status": 200}
VERIFY_FAILS = {"status": 200, "verify_fails": True}
#: path -> [(request body, expected)], one entry per POST endpoint of the endpoint table
CASES: dict[str, list[tuple[dict, dict]]] = {
    "/v1/tokenize": [({"text": A}, OK)],
    "/v1/attention": [({"text": A}, NAN), ({"text": A, "encoding": "base64"}, NAN),
                      ({"text": A, "sparse": {"top_k": 2}}, NAN)],
    "/v1/heads": [({"text": A}, NAN), ({"text": A, "error_measure": "abs"}, NAN)],
    "/v1/links": [({"text": A, "layer": 0}, NAN), ({"text": A, "layer": 1, "by": "norm"}, NAN)],
    "/v1/trajectories": [({"text": A}, NAN)],
    # a check, not a report of the model's numbers: it answers that the served forward
    # differs from the weights' by NaN (passed false, max_abs_diff null, documented nullable)
    "/v1/verify": [({"text": A}, VERIFY_FAILS)],
    "/v1/scratch-attention": [({"q": [[1.0, 0.0], [0.0, 1.0]], "k": [[1.0, 0.0], [0.0, 1.0]],
                                "v": [[1.0, 2.0], [3.0, 4.0]]}, OK), ({"text": A}, OK)],
    "/v1/predictions": [({"text": A}, NAN), ({"texts": [A, B], "top_k": 2}, NAN)],
    "/v1/ablate": [({"text": A, "heads": [[0, 0]]}, NAN), ({"text": A, "scan": True}, NAN),
                   ({"text": A, "heads": [[1, 1]], "method": "mean"}, NAN)],
    "/v1/patch": [({"clean_text": A, "corrupted_text": B, "metric": "loss"}, NAN),
                  ({"clean_text": A, "corrupted_text": B, "metric": "logit_diff",
                    "logit_diff": {"target": " the", "distractor": " a"}}, NAN),
                  ({"clean_text": A, "corrupted_text": B, "metric": "loss", "per_position": True,
                    "residual": True}, NAN),
                  ({"clean_text": A, "corrupted_text": B, "metric": "loss",
                    "method": "attribution"}, NAN)],
    "/v1/attention-norms": [({"text": A}, NAN)],
    "/v1/rollout": [({"text": A}, NAN)],
    "/v1/run": [({"texts": [A], "cache": ["blocks.0.attn.hook_pattern"]}, NAN),
                ({"texts": [A], "logits": {"positions": [-1], "top_k": 3}}, NAN),
                ({"texts": [A], "metrics": {"m": {"kind": "prob", "terms": [
                    {"position": -1, "target": 5}]}}}, NAN),
                ({"texts": [A], "loss": True}, NAN)],
    "/v1/path-patch": [({"pairs": [{"clean_text": A, "corrupted_text": B}],
                         "senders": [{"kind": "head", "layer": 0, "head": 1}],
                         "receivers": [{"kind": "head", "layer": 1, "input": "k"}],
                         "metric": {"kind": "loss", "terms": [{"position": 3}]}}, NAN)],
    # the weights only, LayerNorm not folded in: the NaN ln_1 weight is in no W_OV / W_QK
    "/v1/circuits": [({}, OK)],
    "/v1/logit-lens": [({"text": A}, NAN)],
    "/v1/logit-attribution": [({"text": A, "target": " the"}, NAN)],
}


@functools.lru_cache(maxsize=1)
def _post_paths() -> tuple[str, ...]:
    from attnscope.service.serving.core.table import default_table

    return tuple(ep.path for ep in default_table() if ep.method == "POST")


def test_every_post_endpoint_has_an_entry():
    paths = _post_paths()
    missing = [p for p in paths if p not in CASES]
    assert not missing, f"add {missing} to CASES: what does it answer on a NaN checkpoint?"


@pytest.fixture(scope="module")
def nan_runtime(tmp_path_factory, bundled_dir):
    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("nan_ckpt") / "nan-gpt2"
    shutil.copytree(bundled_dir, d)
    w = load_file(str(d / "model.safetensors"))
    key = next(k for k in w if k.endswith("h.0.ln_1.weight"))
    w[key] = w[key].clone()
    w[key][0] = float("nan")
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    return Runtime.load(Settings(model=str(d)))


def test_the_checkpoint_produces_nan(nan_runtime):
    assert len(nan_runtime.tokenize(A)) == len(nan_runtime.tokenize(B))
    fw = nan_runtime.forward_many([nan_runtime.tokenize(A)])[0]
    assert torch.isnan(fw.pattern).any()


def _case(path, body, want):
    marks = [pytest.mark.xfail(reason=want["xfail"], strict=True)] if "xfail" in want else []
    return pytest.param(path, body, want, marks=marks)


@pytest.mark.parametrize("path, body, want", [
    _case(p, b, w) for p, cases in CASES.items() for b, w in cases])
def test_nan_checkpoint_answers_by_the_one_rule(nan_runtime, make_client, path, body, want):
    if path not in _post_paths():  # an entry for an endpoint this build does not serve
        pytest.skip(f"{path} is not in the endpoint table")
    c = make_client(nan_runtime)
    r = c.post(path, json=body)
    assert r.status_code == want["status"], (path, body, r.status_code, r.text[:300])
    if "type" in want:
        err = r.json()["error"]
        assert err["type"] == want["type"] and "NaN" in err["message"], err
    elif want.get("verify_fails"):
        v = r.json()["verification"]
        assert v["passed"] is False and "NaN" in v["message"], v["message"]
