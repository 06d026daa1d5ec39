"""/v1/logit-lens and /v1/logit-attribution against TransformerLens 4.3 and Hugging Face.

TransformerLens: ``TransformerBridge.boot_transformers(dir)`` with
``enable_compatibility_mode(no_processing=True)`` (the unprocessed weights the service uses) and
``use_attn_result`` on. Its references:

* logit lens "own": ``cache.accumulated_resid(apply_ln=True)`` (TL 4.3 recomputes the final norm
  per state: ``ln_final`` with its weight and bias) ``@ W_U + b_U``;
* logit lens "final": ``cache.apply_ln_to_stack(accumulated_resid(), recompute_ln=False)``
  (centred, divided by ``ln_final.hook_scale``) ``* w + b`` (ln_final's, not folded in
  unprocessed weights) ``@ W_U + b_U``;
* DLA: ``cache.stack_head_results()`` and ``cache.decompose_resid(mode="all",
  incl_embeds=True)`` through ``apply_ln_to_stack``, projected on ``w * (W_U[:, t] -
  W_U[:, d])``.

Bounds: probabilities, losses and attributions <= 1e-5; logits and log-probs (of improbable
targets, ~ -18 nats, whose float32 forward error alone is ~1e-5: ours against a float64 Hugging
Face forward 1.07e-5) <= max(1e-5, 2 x TL's own discrepancy with Hugging Face's logits). Measured values are in the test names'
docstrings. Each check has a planted fault that makes it fail.
"""

from __future__ import annotations

import pytest
import torch

from attnscope.service.analysis import lens as A
from conftest import _client, assert_error
from interventions_reference import gpt2_small_dir

pytest.importorskip("transformer_lens")

IDS = [0, 5, 17, 99, 300, 12, 7, 8, 41, 250, 17, 99, 300]
TEXT = "When Mary and John went to the store, John gave a drink to"


def _bridge(path):
    from transformer_lens.model_bridge import TransformerBridge

    b = TransformerBridge.boot_transformers(str(path), device="cpu")
    b.enable_compatibility_mode(no_processing=True, disable_warnings=True)
    b.set_use_attn_result(True)
    return b


class Ref:
    """Hugging Face and TransformerLens for one checkpoint directory."""

    def __init__(self, path):
        from transformers import GPT2LMHeadModel

        self.hf = GPT2LMHeadModel.from_pretrained(str(path), attn_implementation="eager").eval()
        self.tl = _bridge(path)
        self.w = self.hf.transformer.ln_f.weight.detach()
        self.b = self.hf.transformer.ln_f.bias.detach()
        self.L = self.hf.config.n_layer
        self.H = self.hf.config.n_head

    def run(self, ids):
        with torch.no_grad():
            return self.tl.run_with_cache(torch.tensor([ids]))

    def unembed(self, x):
        return x @ self.tl.W_U + self.tl.b_U


@pytest.fixture(scope="module")
def bundled(bundled_dir):
    return Ref(bundled_dir)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A random GPT-2-small-shaped checkpoint (vocab 50257) served by its own app."""
    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime

    path = gpt2_small_dir(tmp_path_factory.mktemp("lens_small"), seed=3, n_positions=64)
    rt = Runtime.load(Settings(model=str(path)))
    with _client(rt, model=str(path)) as c:
        yield Ref(path), c


# ------------------------------------------------------------------------------ logit lens
def lens_reference(ref: Ref, ids, ln: str, incl_mid: bool) -> tuple[torch.Tensor, float]:
    """TL's lens logits ``[state, pos, vocab]`` and TL's own logit discrepancy with HF."""
    logits, cache = ref.run(ids)
    if ln == "own":
        stack = cache.accumulated_resid(apply_ln=True, incl_mid=incl_mid)
    else:
        raw = cache.accumulated_resid(apply_ln=False, incl_mid=incl_mid)
        stack = cache.apply_ln_to_stack(raw, recompute_ln=False) * ref.w + ref.b
    with torch.no_grad():
        out = ref.unembed(stack)[:, 0]
        hf = ref.hf(torch.tensor([ids]), use_cache=False).logits[0]
    return out, float((logits[0] - hf).abs().max())


def check_lens(client, ref: Ref, ids, ln="own", incl_mid=False, top_k=5, target=None) -> dict:
    """Every number of the served lens against TL; returns the worst differences."""
    body = {"token_lists": [ids], "ln": ln, "incl_mid": incl_mid, "top_k": top_k}
    if target is not None:
        body["target"] = target
    r = client.post("/v1/logit-lens", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["ln"] == ln and got["add_bos"] is False
    states = got["prompts"][0]["states"]
    tl, tl_err = lens_reference(ref, ids, ln, incl_mid)
    assert len(states) == tl.shape[0]
    ids_t = torch.tensor(ids)
    worst = {"loss": 0.0, "prob": 0.0, "logprob": 0.0, "logit": 0.0, "rank": 0}
    for s, st in enumerate(states):
        lg = tl[s].double()
        lp = torch.log_softmax(lg, -1)
        loss = float(-lp[:-1].gather(-1, ids_t[1:, None]).mean())
        worst["loss"] = max(worst["loss"], abs(loss - st["loss"]))
        for row in st["positions"]:
            q = row["position"]
            top_ids = [t["id"] for t in row["top"]]
            # the top-k are TL's top-k (compared by value: robust to near-ties)
            want_p = lp[q].exp().topk(len(top_ids)).values.tolist()
            for a, t in zip(want_p, row["top"]):
                worst["prob"] = max(worst["prob"], abs(a - t["prob"]))
            for t in row["top"]:
                worst["prob"] = max(worst["prob"], abs(float(lp[q, t["id"]].exp()) - t["prob"]))
                worst["logit"] = max(worst["logit"], abs(float(lg[q, t["id"]]) - t["logit"]))
            tgt = row["target"]
            want = target if target is not None else (ids[q + 1] if q + 1 < len(ids) else None)
            if want is None:
                assert tgt is None
                continue
            assert tgt["id"] == want
            worst["logprob"] = max(worst["logprob"], abs(float(lp[q, want]) - tgt["logprob"]))
            rank = int((lg[q] > lg[q, want]).sum())
            # near-ties within the float32 forwards' own discrepancy may order either way
            ties = int(((lg[q] - lg[q, want]).abs() <= 2 * max(1e-5, tl_err)).sum()) - 1
            worst["rank"] = max(worst["rank"], max(0, abs(rank - tgt["rank"]) - ties))
    assert worst["loss"] <= 1e-5 and worst["prob"] <= 1e-5, worst
    # a logit (or the log-prob of an improbable target, ~ -18 nats) carries the float32
    # forward's own error: TL's logits differ from Hugging Face's by tl_err (7.6e-6 here)
    assert max(worst["logit"], worst["logprob"]) <= max(1e-5, 2 * tl_err), (worst, tl_err)
    assert worst["rank"] == 0, worst
    return worst


@pytest.mark.parametrize("ln", ["own", "final"])
@pytest.mark.parametrize("incl_mid", [False, True])
def test_logit_lens_equals_transformerlens_bundled(client, bundled, ln, incl_mid):
    """Measured: loss 1.9e-6, prob 1.2e-6, logprob 1.9e-6, logit 7.6e-6 (TL's own 7.6e-6)."""
    check_lens(client, bundled, IDS, ln=ln, incl_mid=incl_mid)


def test_logit_lens_chosen_target_and_positions(client, bundled):
    check_lens(client, bundled, IDS, target=17, top_k=3)
    r = client.post("/v1/logit-lens", json={"token_lists": [IDS], "positions": [-1, 2],
                                            "top_k": 0})
    rows = r.json()["prompts"][0]["states"][0]["positions"]
    assert [row["position"] for row in rows] == [len(IDS) - 1, 2]
    assert rows[0]["target"] is None and rows[1]["target"]["id"] == IDS[3]
    assert rows[0]["top"] == []


def test_final_state_is_the_models_prediction_and_the_modes_agree_there(client, bundled):
    """final_post through either normalisation is the model's own next-token distribution."""
    out = {}
    for ln in ("own", "final"):
        r = client.post("/v1/logit-lens", json={"token_lists": [IDS], "ln": ln, "top_k": 3})
        out[ln] = r.json()["prompts"][0]["states"][-1]
    with torch.no_grad():
        lp = torch.log_softmax(bundled.hf(torch.tensor([IDS])).logits[0].double(), -1)
    for ln, st in out.items():
        assert st["label"] == "final_post" and st["hook"] == f"blocks.{bundled.L - 1}.hook_resid_post"
        loss = float(-lp[:-1].gather(-1, torch.tensor(IDS)[1:, None]).mean())
        assert abs(st["loss"] - loss) <= 1e-5
        for row in st["positions"]:
            for t in row["top"]:
                assert abs(t["prob"] - float(lp[row["position"], t["id"]].exp())) <= 1e-5
    # earlier states differ between the two (the frozen scale is not the state's own)
    r = {ln: client.post("/v1/logit-lens", json={"token_lists": [IDS], "ln": ln}).json()
         for ln in ("own", "final")}
    assert r["own"]["prompts"][0]["states"][0]["loss"] != r["final"]["prompts"][0]["states"][0]["loss"]


@pytest.mark.parametrize("fault", ["scale", "swap_modes"])
def test_a_wrong_ln_scale_fails_the_lens_comparison(client, bundled, monkeypatch, fault):
    """Planted faults: the frozen scale off by 1%, or each mode computed as the other."""
    real = A.lens_logits

    def wrong(x, unembed, w, b, eps, ln, final_scale=None):
        if fault == "scale":
            xc = x - x.mean(-1, keepdim=True)
            s = (final_scale if ln == "final" else (xc.pow(2).mean(-1, keepdim=True) + eps).sqrt())
            return torch.nn.functional.linear(xc / (s * 1.01) * w + b, unembed)
        if final_scale is None:  # 'own' asked: compute it with some frozen scale instead
            xc = x - x.mean(-1, keepdim=True)
            return torch.nn.functional.linear(xc / xc.norm(dim=-1, keepdim=True) * w + b, unembed)
        return real(x, unembed, w, b, eps, "own")

    monkeypatch.setattr(A, "lens_logits", wrong)
    for ln in ("own", "final"):
        with pytest.raises(AssertionError):
            check_lens(client, bundled, IDS, ln=ln)
    monkeypatch.setattr(A, "lens_logits", real)
    check_lens(client, bundled, IDS)


@pytest.mark.slow
@pytest.mark.parametrize("ln", ["own", "final"])
def test_logit_lens_equals_transformerlens_gpt2_small(small, ln):
    ref, c = small
    ids = torch.randint(0, 2048, (16,), generator=torch.Generator().manual_seed(1)).tolist()  # the tokenizer's ids
    check_lens(c, ref, ids, ln=ln, incl_mid=True)


# ------------------------------------------------------------------ direct logit attribution
def check_dla(client, ref: Ref, ids, positions, target, distractor=None) -> dict:
    """Every served part against TL's stack_head_results / decompose_resid through
    apply_ln_to_stack; the parts plus the bias term against the served logit difference."""
    body = {"token_lists": [ids], "target": target, "positions": positions}
    if distractor is not None:
        body["distractor"] = distractor
    r = client.post("/v1/logit-attribution", json=body)
    assert r.status_code == 200, r.text
    rows = r.json()["prompts"][0]["positions"]
    logits, cache = ref.run(ids)
    heads = cache.apply_ln_to_stack(cache.stack_head_results(layer=-1), layer=-1)[:, 0]
    dec, labels = cache.decompose_resid(layer=-1, mode="all", incl_embeds=True,
                                        return_labels=True)
    dec = cache.apply_ln_to_stack(dec, layer=-1)[:, 0]
    W_U = ref.tl.W_U.detach()
    d = W_U[:, target] - (0 if distractor is None else W_U[:, distractor])
    direction = (ref.w * d).double()
    with torch.no_grad():
        hf = ref.hf(torch.tensor([ids]), use_cache=False).logits[0].double()
    worst = {"heads": 0.0, "embed": 0.0, "mlp": 0.0, "attn_out": 0.0, "sum": 0.0, "served": 0.0}
    T = len(ids)
    for row, q in zip(rows, positions):
        q %= T
        assert row["position"] == q
        h = heads[:, q].double() @ direction  # [L * H]
        dd = dict(zip(labels, (dec[:, q].double() @ direction).tolist()))
        ours = torch.tensor(row["heads"]).reshape(-1)
        worst["heads"] = max(worst["heads"], float((ours - h).abs().max()))
        worst["embed"] = max(worst["embed"], abs(row["embed"] - dd["embed"]),
                             abs(row["pos_embed"] - dd["pos_embed"]))
        for layer in range(ref.L):
            worst["mlp"] = max(worst["mlp"], abs(row["mlp"][layer] - dd[f"{layer}_mlp_out"]))
            attn = sum(row["heads"][layer]) + row["attn_bias"][layer]
            worst["attn_out"] = max(worst["attn_out"], abs(attn - dd[f"{layer}_attn_out"]))
        served = float(hf[q, target] - (0 if distractor is None else hf[q, distractor]))
        worst["served"] = max(worst["served"], abs(row["logit_diff"] - served))
        total = row["embed"] + row["pos_embed"] + sum(map(sum, row["heads"])) + \
            sum(row["attn_bias"]) + sum(row["mlp"])
        assert abs(total - row["sum_of_parts"]) <= 1e-4
        worst["sum"] = max(worst["sum"], abs(row["logit_diff"] - total - row["ln_final_bias"]),
                           abs(row["residual_error"]))
        assert abs(row["ln_final_bias"] - float(d.double() @ ref.b.double())) <= 1e-5
    assert worst["sum"] <= 1e-4, worst
    assert max(worst["heads"], worst["embed"], worst["mlp"], worst["attn_out"]) <= 1e-5, worst
    assert worst["served"] <= 1e-5, worst
    return worst


def test_dla_equals_transformerlens_bundled(client, bundled):
    """Measured: heads 1.9e-6, embeds/MLPs 2.9e-6, parts + bias vs served 1.9e-6."""
    check_dla(client, bundled, IDS, [-1, 4, 0], target=17, distractor=300)
    check_dla(client, bundled, IDS, [-2], target=99)


def test_dla_by_text_with_per_prompt_targets(client):
    r = client.post("/v1/logit-attribution", json={
        "texts": [TEXT, "The cat sat on the mat and the"], "target": [" John", " on"],
        "distractor": " the"})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["add_bos"] is True and len(got["prompts"]) == 2
    assert "ln_final_bias" in got["method"] and "no_processing" in got["weights"]
    for p in got["prompts"]:
        row = p["positions"][0]
        assert row["position"] == p["n_tokens"] - 1
        assert abs(row["logit_diff"] - row["sum_of_parts"] - row["ln_final_bias"]) <= 1e-4


@pytest.mark.parametrize("fault", ["head_slice", "scale"])
def test_a_wrong_head_slice_or_scale_fails_the_dla_comparison(client, bundled, monkeypatch,
                                                              fault):
    """Planted faults: two heads' results exchanged (the sum still holds: only the comparison
    with TL catches it), or the frozen scale off by 1% (both checks catch it)."""
    real = A.direct_logit_attribution

    def wrong(stack, scale, w, direction):
        if fault == "head_slice":
            stack = stack.clone()
            stack[[2, 3]] = stack[[3, 2]]  # L0H0 <-> L0H1
            return real(stack, scale, w, direction)
        return real(stack, scale * 1.01, w, direction)

    monkeypatch.setattr(A, "direct_logit_attribution", wrong)
    with pytest.raises(AssertionError):
        check_dla(client, bundled, IDS, [-1, 4], target=17, distractor=300)
    monkeypatch.setattr(A, "direct_logit_attribution", real)
    check_dla(client, bundled, IDS, [-1, 4], target=17, distractor=300)


@pytest.mark.slow
def test_dla_equals_transformerlens_gpt2_small(small):
    ref, c = small
    ids = torch.randint(0, 2048, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    check_dla(c, ref, ids, [-1, 7], target=1000, distractor=2000)


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/logit-lens", {"text": "a b", "positions": [5]}, 422, "positions.0"),
    ("/v1/logit-lens", {"text": "a b", "positions": [1, -2]}, 422, "positions.1"),
    ("/v1/logit-lens", {"text": "a b", "target": "hello world"}, 422, "target"),
    ("/v1/logit-lens", {"text": "a b", "target": 99999}, 422, "target"),
    ("/v1/logit-lens", {"text": "a b", "ln": "mine"}, 422, "ln"),
    ("/v1/logit-lens", {"text": "a b", "top_k": 101}, 422, "top_k"),
    ("/v1/logit-lens", {"text": "a b", "tokens": [1, 2]}, 422, None),
    ("/v1/logit-lens", {"token_lists": [[1, 5000]]}, 422, "token_lists.0"),
    ("/v1/logit-lens", {"tokens": [1] * 2000}, 422, "tokens"),
    ("/v1/logit-attribution", {"text": "a b"}, 422, "target"),
    ("/v1/logit-attribution", {"text": "a b", "target": 3, "distractor": 3}, 422, "distractor"),
    ("/v1/logit-attribution", {"texts": ["a b", "c"], "target": [1]}, 422, "target"),
    ("/v1/logit-attribution", {"texts": ["a b", "c"], "target": 1, "distractor": [2, 1]},
     422, "distractor.1"),
    ("/v1/logit-attribution", {"text": "a b", "target": 1, "positions": [-9]}, 422,
     "positions.0"),
    ("/v1/logit-attribution", {"text": "a b", "target": " x y"}, 422, "target"),
])
def test_bad_input_is_a_named_422(client, path, body, status, param):
    r = client.post(path, json=body)
    e = assert_error(r, status)
    if param is not None:
        assert e["param"] is not None and e["param"].startswith(param), e


def test_an_encoder_is_unsupported(bert_client):
    for path, body in (("/v1/logit-lens", {"text": "a b"}),
                       ("/v1/logit-attribution", {"text": "a b", "target": 5})):
        r = bert_client.post(path, json=body)
        assert r.status_code == 422 and r.json()["error"]["type"].startswith("unsupported"), r.text


def test_responses_are_inside_their_estimates(client, gpt2_runtime):
    """Plan.response_bytes bounds the body's JSON size (the job's tensors come on top)."""
    from attnscope.schemas.lens import LogitAttributionRequest, LogitLensRequest
    from attnscope.service.serving import lens as S

    long_ids = [0] + list(range(5, 200))
    for path, plan, model, body in (
            ("/v1/logit-lens", S.lens_plan, LogitLensRequest,
             {"token_lists": [long_ids, IDS], "top_k": 20, "incl_mid": True}),
            ("/v1/logit-attribution", S.dla_plan, LogitAttributionRequest,
             {"token_lists": [long_ids], "target": 5, "positions": list(range(0, 190, 3))})):
        req = model(**body)
        items = [gpt2_runtime.tokenized_from_ids(ids) for ids in body["token_lists"]]
        est = plan(gpt2_runtime, req, items).response_bytes
        r = client.post(path, json=body)
        assert r.status_code == 200
        assert len(r.content) <= est, (path, len(r.content), est)


def test_the_client_methods_return_the_served_bodies(client):
    """``Client.logit_lens`` / ``logit_attribution`` / ``circuits`` send the request as the
    schema has it and parse the very body the endpoint serves."""
    from attnscope.client import Client

    c = Client("http://testserver", http_client=client, max_retries=0)
    text = "The cat sat on the mat"
    for got, path, body in (
            (c.logit_lens(text, top_k=3), "/v1/logit-lens", {"text": text, "top_k": 3}),
            (c.logit_attribution(text, target=" the", distractor=" a"), "/v1/logit-attribution",
             {"text": text, "target": " the", "distractor": " a"}),
            (c.circuits(top_k=2), "/v1/circuits", {"top_k": 2})):
        raw = client.post(path, json=body).json()
        assert got.model_dump(mode="json", exclude_unset=True) == raw, path
