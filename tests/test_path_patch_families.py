"""POST /v1/path-patch on the rotary families (issue 28's leftovers, issue 27): the random small
checkpoints of tests/families.py (GQA 4 query / 2 key-value heads, Gemma 2's post-attention
norm, GPT-NeoX's parallel residual), through the real app in-process, against Wang et al.'s
three steps written by hand with TransformerLens 4.3 hooks (test_path_patch.tl_path_patch:
every other head's ``hook_result`` and every MLP's ``hook_mlp_out`` frozen at the base run).

* Gemma 2 head senders: exact (each sender layer's ``hook_attn_out`` recomputed from the
  sender heads' ``hook_z`` through ``ln1_post``); the additive approximation (a per-head
  ``hook_result`` delta), planted, is caught.
* GPT-NeoX MLP receivers: the MLP's own input ``ln2(hook_resid_pre + change)``; a reference
  that patches the whole block's ``hook_resid_pre`` instead (a wrong receiver input) is caught;
  a head does not reach its own layer's MLP (422).
* k/v receivers under GQA: ``heads`` index key/value heads (``head_axis: kv_head``); the grid's
  k/v receiver axis has ``n_kv_heads`` cells (the rest null).

Bound vs TL: 1e-5 on raw metrics (measured <= 1.4e-6)."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_error
from families import FAMILIES, family_checkpoint
from interventions_reference import tl_hooked_bridge
from test_path_patch import tl_path_patch

pytest.importorskip("transformer_lens")

G = torch.Generator().manual_seed(7)
IDS = torch.randint(5, 2048, (2, 13), generator=G)
IDS[:, 0] = 0
CLEAN, CORRUPT = IDS[0].tolist(), IDS[1].tolist()
LOSS = {"kind": "loss", "terms": [{"position": p} for p in range(7, 12)]}
TOL = 1e-5
GQA = ("llama", "mistral", "qwen2", "gemma", "gemma2")  # 4 query heads, 2 key/value heads


def head(layer, h):
    return {"kind": "head", "layer": layer, "head": h}


CASES = {
    "head->q": ([head(0, 1)], [{"kind": "head", "layer": 1, "input": "q"}]),
    "two heads of a layer->q": ([head(0, 1), head(0, 3)],
                                [{"kind": "head", "layer": 1, "input": "q"}]),
    "head->mlp": ([head(0, 1)], [{"kind": "mlp", "layer": 1}]),
    "head->logits": ([head(1, 2)], [{"kind": "logits"}]),
    "heads of two layers+mlp->logits": ([head(0, 0), head(1, 2), {"kind": "mlp", "layer": 0}],
                                        [{"kind": "logits"}]),
    "head->k (all)": ([head(0, 1)], [{"kind": "head", "layer": 1, "input": "k"}]),
    "head->k head 1": ([head(0, 1)], [{"kind": "head", "layer": 1, "input": "k", "heads": [1]}]),
    "head->v head 0 + q": ([head(0, 2)], [{"kind": "head", "layer": 1, "input": "v", "heads": [0]},
                                          {"kind": "head", "layer": 1, "input": "q",
                                           "heads": [3]}]),
}


class Fam:
    def __init__(self, family, root):
        from attnscope.service.config import Settings
        from attnscope.service.runtime import Runtime

        self.family = family
        self.path = family_checkpoint(family, root)
        self.rt = Runtime.load(Settings(model=str(self.path)))
        self._tl = None

    @property
    def tl(self):
        if self._tl is None:
            self._tl = tl_hooked_bridge(self.path)
        return self._tl


_FAMS: dict = {}


@pytest.fixture(params=FAMILIES)
def fam(request, tmp_path_factory):
    if request.param not in _FAMS:
        _FAMS[request.param] = Fam(request.param, tmp_path_factory.getbasetemp() / "families")
    return _FAMS[request.param]


@pytest.fixture
def client(fam, make_client):
    return make_client(fam.rt, model=str(fam.path))


def body(senders, receivers, **kw):
    return {"pairs": [{"clean_tokens": CLEAN, "corrupted_tokens": CORRUPT}], "metric": LOSS,
            "senders": senders, "receivers": receivers, **kw}


def post(client, b):
    r = client.post("/v1/path-patch", json=b)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("case", list(CASES))
def test_equals_a_transformerlens_hand_loop(fam, client, case):
    senders, receivers = CASES[case]
    out = post(client, body(senders, receivers))
    ref = tl_path_patch(fam.tl, CLEAN, CORRUPT, senders, receivers, LOSS)
    for k in ("base", "other", "patched"):
        assert abs(out[k]["mean"] - ref[k]) <= TOL, (fam.family, case, k, out[k], ref[k])
    assert abs(out["patched"]["mean"] - out["base"]["mean"]) > 1e-3  # the path did something
    kv = fam.family in GQA
    for r, echo in zip(receivers, out["receivers"]):
        if r["kind"] == "head":
            axis = "kv_head" if kv and r["input"] != "q" else "head"
            assert echo["head_axis"] == axis
            n = 2 if axis == "kv_head" else 4
            assert echo["heads"] == r.get("heads", list(range(n)))


def test_the_construction_says_what_the_family_changes(fam, client):
    c = post(client, body(*CASES["head->q"]))["construction"]
    assert ("ln1_post" in c) == (fam.family == "gemma2")
    assert ("ln2.hook_normalized" in c) == (fam.family == "gpt_neox")
    assert ("key/value heads" in c) == (fam.family in GQA)


def test_the_grid_equals_transformerlens_with_kv_heads_on_k_and_v(fam, client):
    out = post(client, {"pairs": [{"clean_tokens": CLEAN, "corrupted_tokens": CORRUPT}],
                        "metric": LOSS, "grid": True})
    g = out["grid"]
    n_kv = 2 if fam.family in GQA else 4
    assert g["receiver_heads"] == {"q": 4, "k": n_kv, "v": n_kv}
    assert g["head_axes"]["k"] == ("kv_head" if n_kv == 2 else "head")
    for hs in range(4):
        for ki, k in enumerate("qkv"):
            for hr in range(4):
                cell = g["raw"][0][hs][1][hr][ki]
                assert (cell is None) == (hr >= g["receiver_heads"][k]), (hs, hr, k)
    for hs, hr, k in [(1, 1, "k"), (0, 0, "v"), (3, 2, "q"), (2, 1, "v")]:
        ref = tl_path_patch(fam.tl, CLEAN, CORRUPT, [head(0, hs)],
                            [{"kind": "head", "layer": 1, "heads": [hr], "input": k}], LOSS)
        cell = g["raw"][0][hs][1][hr]["qkv".index(k)]
        assert abs(cell - ref["patched"]) <= TOL, (fam.family, hs, hr, k, cell, ref)


# ------------------------------------------------------------------ planted faults
def test_gemma2_the_additive_approximation_is_caught(fam, client, monkeypatch):
    """Planted: Gemma 2's sender heads as a per-head hook_result delta (what the other
    families use): off TL's loop by far more than the bound."""
    if fam.family != "gemma2":
        pytest.skip("Gemma 2's post-attention norm")
    from attnscope.service.serving import path_patch as PP

    ref = {c: tl_path_patch(fam.tl, CLEAN, CORRUPT, *CASES[c], LOSS)["patched"]
           for c in ("two heads of a layer->q", "head->logits")}
    exact = {c: post(client, body(*CASES[c]))["patched"]["mean"] for c in ref}
    monkeypatch.setattr(PP, "_post_norm", lambda p: False)
    loose = {c: post(client, body(*CASES[c]))["patched"]["mean"] for c in ref}
    for c in ref:
        assert abs(exact[c] - ref[c]) <= TOL
        assert abs(loose[c] - ref[c]) > 100 * TOL, (c, loose[c], ref[c])


def test_neox_mlp_receiver_reads_the_mlp_input_not_the_block_input(fam, client):
    """Planted: a reference whose MLP receiver is set at hook_resid_pre (the attention of that
    layer then reads the change too): it disagrees; the MLP's own input agrees."""
    if fam.family != "gpt_neox":
        pytest.skip("GPT-NeoX's parallel residual")
    senders, receivers = CASES["head->mlp"]
    out = post(client, body(senders, receivers))
    wrong = tl_path_patch(fam.tl, CLEAN, CORRUPT, senders, receivers, LOSS,
                          mlp_input="hook_resid_pre")
    assert abs(out["patched"]["mean"] - wrong["patched"]) > 100 * TOL
    # and a head never reaches its own layer's MLP under the parallel residual
    r = client.post("/v1/path-patch", json=body([head(0, 1)], [{"kind": "mlp", "layer": 0}]))
    e = assert_error(r, 422, type_="validation_error", param="receivers.0")
    assert "parallel residual" in e["message"], e


def test_gqa_k_receivers_are_kv_heads(fam, client):
    """Planted: the reference on the q input, or on the other kv head, disagrees; a head past
    the key/value heads is a 422 naming them."""
    if fam.family not in GQA:
        pytest.skip("grouped-query attention")
    senders, receivers = CASES["head->k head 1"]
    out = post(client, body(senders, receivers))["patched"]["mean"]
    q = tl_path_patch(fam.tl, CLEAN, CORRUPT, senders, receivers, LOSS, input_override="q")
    other = tl_path_patch(fam.tl, CLEAN, CORRUPT, senders,
                          [dict(receivers[0], heads=[0])], LOSS)
    assert abs(out - q["patched"]) > 100 * TOL
    assert abs(out - other["patched"]) > 100 * TOL
    r = client.post("/v1/path-patch", json=body(senders, [dict(receivers[0], heads=[2])]))
    e = assert_error(r, 422, type_="out_of_range", param="receivers.0.heads.0")
    assert "2 key/value heads" in e["message"], e
    # q receivers still count query heads
    post(client, body(senders, [{"kind": "head", "layer": 1, "input": "q", "heads": [3]}]))
