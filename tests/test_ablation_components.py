"""/v1/ablate ``components``: whole MLPs, whole attention layers, single MLP neurons
(``mlp.hook_post[..., n]``) and directions at a hook (projection out of a unit vector), by
zero / mean / resample, each equal to the same ablation written as forward hooks on Hugging
Face's own GPT2LMHeadModel (no code of the service); declared metrics on the clean, ablated
and resample runs; bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GPT2LMHeadModel

from attnscope.service.config import BUNDLED_MODEL_DIR

from conftest import assert_error
from interventions_reference import induction_ids

IDS = induction_ids(3, 7, 2)            # BOS + 7 tokens, repeated: 15 tokens
OTHER = induction_ids(40, 7, 2)         # the resample text, same length
REFS = [induction_ids(50, 5, 2), induction_ids(51, 9, 1)]  # reference texts (11 and 10 tokens)


@pytest.fixture(scope="module")
def hf():
    return GPT2LMHeadModel.from_pretrained(BUNDLED_MODEL_DIR, attn_implementation="eager").eval()


class Hooks:
    """Forward hooks on the HF model that record / edit: ``mlp_out[l]`` (the MLP module's
    output), ``attn_out[l]`` (the attention module's output after c_proj), ``post[l]`` (the
    input of mlp.c_proj = the activation's output), ``z[l]`` (the input of attn.c_proj, viewed
    [batch, pos, head, d_head]), ``resid_post[l]`` (the block's output)."""

    def __init__(self, model, edits=None):
        self.m, self.edits, self.seen, self.handles = model, edits or {}, {}, []

    def __enter__(self):
        cfg = self.m.config
        H, dh = cfg.n_head, cfg.n_embd // cfg.n_head
        for layer, blk in enumerate(self.m.transformer.h):
            def out_hook(key, layer=layer):
                def fn(mod, args, out):
                    x = out[0] if isinstance(out, tuple) else out
                    self.seen[(key, layer)] = x.detach().clone()
                    e = self.edits.get((key, layer))
                    if e is None:
                        return None
                    y = e(x)
                    return (y,) + tuple(out[1:]) if isinstance(out, tuple) else y
                return fn

            def pre_hook(key, layer=layer, view=None):
                def fn(mod, args):
                    x = args[0]
                    v = x.view(*x.shape[:-1], H, dh) if view else x
                    self.seen[(key, layer)] = v.detach().clone()
                    e = self.edits.get((key, layer))
                    if e is None:
                        return None
                    return (e(v).reshape(x.shape),)
                return fn
            self.handles += [
                blk.mlp.register_forward_hook(out_hook("mlp_out")),
                blk.attn.register_forward_hook(out_hook("attn_out")),
                blk.register_forward_hook(out_hook("resid_post")),
                blk.mlp.c_proj.register_forward_pre_hook(pre_hook("post")),
                blk.attn.c_proj.register_forward_pre_hook(pre_hook("z", view=True)),
            ]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def hf_logits(model, ids, edits=None):
    with torch.no_grad(), Hooks(model, edits) as h:
        return model(torch.tensor([ids]), use_cache=False).logits[0], h.seen


def seen(model, ids):
    return hf_logits(model, ids)[1]


def _ablated_kl(body):
    return np.array([p["kl"] for p in body["positions"]])


def _kl(lc, la):
    pc, pa = torch.log_softmax(lc, -1), torch.log_softmax(la, -1)
    return (pc.exp() * (pc - pa)).sum(-1).numpy()


def _post(client, **kw):
    r = client.post("/v1/ablate", json={"tokens": IDS, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def _check(body, hf, edits):
    clean, _ = hf_logits(hf, IDS)
    abl, _ = hf_logits(hf, IDS, edits)
    ours = _ablated_kl(body)
    ref = _kl(clean, abl)
    assert ref.max() > 1e-3  # the ablation changes something
    assert np.abs(ours - ref).max() <= 2e-5, np.abs(ours - ref).max()
    losses = -torch.log_softmax(abl, -1)[torch.arange(len(IDS) - 1), torch.tensor(IDS[1:])]
    assert abs(body["mean_loss_ablated"] - float(losses.mean())) <= 2e-5
    return clean, abl


def test_mlp_zero_mean_resample(client, hf):
    base = seen(hf, IDS)
    other = seen(hf, OTHER)
    refs = [seen(hf, r) for r in REFS]
    comps = [{"kind": "mlp", "layer": 0}]
    _check(_post(client, components=comps), hf, {("mlp_out", 0): lambda x: torch.zeros_like(x)})
    mean = base[("mlp_out", 0)][0].mean(0)
    _check(_post(client, components=comps, method="mean"), hf,
           {("mlp_out", 0): lambda x: mean.expand_as(x)})
    pooled = torch.cat([r[("mlp_out", 0)][0] for r in refs]).mean(0)
    _check(_post(client, components=comps, method="mean", reference_token_lists=REFS), hf,
           {("mlp_out", 0): lambda x: pooled.expand_as(x)})
    _check(_post(client, components=comps, method="resample", resample_tokens=OTHER), hf,
           {("mlp_out", 0): lambda x: other[("mlp_out", 0)]})


def test_attention_layer_zero(client, hf):
    _check(_post(client, components=[{"kind": "attn", "layer": 1}]), hf,
           {("attn_out", 1): lambda x: torch.zeros_like(x)})


def test_neurons(client, hf):
    nn = [3, 17, 200]
    base = seen(hf, IDS)
    other = seen(hf, OTHER)

    def setter(val):
        def fn(x):
            x = x.clone()
            x[..., nn] = val(x)
            return x
        return fn
    comps = [{"kind": "neuron", "layer": 1, "neurons": nn}]
    _check(_post(client, components=comps), hf, {("post", 1): setter(lambda x: 0.0)})
    mean = base[("post", 1)][0][:, nn].mean(0)
    _check(_post(client, components=comps, method="mean"), hf,
           {("post", 1): setter(lambda x: mean.expand_as(x[..., nn]))})
    _check(_post(client, components=comps, method="resample", resample_tokens=OTHER), hf,
           {("post", 1): setter(lambda x: other[("post", 1)][..., nn])})


def test_planted_wrong_neuron_fails(client, hf):
    """The reference tells neurons apart: ablating neuron 3 is not ablating neuron 4."""
    body = _post(client, components=[{"kind": "neuron", "layer": 1, "neurons": [3, 17, 200]}])

    def fn(x):
        x = x.clone()
        x[..., [4, 17, 200]] = 0.0
        return x
    clean, _ = hf_logits(hf, IDS)
    wrong, _ = hf_logits(hf, IDS, {("post", 1): fn})
    assert np.abs(_ablated_kl(body) - _kl(clean, wrong)).max() > 1e-4


def test_directions(client, hf):
    g = torch.Generator().manual_seed(0)
    D = hf.config.n_embd
    dh = D // hf.config.n_head
    u = torch.randn(D, generator=g)
    uz = torch.randn(dh, generator=g)
    un, uzn = u / u.norm(), uz / uz.norm()
    base = seen(hf, IDS)

    def project(unit, c=lambda x: 0.0, positions=None):
        def fn(x):
            x = x.clone()
            pos = slice(None) if positions is None else positions
            coef = (x[:, pos] * unit).sum(-1, keepdim=True)
            x[:, pos] = x[:, pos] - coef * unit + c(x[:, pos]) * unit
            return x
        return fn
    body = _post(client, components=[{"kind": "direction", "hook": "blocks.0.hook_resid_post",
                                       "vector": (3 * u).tolist()}])
    assert abs(body["components"][0]["vector_norm"] - 3 * float(u.norm())) <= 1e-3
    _check(body, hf, {("resid_post", 0): project(un)})
    # per-head direction on z, at chosen positions
    body = _post(client, components=[{"kind": "direction", "hook": "blocks.1.attn.hook_z",
                                      "vector": uz.tolist(), "positions": [5, 9, 12]}])
    _check(body, hf, {("z", 1): project(uzn, positions=[5, 9, 12])})
    # mean: the coefficient set to its mean over the text's positions
    mc = (base[("resid_post", 0)][0] * un).sum(-1).mean()
    body = _post(client, method="mean", components=[
        {"kind": "direction", "hook": "blocks.0.hook_resid_post", "vector": u.tolist()}])
    _check(body, hf, {("resid_post", 0): project(un, c=lambda x: mc)})


def test_components_together_and_heads_equal_legacy(client, hf):
    """A head component equals the legacy ``heads`` field; components ablate together,
    upstream first (a neuron of layer 0 and a direction at layer 1's resid_post, whose value
    depends on the neuron's ablation)."""
    legacy = _post(client, heads=[[1, 2]], method="mean")
    comp = _post(client, components=[{"kind": "head", "layer": 1, "head": 2}], method="mean")
    assert np.abs(_ablated_kl(legacy) - _ablated_kl(comp)).max() <= 1e-5
    u = torch.randn(hf.config.n_embd, generator=torch.Generator().manual_seed(1))
    un = u / u.norm()

    def zero_n(x):
        x = x.clone()
        x[..., 7] = 0.0
        return x

    def proj(x):
        return x - (x * un).sum(-1, keepdim=True) * un
    body = _post(client, components=[
        {"kind": "direction", "hook": "blocks.1.hook_resid_post", "vector": u.tolist()},
        {"kind": "neuron", "layer": 0, "neurons": [7]}])
    _check(body, hf, {("post", 0): zero_n, ("resid_post", 1): proj})


def test_declared_metric(client, hf):
    T = len(IDS)
    metric = {"kind": "logprob", "terms": [{"position": T - 2, "target": IDS[-1]}]}
    body = _post(client, components=[{"kind": "mlp", "layer": 0}], method="resample",
                 resample_tokens=OTHER, metric=metric)
    clean, _ = hf_logits(hf, IDS)
    other = seen(hf, OTHER)
    abl, _ = hf_logits(hf, IDS, {("mlp_out", 0): lambda x: other[("mlp_out", 0)]})
    res, _ = hf_logits(hf, OTHER)

    def lp(lg):
        return float(torch.log_softmax(lg[T - 2], -1)[IDS[-1]])
    m = body["metric"]
    assert abs(m["clean"] - lp(clean)) <= 2e-5
    assert abs(m["ablated"] - lp(abl)) <= 2e-5
    assert abs(m["resample"] - lp(res)) <= 2e-5
    want = (lp(abl) - lp(res)) / (lp(clean) - lp(res))
    assert abs(m["normalized"] - want) <= 1e-3 * max(1, abs(want))
    # a scan on the declared metric: every head alone, against the legacy logit_diff-free path
    scan = client.post("/v1/ablate", json={"tokens": IDS, "scan": True, "scan_metric": "metric",
                                           "metric": metric}).json()["scan"]
    assert abs(scan["clean"] - lp(clean)) <= 2e-5
    H = hf.config.n_head

    def zero_head(h):
        def fn(z):
            z = z.clone()
            z[:, :, h] = 0
            return z
        return fn
    for layer, h in ((0, 1), (1, 3)):
        lg, _ = hf_logits(hf, IDS, {("z", layer): zero_head(h)})
        assert abs(scan["grid"][layer][h] - lp(lg)) <= 2e-5
    assert len(scan["grid"][0]) == H


def test_bad_input(client):
    def err(comps, param, **kw):
        r = client.post("/v1/ablate", json={"tokens": IDS, "components": comps, **kw})
        return assert_error(r, 422, param=param)
    err([{"kind": "mlp", "layer": 9}], "components.0.layer")
    err([{"kind": "neuron", "layer": 0, "neurons": [99999]}], "components.0.neurons.0")
    err([{"kind": "neuron", "layer": 0, "neurons": [1, 1]}], "components.0.neurons.1")
    err([{"kind": "head", "layer": 0, "head": 7}], "components.0.head")
    err([{"kind": "mlp", "layer": 0}, {"kind": "mlp", "layer": 0}], "components.1")
    err([{"kind": "direction", "hook": "blocks.0.hook_resid_post", "vector": [1.0, 2.0]}],
        "components.0.vector")
    e = err([{"kind": "direction", "hook": "blocks.0.hook_resid_psot", "vector": [1.0]}],
            "components.0.hook")
    assert "hook_resid_post" in e["message"]
    err([{"kind": "direction", "hook": "blocks.0.attn.hook_pattern", "vector": [1.0]}],
        "components.0.hook")
    err([{"kind": "direction", "hook": "blocks.*.hook_resid_post", "vector": [1.0]}],
        "components.0.hook")
    r = client.post("/v1/ablate", json={"tokens": IDS, "components": [
        {"kind": "direction", "hook": "blocks.0.hook_resid_post", "vector": [0.0] * 64}]})
    assert_error(r, 422)
    assert_error(client.post("/v1/ablate", json={"tokens": IDS, "scan": True, "components": [
        {"kind": "mlp", "layer": 0}]}), 422)
    # a direction's positions past the text (the breaker: 500 IndexError), at and past T
    for q in (len(IDS), 99):
        e = err([{"kind": "direction", "hook": "blocks.0.hook_resid_pre", "vector": [1.0] * 128,
                  "positions": [0, q]}], "components.0.positions.1")
        assert str(q) in e["message"] and str(len(IDS) - 1) in e["message"]
    assert client.get("/healthz").status_code == 200


# ------------------------------------------------------------------ over a dataset (batched)
DATA = [induction_ids(60 + s, 5, 2) for s in range(4)] + [induction_ids(70, 4, 2)]  # 4 x 11, 9


def test_dataset_mean_ablation_batched_equals_hf_and_singles(client, hf):
    """/v1/ablate components over ``token_lists`` with method mean: the means over every
    position of the dataset taken once (one batched forward per token count), the ablated
    forwards batched (the four 11-token texts in one); per text equal to forward hooks on HF's
    GPT2LMHeadModel with the dataset means (<= 2e-5) and to the single request with
    reference_token_lists = the dataset to float32 rounding (rtol 2e-6: a batched row's matrix
products may round differently from the single text's; measured 6.8118114 vs 6.811812);
    a planted fault (the means over the first text only) fails the HF comparison."""
    nn = [3, 7]
    comps = [{"kind": "mlp", "layer": 0}, {"kind": "neuron", "layer": 1, "neurons": nn},
             {"kind": "head", "layer": 1, "head": 2}]
    kw = {"components": comps, "method": "mean"}
    r = client.post("/v1/ablate", json={"token_lists": DATA, "per_text": True, **kw})
    assert r.status_code == 200, r.text
    st = r.json()["dataset"]["stats"]
    seen_all = [seen(hf, ids) for ids in DATA]

    def means(texts):
        cat = {k: torch.cat([s[k][0] for s in texts]) for k in
               (("mlp_out", 0), ("post", 1), ("z", 1))}
        return cat[("mlp_out", 0)].mean(0), cat[("post", 1)][:, nn].mean(0), \
            cat[("z", 1)][:, 2].mean(0)

    def edits(m_mlp, m_post, m_z):
        def post(x):
            x = x.clone()
            x[..., nn] = m_post.expand_as(x[..., nn])
            return x

        def z(x):
            x = x.clone()
            x[..., 2, :] = m_z
            return x
        return {("mlp_out", 0): lambda x: m_mlp.expand_as(x), ("post", 1): post, ("z", 1): z}

    def hf_values(ms):
        kls, losses = [], []
        for ids in DATA:
            clean, _ = hf_logits(hf, ids)
            abl, _ = hf_logits(hf, ids, edits(*ms))
            kls.append(_kl(clean, abl).mean())
            lp = -torch.log_softmax(abl, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
            losses.append(float(lp.mean()))
        return np.array(kls), np.array(losses)
    kl_ref, loss_ref = hf_values(means(seen_all))
    kl, loss = np.array(st["mean_kl"]["values"]), np.array(st["mean_loss_ablated"]["values"])
    assert kl_ref.min() > 1e-4
    assert np.abs(kl - kl_ref).max() <= 2e-5 and np.abs(loss - loss_ref).max() <= 2e-5
    wrong_kl, _ = hf_values(means(seen_all[:1]))  # planted: the first text's own means
    assert np.abs(kl - wrong_kl).max() > 1e-4
    singles = [client.post("/v1/ablate", json={"tokens": ids, "reference_token_lists": DATA,
                                               **kw}).json() for ids in DATA]
    for name in ("mean_kl", "mean_loss_ablated"):  # float32 rounding of the batched GEMMs
        one = np.array([b[name] for b in singles])
        np.testing.assert_allclose(st[name]["values"], one, rtol=2e-6, atol=1e-7)
