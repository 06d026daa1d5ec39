"""POST /v1/run and GET /v1/hooks through the real app (in-process) and the Python client, on
the bundled model: every cached hook equals TransformerLens 4.3 ``run_with_cache`` by name and
shape, every wire form carries the same numbers, token ids and texts give identical responses,
the README's path-patching example equals a hand-written TransformerLens loop, /v1/ablate and
/v1/patch equal the same experiments written as /v1/run requests, and bad input is a named
4xx. (The hooked forward itself: tests/test_hooked.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from interventions_reference import tl_hooked_bridge, tl_legacy_name
from conftest import assert_error

from attnscope.client import Client, run as R

pytest.importorskip("transformer_lens")

#: BOS + 8 distinct random token ids, twice (an induction text on the bundled model)
SEG = [211, 1030, 77, 1499, 603, 1877, 342, 958]
CLEAN = [0] + SEG + SEG
#: another first half, the same second half: the earlier copy the induction heads look for is
#: gone, and the previous-token head's outputs at the first half's keys name other tokens
CORRUPT = [0] + [1210, 45, 1600, 388, 1777, 90, 1402, 633] + SEG
SECOND = list(range(len(SEG) + 1, len(CLEAN) - 1))  # positions predicting the repeat


@pytest.fixture(scope="module")
def api(client):
    return Client("http://testserver", http_client=client, max_retries=0)


@pytest.fixture(scope="module")
def tl(bundled_dir):
    return tl_hooked_bridge(bundled_dir)


def _close(a: np.ndarray, b: torch.Tensor, name: str) -> None:
    b = b.detach().numpy()
    assert a.shape == b.shape, (name, a.shape, b.shape)
    fin = np.isfinite(b)
    assert np.array_equal(np.isfinite(a), fin), name
    bound = 1e-5 + 1e-6 * float(np.abs(b[fin]).max())  # TL's own float32 rounding (test_hooked)
    assert float(np.abs(a[fin] - b[fin]).max()) <= bound, name


def test_every_cached_hook_equals_transformerlens_by_name_and_shape(api, tl):
    out = api.run(tokens=[CLEAN, CORRUPT], cache=["*"], logits={"positions": None, "full": True,
                                                               "top_k": None})
    with torch.no_grad():
        logits, cache = tl.run_with_cache(torch.tensor([CLEAN, CORRUPT]))
    ref = {k: v for k, v in cache.items() if tl_legacy_name(k)}
    assert set(out.cache) == set(ref), set(out.cache) ^ set(ref)
    for name, t in ref.items():
        _close(out.cache[name], t, name)
    _close(out.logits, logits, "logits")
    hooks = [h.name for h in api.hooks().hooks]
    assert hooks[:2] == ["hook_embed", "hook_pos_embed"] and set(hooks) == set(ref)


def test_the_wire_forms_carry_the_same_numbers(api, client):
    body = {"token_lists": [CLEAN], "cache": ["blocks.1.attn.hook_pattern", "blocks.0.hook_resid_post",
                                          "blocks.0.attn.hook_attn_scores"]}
    binary = api.run(**body)
    b64 = api.run(**body, binary=False)
    js = client.post("/v1/run", json=body).json()
    for name in body["cache"]:
        assert np.array_equal(binary.cache[name], b64.cache[name]), name
        ref = binary.cache[name]
        got = np.array([[np.nan if v is None else v for v in row] for row in
                        np.array(js["cache"][name], dtype=object).reshape(-1, ref.shape[-1])],
                       dtype=np.float64).reshape(ref.shape)
        masked = np.isneginf(ref)
        assert np.array_equal(np.isnan(got), masked), name  # JSON: masked scores are null
        assert np.array_equal(got[~masked].astype(np.float32), ref[~masked]), name


def test_token_ids_and_texts_give_identical_responses(client):
    text = "The cat sat on the mat and the dog"
    by_text = client.post("/v1/run", json={"texts": [text], "cache": ["blocks.0.attn.hook_z"],
                                           "logits": {"positions": [-1]}}).json()
    ids = [t["id"] for t in by_text["prompts"][0]["tokens"]]
    assert by_text["add_bos"] is True and ids[0] == 0  # GPT-2 convention: BOS prepended
    by_ids = client.post("/v1/run", json={"token_lists": [ids], "cache": ["blocks.0.attn.hook_z"],
                                          "logits": {"positions": [-1]}}).json()
    assert by_ids["cache"] == by_text["cache"] and by_ids["logits"] == by_text["logits"]
    assert by_ids["add_bos"] is False


def test_interventions_metrics_and_grad_over_http(api, tl):
    """zero / scale / add / set over the API equal TransformerLens run_with_hooks doing the
    same; the declared logit difference and its gradient come back."""
    vec = np.linspace(-1, 1, 128, dtype=np.float32)
    out = api.run(tokens=[CLEAN, CORRUPT], interventions=[
        R.zero("blocks.0.attn.hook_z", heads=[1], prompts=[0]),
        R.add("blocks.1.hook_resid_pre", vec, scale=0.5, positions=[-1]),
        R.patch("blocks.1.attn.hook_result", source_prompt=0, prompts=[1], heads=[2]),
    ], cache=["blocks.1.hook_resid_post"],
        metrics={"ld": R.logit_diff((0, -1, SEG[0], SEG[1]), (1, -1, SEG[0], SEG[1]))},
        grad={"metric": "ld", "hooks": ["blocks.0.hook_resid_post"]})

    def z_hook(t, hook):
        t[0, :, 1] = 0
        return t

    def add_hook(t, hook):
        t[:, -1] += 0.5 * torch.from_numpy(vec)
        return t

    def res_hook(t, hook):
        t[1, :, 2] = t[0, :, 2]
        return t

    with torch.no_grad():
        logits = tl.run_with_hooks(torch.tensor([CLEAN, CORRUPT]), fwd_hooks=[
            ("blocks.0.attn.hook_z", z_hook), ("blocks.1.hook_resid_pre", add_hook),
            ("blocks.1.attn.hook_result", res_hook)])
    ld = (logits[:, -1, SEG[0]] - logits[:, -1, SEG[1]]).numpy()
    assert np.allclose(out.metric_values["ld"], ld, atol=5e-5, rtol=0)
    assert out.metrics["ld"] == pytest.approx(float(ld.mean()), abs=5e-5)
    g = out.grads["blocks.0.hook_resid_post"]
    assert g.shape == (2, len(CLEAN), 128) and np.isfinite(g).all() and np.abs(g).max() > 0
    assert out.grad_value == pytest.approx(out.metrics["ld"], abs=1e-6)


# ------------------------------------------------------------------ path patching (README)
SENDER = 1  # layer 0's previous-token head on the bundled model (/v1/heads: 0.92)
RECEIVERS = [0, 1, 2, 3]  # layer 1: the induction heads (probe 0.95-0.97)


def path_patching_request() -> dict:
    """The README's worked example as one /v1/run request: the previous-token head L0H1's
    output from the corrupted run reaches layer 1's keys (all four induction heads) (a)
    directly and (b) only through MLP 0; everything else stays clean (Wang et al. 2022).

    Rows: 0 clean, 1 corrupted, 2 clean + L0H1 patched with MLP 0 frozen clean (its layer-1
    residual is clean + the sender's direct change), 3 clean with layer 1's key inputs from
    row 2 (direct path), 4 clean + L0H1 patched (MLP 0 sees it), 5 clean with MLP 0's output
    from row 4 (clean + MLP 0's change only), 6 clean with layer 1's key inputs from row 5
    (the path through MLP 0)."""
    rows = [CLEAN, CORRUPT, CLEAN, CLEAN, CLEAN, CLEAN, CLEAN]
    return {
        "tokens": rows,
        "interventions": [
            R.patch("blocks.0.attn.hook_result", source_prompt=1, prompts=[2, 4], heads=[SENDER]),
            R.patch("blocks.0.hook_mlp_out", source_prompt=0, prompts=[2]),
            R.patch("blocks.0.hook_mlp_out", source_prompt=4, prompts=[5]),
            R.patch("blocks.1.hook_k_input", source_prompt=2, prompts=[3], heads=RECEIVERS),
            R.patch("blocks.1.hook_k_input", source_prompt=5, prompts=[6], heads=RECEIVERS),
        ],
        "metrics": {f"loss_{i}": R.loss(*SECOND, prompt=i) for i in (0, 1, 3, 6)},
    }


def _tl_path_patching(tl) -> dict[str, float]:
    """The same, hand-written with TransformerLens hooks, two clean runs per path."""
    clean, corrupt = torch.tensor([CLEAN]), torch.tensor([CORRUPT])
    with torch.no_grad():
        _, cc = tl.run_with_cache(clean)
        _, kc = tl.run_with_cache(corrupt)
        delta = kc["blocks.0.attn.hook_result"][0, :, SENDER] - cc["blocks.0.attn.hook_result"][0, :, SENDER]

        def loss_with(k_input_change):
            def hook(t, hook):
                t[0, :, RECEIVERS] = t[0, :, RECEIVERS] + k_input_change[:, None]
                return t
            logits = tl.run_with_hooks(clean, fwd_hooks=[("blocks.1.hook_k_input", hook)])
            lp = torch.log_softmax(logits[0], -1)
            return float(-torch.stack([lp[p, CLEAN[p + 1]] for p in SECOND]).mean().detach())

        def sender_patched(t, hook):
            t[0, :, SENDER] = kc["blocks.0.attn.hook_result"][0, :, SENDER]
            return t
        with tl.hooks(fwd_hooks=[("blocks.0.attn.hook_result", sender_patched)]):
            _, pc = tl.run_with_cache(clean)
        mlp_delta = pc["blocks.0.hook_mlp_out"][0] - cc["blocks.0.hook_mlp_out"][0]
        lp_clean = torch.log_softmax(tl(clean)[0], -1)
        lp_corr = torch.log_softmax(tl(corrupt)[0], -1)
    return {"loss_0": float(-torch.stack([lp_clean[p, CLEAN[p + 1]] for p in SECOND]).mean()),
            "loss_1": float(-torch.stack([lp_corr[p, CORRUPT[p + 1]] for p in SECOND]).mean()),
            "loss_3": loss_with(delta), "loss_6": loss_with(mlp_delta)}


def test_path_patching_equals_a_hand_written_transformerlens_loop(api, tl):
    out = api.run(**path_patching_request())
    ref = _tl_path_patching(tl)
    for k, v in ref.items():
        assert out.metrics[k] == pytest.approx(v, abs=2e-5), (k, out.metrics, ref)
    # the story on the bundled model (README): the previous-token head's effect on layer 1's
    # keys goes through MLP 0, not directly
    gap = out.metrics["loss_1"] - out.metrics["loss_0"]
    assert out.metrics["loss_6"] - out.metrics["loss_0"] > 0.5 * gap
    assert out.metrics["loss_3"] - out.metrics["loss_0"] < 0.05 * gap
    # planted fault: the receivers' key input taken from the wrong row (the clean run itself)
    bad = path_patching_request()
    bad["interventions"][4] = R.patch("blocks.1.hook_k_input", source_prompt=0, prompts=[6],
                                      heads=RECEIVERS)
    wrong = api.run(**bad)
    assert abs(wrong.metrics["loss_6"] - ref["loss_6"]) > 1.0


# ------------------------------------------------------------------ the other endpoints as runs
def _ids(client, text: str, add_bos: bool) -> list[int]:
    body = client.post("/v1/tokenize", json={"text": text, "add_bos": add_bos}).json()
    return [t["id"] for t in body["tokens"]["tokens"]]


def test_ablate_equals_the_same_experiment_as_a_run(client, api):
    text = "The cat sat on the mat. The cat sat on the"
    ids = _ids(client, text, True)
    r = client.post("/v1/ablate", json={"text": text, "heads": [[1, 0], [0, 1]],
                                        "method": "zero", "add_bos": True})
    assert r.status_code == 200, r.text
    ablated = r.json()
    T = len(ids)
    assert [t["id"] for t in ablated["tokens"]] == ids
    m = {"loss": R.loss(*range(T - 1))}
    run = api.run(tokens=[ids], interventions=[
        R.zero("blocks.1.attn.hook_z", heads=[0]), R.zero("blocks.0.attn.hook_z", heads=[1])],
        metrics=m)
    clean = api.run(tokens=[ids], metrics=m)
    assert ablated["mean_loss_ablated"] == pytest.approx(run.metrics["loss"], abs=2e-5)
    assert ablated["mean_loss_clean"] == pytest.approx(clean.metrics["loss"], abs=2e-5)
    assert abs(run.metrics["loss"] - clean.metrics["loss"]) > 1e-3  # the ablation did something


def test_patch_equals_the_same_experiment_as_a_run(client, api):
    clean_t = "The cat sat on the mat and the dog sat on the"
    corrupt_t = "The dog sat on the mat and the cat sat on the"
    ids = [_ids(client, t, True) for t in (clean_t, corrupt_t)]
    assert len(ids[0]) == len(ids[1])
    r = client.post("/v1/patch", json={"clean_text": clean_t, "corrupted_text": corrupt_t,
                                       "add_bos": True, "metric": "logit_diff",
                                       "logit_diff": {"target": " the", "distractor": " a"}})
    assert r.status_code == 200, r.text
    body = r.json()
    tgt, dis = _ids(client, " the", False), _ids(client, " a", False)
    assert len(tgt) == len(dis) == 1
    m = {"ld": R.logit_diff((-1, tgt[0], dis[0]))}
    clean = api.run(tokens=[ids[0]], metrics=m).metrics["ld"]
    corr = api.run(tokens=[ids[1]], metrics=m).metrics["ld"]
    for layer in range(2):
        for head in range(4):
            patched = api.run(tokens=[ids[0], ids[1]], interventions=[
                R.patch(f"blocks.{layer}.attn.hook_z", source_prompt=0, prompts=[1],
                        heads=[head])],
                metrics={"ld": R.logit_diff((1, -1, tgt[0], dis[0]))}).metrics["ld"]
            assert body["heads_raw"][layer][head] == pytest.approx(patched, abs=5e-5)
            assert body["heads"][layer][head] == pytest.approx(
                (patched - corr) / (clean - corr), abs=5e-4)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("body, param, words", [
    ({"token_lists": [[0, 1, 2]], "cache": ["blocks.0.hook_resid_psot"]}, "cache.0.hook",
     "blocks.0.hook_resid_post"),
    ({"token_lists": [[0, 1, 2]], "cache": [{"hook": "blocks.0.attn.hook_z", "heads": [9]}]},
     None, "head"),
    ({"token_lists": [[0, 1, 2]], "interventions": [R.add("hook_embed", [1.0, 2.0])]},
     None, "needs [128]"),
    ({"token_lists": [[0, 1, 2], [0, 1, 3]], "interventions": [
        R.patch("hook_embed", source_prompt=5)]}, None, "5"),
    ({"token_lists": [[0, 1, 2], [0, 1]]}, "token_lists", "[3, 2]"),
    ({"token_lists": [[0, 1, 4096]]}, "token_lists.0.2", "2047"),
    ({"token_lists": [[1] * 257]}, "token_lists.0", "256"),
    ({"token_lists": [[0, 1, 2]], "metrics": {"m": R.logit_diff((-1, " Mary", 1))}},
     "metrics.m.terms.0.target", "not one"),
    ({"token_lists": [[0, 1, 2]], "grad": {"metric": "nope", "hooks": ["hook_embed"]}}, None, "nope"),
    ({"token_lists": [[0, 1, 2]], "texts": ["x"]}, None, "exactly one"),
])
def test_bad_input_is_a_named_4xx_and_the_service_keeps_serving(client, body, param, words):
    r = client.post("/v1/run", json=body)
    e = assert_error(r, 422, param=param)
    assert words in e["message"], e
    assert client.post("/v1/run", json={"token_lists": [[0, 1, 2]]}).status_code == 200


def test_a_run_over_the_memory_limit_is_refused_before_the_forward(make_client, gpt2_runtime):
    c = make_client(gpt2_runtime, max_request_bytes=1 << 20)
    r = c.post("/v1/run", json={"token_lists": [[1] * 200] * 4, "cache": ["*"]})
    e = assert_error(r, 422, type_="memory_limit_exceeded")
    assert "max_request_bytes" in e["message"]
    assert c.post("/v1/run", json={"token_lists": [[0, 1, 2]]}).status_code == 200


def test_hooks_on_an_encoder_is_unsupported(bert_client):
    assert_error(bert_client.get("/v1/hooks"), 422)
    assert_error(bert_client.post("/v1/run", json={"token_lists": [[101, 102]]}), 422)


def test_token_refs_of_ids_past_the_tokenizer(gpt2_runtime):
    """A model whose embedding is larger than its tokenizer (a padded vocabulary: the random
    GPT-2-small-shaped model with the bundled tokenizer) can predict such ids: their refs are
    labelled, never a crash (found by the logit-lens work)."""
    n = len(gpt2_runtime.tokenizer)
    refs = gpt2_runtime.token_refs([5, n, n + 7])
    assert refs[0]["label"] and refs[0]["bytes"]
    assert refs[1] == {"id": n, "label": f"<id {n}: not in the tokenizer>", "bytes": "",
                       "partial": False}


def test_breaker_findings_on_run(client, make_client, gpt2_runtime):
    """Found by a breaker: (a) the top-k token objects were not in the memory estimate (32 x
    256 positions x top_k 1000 grew the process to 4.9 GB and the body was cut at the
    deadline); (b) a reference mean of the scores failed with a NaN/inf message about the
    user's 'tensor'; (c) an error named the runtime's index of an expanded pattern
    (interventions[3] for a request of one entry); (d) KL of two equal prompts was -1e-9."""
    # (a) refused before any forward
    c = make_client(gpt2_runtime, max_request_bytes=256 << 20)
    r = c.post("/v1/run", json={"token_lists": [[1] * 256] * 8, "logits": {"top_k": 1000}})
    assert_error(r, 422, type_="memory_limit_exceeded")
    # (b) per position (references of the run's length): works; over positions: named
    body = {"token_lists": [[0, 1, 2, 3, 4]], "metrics": {"l": R.loss(1, 2)}}
    ok = client.post("/v1/run", json={**body, "interventions": [R.mean(
        "blocks.0.attn.hook_attn_scores", reference=[[0, 5, 6, 7, 8], [0, 9, 10, 11, 12]])]})
    assert ok.status_code == 200, ok.text
    bad = client.post("/v1/run", json={**body, "interventions": [R.mean(
        "blocks.0.attn.hook_attn_scores", reference=[[0, 5, 6]])]})
    e = assert_error(bad, 422, param="interventions.0")
    assert "run's length (5 tokens)" in e["message"]
    # (c) the request's entry is named
    r = client.post("/v1/run", json={"token_lists": [[0, 1, 2]], "interventions": [
        R.zero("hook_embed"), R.mean("blocks.*.attn.hook_z", reference=[[0, 5, 6]]),
        R.zero("blocks.1.attn.hook_z", heads=[7])]})
    e = assert_error(r, 422)
    assert "interventions.2" in (e["param"] or "") + e["message"], e
    # (d) never below 0
    kl = client.post("/v1/run", json={"token_lists": [[0, 5, 6, 7]] * 2, "metrics": {
        "kl": R.kl((0, 1, 1), (0, 1, 2), (0, 1, 3))}}).json()["metrics"]["kl"]
    assert all(v >= 0 for v in kl["values"]) and kl["value"] >= 0


def test_metric_builders_take_one_term_by_keywords():
    assert R.kl(prompt=1, reference_prompt=0, position=-1) == R.kl((1, 0, -1))
    assert R.logit_diff(position=-1, target=" a", distractor=" b") == R.logit_diff((-1, " a", " b"))
    assert R.prob(prompt=0, position=2, target=5) == R.prob((0, 2, 5))
    assert R.logprob(position=2, target=5)["terms"] == [{"position": 2, "target": 5}]
    with pytest.raises(TypeError):
        R.kl()
    with pytest.raises(TypeError):
        R.prob((2, 5), position=3, target=1)


def test_breaker_findings_selections_and_integer_tensors(client):
    """Found by a breaker: (a) a cache selection repeating an index (``positions: [1, 1]``,
    or ``-1`` next to ``T - 1``) was served, the row twice; now a 422 naming the entry's field
    and the repeated element. (b) A base64 request tensor with an integer dtype was read as
    float32 values, against docs/api.md's float32 | float16: now refused, naming ``dtype``,
    by the schema and by the decoder itself."""
    from attnscope.service.encoding.inputs import decode_input
    from attnscope.service.errors import InvalidRequest

    T = [[0, 5, 6, 7]]
    for sel, param, words in (
            ({"positions": [1, 1]}, "cache.0.positions.1", "positions[1] = 1 repeats positions[0]"),
            ({"positions": [3, -1]}, "cache.0.positions.1", "(position 3 of 4)"),
            ({"prompts": [0, 0]}, "cache.0.prompts.1", "prompts[1] = 0 repeats"),
            ({"heads": [2, 0, 2]}, "cache.0.heads.2", "heads[2] = 2 repeats heads[0]"),
            ({"layers": [1, 1]}, "cache.0.layers.1", "layers[1] = 1 repeats")):
        hook = "blocks.*.attn.hook_z" if "layers" in sel else "blocks.0.attn.hook_z"
        r = client.post("/v1/run", json={"token_lists": T, "cache": [{"hook": hook, **sel}]})
        e = assert_error(r, 422, param=param)
        assert words in e["message"], e
    # the same indices once each, and out-of-range ones, keep their own answers
    ok = client.post("/v1/run", json={"token_lists": T, "cache": [
        {"hook": "blocks.0.attn.hook_z", "positions": [3, -2], "heads": [2, 0]}]})
    assert ok.status_code == 200, ok.text
    assert ok.json()["selections"]["blocks.0.attn.hook_z"]["positions"] == [3, 2]
    far = client.post("/v1/run", json={"token_lists": T, "cache": [
        {"hook": "hook_embed", "positions": [0, -9]}]})
    assert "out of range" in assert_error(far, 422, param="cache.0.positions")["message"]
    # (b) integer base64
    import base64

    for dtype, data in (("int32", np.array([1, 2], "<i4")), ("int64", np.array([1, 2], "<i8"))):
        b64 = {"encoding": "base64", "dtype": dtype, "shape": [2],
               "data": base64.b64encode(data.tobytes()).decode()}
        r = client.post("/v1/run", json={"token_lists": T, "interventions": [
            {"kind": "add", "hook": "hook_embed", "vector": b64}]})
        e = assert_error(r, 422, param="interventions.0.vector.dtype")
        assert "'float16' or 'float32'" in e["message"] and f"'{dtype}'" in e["message"], e
        with pytest.raises(InvalidRequest) as got:
            decode_input(b64, "interventions.0.vector")
        assert got.value.param == "interventions.0.vector.dtype"
    # float16 / float32 base64 still read exactly
    v = np.arange(128, dtype="<f4") / 64
    for dtype in ("float32", "float16"):
        a = v.astype(dtype)
        b64 = {"encoding": "base64", "dtype": dtype, "shape": [128],
               "data": base64.b64encode(a.tobytes()).decode()}
        np.testing.assert_array_equal(decode_input(b64, "v"), a.astype(np.float32))
    assert client.post("/v1/run", json={"token_lists": T}).status_code == 200


def test_the_cache_is_encoded_hook_by_hook_inside_the_forward(bundled_dir):
    """``hooked.run(keep=...)`` (what /v1/run uses so that it never holds the whole cache in
    float32 beside its wire copy, issue 25): each cached value goes to ``keep`` when its hook
    has run, in forward order, before any later hook runs; what it returns is the cache; the
    values it sees are bit for bit those of a run without ``keep``."""
    from transformers import GPT2LMHeadModel

    from attnscope.service.runtime import hooked as H

    model = GPT2LMHeadModel.from_pretrained(str(bundled_dir), attn_implementation="eager").eval()
    p = H.gpt2_parts(model)
    ids = torch.tensor([CLEAN, CORRUPT])
    sel = {"hook_*": None, "blocks.0.*": None, "ln_final.*": None,
           "blocks.1.attn.hook_pattern": H.CacheSelect(heads=[1], positions=[-1])}
    plain = H.run(p, ids, cache=sel)
    seen: list[str] = []

    from torch.overrides import TorchFunctionMode

    class Ops(TorchFunctionMode):  # counts the forward's torch calls: when keep is called
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Ops.n += 1
            return func(*args, **(kwargs or {}))

    at: dict[str, int] = {}
    got: dict[str, torch.Tensor] = {}

    def keep(name, t):  # no torch call here: Ops.n counts the forward's calls only
        at[name] = Ops.n
        seen.append(name)
        got[name] = t
        return ("kept", name)

    with Ops():
        res = H.run(p, ids, cache=sel, keep=keep)
    # called inside the forward, hook by hook (a keep applied after the forward: all at the end)
    assert at["hook_embed"] < at["blocks.0.hook_resid_post"] < at[
        "blocks.1.attn.hook_pattern"] < at["ln_final.hook_normalized"] < Ops.n, (at, Ops.n)
    for name, t in got.items():
        assert torch.equal(t, plain.cache[name]), name
    order = [h.name for h in H.hook_points(p)]
    assert seen == [n for n in order if n in plain.cache] and len(seen) == len(plain.cache)
    assert res.cache == {n: ("kept", n) for n in seen}
    assert torch.equal(res.logits, plain.logits)


def test_float16_cache_over_http_equals_the_float32_cache_cast(client):
    """/v1/run encodes each hook as it is produced: its float16 safetensors cache equals the
    float32 JSON cache cast to float16; a value beyond float16's range, met inside the forward,
    is a 422 naming ``dtype`` and the service keeps serving."""
    from attnscope.client import wire

    body = {"token_lists": [CLEAN], "cache": ["blocks.*.hook_resid_post",
                                          "blocks.0.attn.hook_attn_scores"]}
    f32 = client.post("/v1/run", json=body).json()["cache"]
    r = client.post("/v1/run", json={**body, "dtype": "float16"},
                    headers={"accept": wire.SAFETENSORS})
    assert r.status_code == 200, r.text[:300]
    f16 = wire.decode_binary_response(r.content)["cache"]
    assert set(f16) == set(f32)
    for name, v in f32.items():
        ref = np.array(v, dtype=np.float32)
        if name.endswith("hook_attn_scores"):
            ref = np.where(np.isnan(ref), -np.inf, ref)  # JSON null = masked -inf
        want = torch.from_numpy(ref).to(torch.float16).numpy()
        assert f16[name].dtype == np.float16 and np.array_equal(f16[name], want), name
    big = client.post("/v1/run", json={**body, "dtype": "float16", "interventions": [
        R.add("blocks.1.hook_resid_pre", np.ones(128, np.float32), scale=1e5)]},
        headers={"accept": wire.SAFETENSORS})
    e = assert_error(big, 422, param="dtype")
    assert "65504" in e["message"], e
    assert client.post("/v1/run", json=body).status_code == 200
