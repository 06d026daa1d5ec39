"""/v1/logit-lens and /v1/logit-attribution on Llama, Mistral, Qwen2, Gemma, Gemma 2 and
GPT-NeoX (issue 28), against Hugging Face's own modules and TransformerLens 4.3.

Checkpoints: tests/families.py's random small ones with every bias and norm weight drawn at
random (a freshly initialised model has RMSNorm weights 1 (Gemma 0) and zero biases, under
which w, 1 + w, a missing bias or b_O are indistinguishable), saved beside them.

References, computed in the test from Hugging Face's model with forward hooks (no code of the
service): the lens state x (``hidden_states[l]`` = resid_pre, the input of the mid norm =
resid_mid, the final norm's input = final_post) through HF's own final-norm module, ``lm_head``
and Gemma 2's ``final_logit_softcapping``; "final" mode by hand, ``x_f32 / s * w'`` with
``s = sqrt(mean(x_L^2) + eps)``. DLA by hand from HF hooks: each head's
``z_h W_O[:, h]^T`` (Gemma 2: divided by the post-attention norm's scale, times ``1 + w``),
``o_proj`` / ``dense`` bias, each MLP's output (Gemma 2: the post-feed-forward norm's), the
embedding, through the frozen final norm. TransformerLens 4.3's bridge
``accumulated_resid(apply_ln=True)`` cross-checks the lens on Llama and GPT-NeoX.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from attnscope.service.analysis import lens as A
from attnscope.service.config import Settings
from attnscope.service.runtime import Runtime

from conftest import _client, assert_error
from families import FAMILIES, family_checkpoint

IDS = [0, 5, 17, 99, 300, 12, 7, 8, 41, 250, 17, 99, 300, 1500, 9, 77]
RMS = ("llama", "mistral", "qwen2", "gemma", "gemma2")


class Fam:
    """A family's perturbed checkpoint: HF's model and the served app."""

    def __init__(self, family, root):
        import transformers as tf

        self.family = family
        src = family_checkpoint(family, root)
        self.path = root / f"{family}-perturbed"
        if not (self.path / "model.safetensors").exists():
            m = tf.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager")
            g = torch.Generator().manual_seed(11)
            with torch.no_grad():
                for name, t in m.named_parameters():
                    if name.endswith("bias"):
                        t.copy_(0.3 * torch.randn(t.shape, generator=g))
                    elif "norm" in name or "layernorm" in name:
                        t.copy_((1.0 if family not in ("gemma", "gemma2") else 0.0)
                                + 0.3 * torch.randn(t.shape, generator=g))
            m.save_pretrained(self.path, safe_serialization=True)
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(src / f, self.path / f)
        self.hf = tf.AutoModelForCausalLM.from_pretrained(
            self.path, attn_implementation="eager").eval()
        self.hf.requires_grad_(False)
        self.cfg = self.hf.config
        self.neox = family == "gpt_neox"
        self.base = self.hf.gpt_neox if self.neox else self.hf.model
        self.norm = self.base.final_layer_norm if self.neox else self.base.norm
        self.eps = self.cfg.layer_norm_eps if self.neox else self.cfg.rms_norm_eps
        self.cap = getattr(self.cfg, "final_logit_softcapping", None) \
            if family == "gemma2" else None
        self.rt = Runtime.load(Settings(model=str(self.path)))
        self._tl = None

    @property
    def tl(self):
        if self._tl is None:
            from interventions_reference import tl_hooked_bridge
            self._tl = tl_hooked_bridge(self.path)
        return self._tl

    def client(self):
        return _client(self.rt, model=str(self.path))

    def w_eff(self) -> torch.Tensor:
        w = self.norm.weight.double()
        return 1.0 + w if self.family.startswith("gemma") else w

    def record(self, ids):
        """HF forward with hooks: hidden states, mids, final norm input, per-layer z, the
        post-attention norm inputs (Gemma 2) and MLP outputs, logits."""
        rec = {"z": {}, "mid": {}, "mlp": {}, "post_in": {}}
        hs = []

        def pre(store, key):
            def f(mod, args):
                store[key] = args[0].detach().clone()
            return f

        def out(store, key):
            def f(mod, args, o):
                store[key] = (o[0] if isinstance(o, tuple) else o).detach().clone()
            return f

        try:
            hs.append(self.norm.register_forward_pre_hook(pre(rec, "final")))
            for i, layer in enumerate(self.base.layers):
                attn = layer.attention if self.neox else layer.self_attn
                o = attn.dense if self.neox else attn.o_proj
                hs.append(o.register_forward_pre_hook(pre(rec["z"], i)))
                if self.family == "gemma2":
                    hs.append(layer.pre_feedforward_layernorm.register_forward_pre_hook(
                        pre(rec["mid"], i)))
                    hs.append(layer.post_attention_layernorm.register_forward_pre_hook(
                        pre(rec["post_in"], i)))
                    hs.append(layer.post_feedforward_layernorm.register_forward_hook(
                        out(rec["mlp"], i)))
                else:
                    if not self.neox:
                        hs.append(layer.post_attention_layernorm.register_forward_pre_hook(
                            pre(rec["mid"], i)))
                    hs.append(layer.mlp.register_forward_hook(out(rec["mlp"], i)))
            with torch.no_grad():
                r = self.hf(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
        finally:
            for h in hs:
                h.remove()
        rec["hidden"] = r.hidden_states
        rec["logits"] = r.logits[0]
        return rec

    def unembed(self, h):
        with torch.no_grad():
            lg = self.hf.get_output_embeddings()(h)
        if self.cap is not None:
            lg = torch.tanh(lg / self.cap) * self.cap
        return lg


_FAMS: dict = {}


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request, tmp_path_factory):
    if request.param not in _FAMS:
        _FAMS[request.param] = Fam(request.param, tmp_path_factory.getbasetemp() / "families")
    return _FAMS[request.param]


# ------------------------------------------------------------------------------ logit lens
def hf_lens(fam: Fam, ids, ln: str, incl_mid: bool) -> torch.Tensor:
    """The reference lens logits ``[state, pos, vocab]`` from HF's own modules."""
    rec = fam.record(ids)
    L = fam.cfg.num_hidden_layers
    states = []
    for layer in range(L):
        states.append(rec["hidden"][layer][0])
        if incl_mid:
            states.append(rec["mid"][layer][0])
    states.append(rec["final"][0])
    xL = rec["final"][0]
    out = []
    for x in states:
        if ln == "own":
            with torch.no_grad():
                h = fam.norm(x)
        elif fam.neox:
            xc = x - x.mean(-1, keepdim=True)
            s = (xL - xL.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True).add(fam.eps).sqrt()
            h = xc / s * fam.norm.weight + fam.norm.bias
        else:
            s = xL.float().pow(2).mean(-1, keepdim=True).add(fam.eps).sqrt()
            h = (x.float() / s * fam.w_eff().float()).to(x.dtype)
        out.append(fam.unembed(h))
    return torch.stack(out), rec["logits"]


def check_lens(fam: Fam, ids, ln="own", incl_mid=False, top_k=5, body=None) -> dict:
    with fam.client() as c:
        r = c.post("/v1/logit-lens", json={"token_lists": [ids], "ln": ln, "incl_mid": incl_mid,
                                           "top_k": top_k, **(body or {})})
    assert r.status_code == 200, r.text
    got = r.json()
    states = got["prompts"][0]["states"]
    ref, logits = hf_lens(fam, ids, ln, incl_mid)
    assert len(states) == ref.shape[0]
    ids_t = torch.tensor(ids)
    worst = {"loss": 0.0, "prob": 0.0, "logit": 0.0, "logprob": 0.0, "final_vs_model": 0.0}
    for s, st in enumerate(states):
        lg = ref[s].double()
        lp = torch.log_softmax(lg, -1)
        loss = float(-lp[:-1].gather(-1, ids_t[1:, None]).mean())
        worst["loss"] = max(worst["loss"], abs(loss - st["loss"]))
        for row in st["positions"]:
            q = row["position"]
            for t in row["top"]:
                worst["prob"] = max(worst["prob"], abs(float(lp[q, t["id"]].exp()) - t["prob"]))
                worst["logit"] = max(worst["logit"], abs(float(lg[q, t["id"]]) - t["logit"]))
                if st["label"] == "final_post":  # the model's own logits
                    worst["final_vs_model"] = max(worst["final_vs_model"],
                                                  abs(float(logits[q, t["id"]]) - t["logit"]))
            want_p = lp[q].exp().topk(len(row["top"])).values.tolist()
            for a, t in zip(want_p, row["top"]):
                worst["prob"] = max(worst["prob"], abs(a - t["prob"]))
            if row["target"] is not None:
                worst["logprob"] = max(worst["logprob"], abs(
                    float(lp[q, row["target"]["id"]]) - row["target"]["logprob"]))
    assert max(worst.values()) <= 1e-5, worst
    return {**worst, "response": got}


@pytest.mark.parametrize("ln", ["own", "final"])
def test_logit_lens_equals_hugging_faces_own_norm(fam, ln):
    """Every state through HF's final norm module (own) / the frozen scale by hand (final),
    lm_head and Gemma 2's soft-cap: loss, top-k probs and logits, next-token log-probs
    <= 1e-5; mid states too where the family has hook_resid_mid."""
    got = check_lens(fam, IDS, ln=ln, incl_mid=not fam.neox)
    words = "RMSNorm" if fam.family in RMS else "(x - mean x)"
    assert words in got["response"]["ln_description"]
    if fam.family in RMS:
        assert "no centring" in got["response"]["ln_description"].lower()


def test_final_state_is_the_models_logits_exactly(fam):
    """ln "own" on final_post runs HF's norm, lm_head and soft-cap ops: the served logits are
    the model's own float32 logits (measured: equal; bound 1e-6 for the linear's blocking)."""
    with fam.client() as c:
        r = c.post("/v1/logit-lens", json={"token_lists": [IDS], "top_k": 20}).json()
    logits = fam.record(IDS)["logits"]
    final = r["prompts"][0]["states"][-1]
    assert final["label"] == "final_post"
    worst = max(abs(float(logits[row["position"], t["id"]]) - t["logit"])
                for row in final["positions"] for t in row["top"])
    assert worst <= 1e-6, worst
    assert [row["top"][0]["id"] for row in final["positions"]] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_logit_lens_equals_transformerlens(family, tmp_path_factory):
    """TransformerLens 4.3's bridge: ``accumulated_resid(apply_ln=True)`` (its ln_final per
    state; RMSNorm for Llama) through ``W_U``: equal to the served lens <= 1e-5."""
    if family not in _FAMS:
        _FAMS[family] = Fam(family, tmp_path_factory.getbasetemp() / "families")
    f = _FAMS[family]
    with torch.no_grad():
        _, cache = f.tl.run_with_cache(torch.tensor([IDS]))
        stack = cache.accumulated_resid(apply_ln=True)[:, 0]
        tl = stack @ f.tl.W_U
        if getattr(f.tl, "b_U", None) is not None:
            tl = tl + f.tl.b_U
    with f.client() as c:
        r = c.post("/v1/logit-lens", json={"token_lists": [IDS], "top_k": 5}).json()
    states = r["prompts"][0]["states"]
    assert len(states) == tl.shape[0]
    worst = 0.0
    for s, st in enumerate(states):
        lp = torch.log_softmax(tl[s].double(), -1)
        for row in st["positions"]:
            for t in row["top"]:
                worst = max(worst, abs(float(lp[row["position"], t["id"]].exp()) - t["prob"]),
                            abs(float(tl[s, row["position"], t["id"]]) - t["logit"]))
    assert worst <= 1e-5, worst


@pytest.mark.parametrize("fault", ["weight_not_1p", "no_softcap", "centred"])
def test_planted_lens_faults_fail_the_comparison(fam, monkeypatch, fault):
    """Planted faults in the RMSNorm lens: Gemma's weight taken as w (not 1 + w), Gemma 2's
    soft-cap dropped, or the RMSNorm centred like a LayerNorm; each fails the HF comparison on
    the family it concerns."""
    if (fault == "weight_not_1p" and not fam.family.startswith("gemma")) or \
            (fault == "no_softcap" and fam.family != "gemma2") or \
            (fault == "centred" and fam.family not in RMS):
        pytest.skip("the fault does not concern this family")
    real = A.rms_lens_logits

    def wrong(x, unembed, w, eps, ln, gemma, cap, final_scale=None):
        if fault == "weight_not_1p":
            gemma = False
        elif fault == "no_softcap":
            cap = None
        else:
            x = x - x.mean(-1, keepdim=True)
        return real(x, unembed, w, eps, ln, gemma, cap, final_scale)

    monkeypatch.setattr(A, "rms_lens_logits", wrong)
    with pytest.raises(AssertionError):
        check_lens(fam, IDS, ln="own")
    monkeypatch.setattr(A, "rms_lens_logits", real)
    check_lens(fam, IDS, ln="own")


def test_incl_mid_on_a_parallel_residual_is_a_named_422(tmp_path_factory):
    if "gpt_neox" not in _FAMS:
        _FAMS["gpt_neox"] = Fam("gpt_neox", tmp_path_factory.getbasetemp() / "families")
    with _FAMS["gpt_neox"].client() as c:
        e = assert_error(c.post("/v1/logit-lens", json={"token_lists": [IDS], "incl_mid": True}),
                         422, type_="unsupported_model_config", param="incl_mid")
        assert "hook_resid_mid" in e["message"]
        assert c.post("/v1/logit-lens", json={"token_lists": [IDS]}).status_code == 200


# ------------------------------------------------------------------ direct logit attribution
def hf_dla(fam: Fam, ids, q: int, target: int, distractor: int) -> dict:
    """Each component's part by hand from HF hooks (module docstring)."""
    rec = fam.record(ids)
    cfg = fam.cfg
    L, H = cfg.num_hidden_layers, cfg.num_attention_heads
    W_U = fam.hf.get_output_embeddings().weight.double()
    d = W_U[target] - W_U[distractor]
    xL = rec["final"][0, q].double()
    if fam.neox:
        s = float((xL - xL.mean()).pow(2).mean().add(fam.eps).sqrt())

        def part(c):
            c = c.double()
            return float(((c - c.mean()) / s) @ (fam.norm.weight.double() * d))
        bias = float(fam.norm.bias.double() @ d)
    else:
        s = float(rec["final"][0, q].float().pow(2).mean().add(fam.eps).sqrt())

        def part(c):
            return float((c.double() / s) @ (fam.w_eff() * d))
        bias = 0.0
    out = {"embed": part(rec["hidden"][0][0, q]), "heads": [], "bias": [], "mlp": [],
           "ln_bias": bias}
    for layer in range(L):
        lay = fam.base.layers[layer]
        attn = lay.attention if fam.neox else lay.self_attn
        o = attn.dense if fam.neox else attn.o_proj
        z = rec["z"][layer][0, q]
        dh = z.shape[-1] // H
        row = []
        for h in range(H):
            res = z[h * dh:(h + 1) * dh].double() @ o.weight[:, h * dh:(h + 1) * dh].double().T
            if fam.family == "gemma2":
                a = rec["post_in"][layer][0, q].float()
                sp = a.pow(2).mean().add(cfg.rms_norm_eps).sqrt().double()
                res = res / sp * (1.0 + lay.post_attention_layernorm.weight.double())
            row.append(part(res))
        out["heads"].append(row)
        if o.bias is not None:
            out["bias"].append(part(o.bias))
        out["mlp"].append(part(rec["mlp"][layer][0, q]))
    lg = rec["logits"].double()
    out["served"] = float(lg[q, target] - lg[q, distractor])
    if fam.cap is not None:
        with torch.no_grad():
            pre = fam.hf.get_output_embeddings()(fam.norm(rec["final"][0])).double()
        out["pre_cap"] = float(pre[q, target] - pre[q, distractor])
    return out


def check_dla(fam: Fam, ids, positions, target, distractor) -> dict:
    with fam.client() as c:
        r = c.post("/v1/logit-attribution", json={
            "token_lists": [ids], "target": target, "distractor": distractor,
            "positions": positions})
    assert r.status_code == 200, r.text
    got = r.json()
    worst = {"heads": 0.0, "embed": 0.0, "bias": 0.0, "mlp": 0.0, "served": 0.0, "sum": 0.0,
             "ln_bias": 0.0}
    for row in got["prompts"][0]["positions"]:
        ref = hf_dla(fam, ids, row["position"], target, distractor)
        worst["heads"] = max(worst["heads"], max(abs(a - b) for ra, rb in zip(
            row["heads"], ref["heads"]) for a, b in zip(ra, rb)))
        worst["embed"] = max(worst["embed"], abs(row["embed"] - ref["embed"]))
        worst["mlp"] = max(worst["mlp"], max(abs(a - b) for a, b in zip(row["mlp"], ref["mlp"])))
        if ref["bias"]:
            worst["bias"] = max(worst["bias"], max(abs(a - b) for a, b in zip(
                row["attn_bias"], ref["bias"])))
        else:
            assert row["attn_bias"] is None
        assert row["pos_embed"] is None
        worst["ln_bias"] = max(worst["ln_bias"], abs(row["ln_final_bias"] - ref["ln_bias"]))
        worst["served"] = max(worst["served"], abs(row["logit_diff"] - ref["served"]))
        attributed = ref.get("pre_cap", ref["served"])
        if fam.cap is not None:
            worst["served"] = max(worst["served"],
                                  abs(row["pre_softcap_logit_diff"] - ref["pre_cap"]))
        else:
            assert row["pre_softcap_logit_diff"] is None
        total = row["embed"] + sum(map(sum, row["heads"])) + sum(row["attn_bias"] or []) + \
            sum(row["mlp"])
        assert abs(total - row["sum_of_parts"]) <= 1e-4
        worst["sum"] = max(worst["sum"], abs(row["residual_error"]),
                           abs(attributed - total - row["ln_final_bias"]))
    assert max(worst.values()) <= 1e-5 if worst["sum"] <= 1e-4 else False, worst
    return {**worst, "response": got}


def test_dla_equals_a_hand_computation_from_hf_hooks(fam):
    """Heads, b_O, MLPs and the embedding by hand from HF's hooks through the frozen final
    norm <= 1e-5; the parts sum to the logit difference (Gemma 2: before the soft-cap),
    residual_error <= 1e-4 (measured ~1e-6)."""
    got = check_dla(fam, IDS, [-1, 6, 0], target=17, distractor=300)
    method = got["response"]["method"]
    assert ("RMSNorm" in method) == (fam.family in RMS)
    if fam.family == "gemma2":
        assert "ln1_post" in method and "soft-cap" in method


@pytest.mark.parametrize("fault", ["centred", "head_slice", "drop_mlp"])
def test_planted_dla_faults_fail(fam, monkeypatch, fault):
    """Planted faults: the RMSNorm components centred like a LayerNorm's, two heads' parts
    exchanged (the sum still holds: only the hand comparison sees it), an MLP dropped (the
    reported residual_error sees it)."""
    if fam.family not in RMS:
        pytest.skip("the RMSNorm attribution")
    real = A.rms_direct_logit_attribution

    def wrong(stack, scale, w_eff, direction):
        stack = stack.clone()
        if fault == "centred":
            stack = stack - stack.mean(-1, keepdim=True)
        elif fault == "head_slice":
            stack[[1, 2]] = stack[[2, 1]]
        else:
            stack[-1] = 0
        return real(stack, scale, w_eff, direction)

    monkeypatch.setattr(A, "rms_direct_logit_attribution", wrong)
    with pytest.raises(AssertionError):
        check_dla(fam, IDS, [-1, 6], target=17, distractor=300)
    if fault == "drop_mlp":
        with fam.client() as c:
            row = c.post("/v1/logit-attribution", json={
                "token_lists": [IDS], "target": 17, "distractor": 300}).json()[
                "prompts"][0]["positions"][0]
        assert abs(row["residual_error"]) > 1e-3, row
    monkeypatch.setattr(A, "rms_direct_logit_attribution", real)
    check_dla(fam, IDS, [-1, 6], target=17, distractor=300)


# ------------------------------------------------------------------------------ circuits
def test_circuits_equal_transformerlens(fam):
    """/v1/circuits on the rotary families: composition scores (Q, K, V) equal TL 4.3's
    ``all_composition_scores`` (which ignores rotary; with GQA TL repeats the key/value heads
    as we do) <= 1e-5 (measured ~6e-8); OV/QK Frobenius norms equal ``model.OV`` / ``model.QK``
    (TL float32) to 1e-5 relative; qk_definition says the QK reading is at relative position 0."""
    with fam.client() as c:
        r = c.post("/v1/circuits", json={"top_k": 64})
    assert r.status_code == 200, r.text
    got = r.json()
    assert "relative position 0" in got["qk_definition"] and "RoPE" in got["qk_definition"]
    assert "repeat_kv" in got["weights"]
    worst = 0.0
    for m in "qkv":
        tl = fam.tl.all_composition_scores(m.upper()).scores.detach().double()
        worst = max(worst, float((tl - torch.tensor(got["composition"][m])).abs().max()))
    assert worst <= 1e-5, worst
    H = fam.cfg.num_attention_heads
    with torch.no_grad():
        for row in got["heads"]:
            ov = fam.tl.OV[row["layer"], row["head"]]
            qk = fam.tl.QK[row["layer"], row["head"]]
            for mat, fro, sv in ((ov, row["ov_frobenius"], row["ov_singular_values"]),
                                 (qk, row["qk_frobenius"], row["qk_singular_values"])):
                want = float(mat.norm())
                assert abs(want - fro) <= 1e-5 * max(1.0, want), (row, want)
                want_sv = torch.tensor(mat.svd()[1].tolist()[:len(sv)], dtype=torch.float64)
                assert (want_sv - torch.tensor(sv)).abs().max() <= 1e-5 * max(1.0, want), row
    assert len(got["heads"]) == fam.cfg.num_hidden_layers * H


def test_a_wrong_kv_head_mapping_fails_the_circuits_comparison(monkeypatch, tmp_path_factory):
    """Planted fault: query head h given kv head h % n_kv (not h // group) in W_K changes the
    K-composition scores beyond the bound (Llama, 4 query / 2 kv heads)."""
    from attnscope.service.serving import circuits as S

    if "llama" not in _FAMS:
        _FAMS["llama"] = Fam("llama", tmp_path_factory.getbasetemp() / "families")
    f = _FAMS["llama"]
    real = S.weights

    def wrong(p):
        w = real(p)
        W_K = w.W_K.clone()
        W_K[:, [1, 2]] = W_K[:, [2, 1]]  # heads 1 and 2 read each other's kv head
        return S.C.CircuitWeights(w.W_Q, W_K, w.W_V, w.W_O, w.W_E, w.W_U)

    tl = f.tl.all_composition_scores("K").scores.detach().double()
    f.rt.memo.clear()
    monkeypatch.setattr(S, "weights", wrong)
    try:
        with f.client() as c:
            bad = torch.tensor(c.post("/v1/circuits").json()["composition"]["k"])
    finally:
        monkeypatch.setattr(S, "weights", real)
        f.rt.memo.clear()
    assert float((tl - bad).abs().max()) > 1e-3
    with f.client() as c:
        good = torch.tensor(c.post("/v1/circuits").json()["composition"]["k"])
    assert float((tl - good).abs().max()) <= 1e-5


def test_start_up_precomputes_the_circuits_quietly(fam):
    """Start-up on a rotary family computes /v1/circuits (no 'precomputing ... failed'
    traceback, issue 28: it asked for GPT-2's fused attn_w) and keeps it for the first request."""
    import logging

    from attnscope.service.app import precompute
    from attnscope.service.serving.core.table import default_table

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    log = logging.getLogger("attnscope")
    h = Keep(level=logging.DEBUG)
    log.addHandler(h)
    old = log.level
    log.setLevel(logging.DEBUG)
    try:
        fam.rt.memo.clear()
        precompute(fam.rt, default_table())
    finally:
        log.removeHandler(h)
        log.setLevel(old)
    assert not [r for r in records if r.levelno >= logging.WARNING], \
        [r.getMessage() for r in records]
    assert any("precomputed at start-up" in r.getMessage() for r in records)
    key = ("circuits", fam.rt.model_ref()["id"], fam.rt.model_ref()["revision"])
    assert key in fam.rt.memo


def test_the_dla_plot_draws_a_rotary_response(fam):
    """The client's plot of a rotary family's attribution (pos_embed and, without b_O,
    attn_bias null): one bar per component that is there."""
    pytest.importorskip("matplotlib")
    from attnscope.client import plots

    with fam.client() as c:
        res = c.post("/v1/logit-attribution", json={"token_lists": [IDS], "target": 17}).json()
    fig = plots.logit_attribution(res)
    L, H = fam.cfg.num_hidden_layers, fam.cfg.num_attention_heads
    d = res["prompts"][0]["positions"][0]
    n = 1 + L * H + L + (L if d["attn_bias"] is not None else 0)
    assert len(fig.axes[0].patches) == n


def test_the_bundled_llama_starts_quietly_and_serves_the_three(caplog):
    """The real lifespan on Settings(model="bundled-llama") (the trained Llama: RoPE, GQA 4/2,
    RMSNorm): no start-up error record (issue 28: the circuits precompute's traceback), the
    circuits kept before ready; lens, DLA and circuits answer 200, the lens' final state is the
    model's own prediction and the attribution's parts sum to the logit difference."""
    import logging
    import time

    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app

    with caplog.at_level(logging.INFO, logger="attnscope"):
        c = TestClient(create_app(Settings(model="bundled-llama")))
        c.__enter__()
        try:
            while c.get("/readyz").status_code != 200:
                assert c.app.state.load_error is None, c.app.state.load_error
                time.sleep(0.05)
            rt = c.app.state.runtime
            assert ("circuits", rt.model_ref()["id"], rt.model_ref()["revision"]) in rt.memo
            text = "In the beginning God created the heaven and the earth."
            lens = c.post("/v1/logit-lens", json={"text": text, "top_k": 1})
            dla = c.post("/v1/logit-attribution", json={"text": text, "target": " the",
                                                        "distractor": " and"})
            circ = c.post("/v1/circuits", json={"top_k": 2})
            pred = c.post("/v1/predictions", json={"text": text, "top_k": 1})
        finally:
            c.__exit__(None, None, None)
    bad = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not bad, bad
    assert any("precomputed at start-up" in r.getMessage() for r in caplog.records)
    for r in (lens, dla, circ, pred):
        assert r.status_code == 200, r.text
    final = lens.json()["prompts"][0]["states"][-1]["positions"][-1]["top"][0]
    assert circ.json()["qk_definition"] is not None
    row = dla.json()["prompts"][0]["positions"][0]
    assert abs(row["residual_error"]) <= 1e-4 and row["pos_embed"] is None
    assert abs(row["logit_diff"] - row["sum_of_parts"]) <= 1e-4
    p = pred.json()
    assert final["id"] == _top_prediction(p), (final, p)


def _top_prediction(p) -> int:
    """The id of /v1/predictions' top next token at the last position."""
    res = p.get("predictions") or p["results"][0]
    return res["positions"][-1]["top"][0]["id"]
