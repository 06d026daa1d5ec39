"""The second bundled checkpoint, ``service/bundled_llama`` (``--model bundled-llama``): a
``LlamaForCausalLM`` trained by ``training/train_bundled_llama.py``.

Checked from the files alone, offline, against hand computations: the architecture (RoPE,
grouped-query attention, RMSNorm, SwiGLU) by recomputing each layer's attention pattern and
MLP from the weights in float64; the training record's head scores recomputed from the
checkpoint; the revision hash; the name ``bundled-llama`` resolving to it.
"""

from __future__ import annotations

import json
import math
import shutil
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import SENTENCE

from attnscope.service.config import (
    BUNDLED, BUNDLED_LLAMA_DIR, BUNDLED_LLAMA_ID, BUNDLED_MODEL_DIR, Settings,
)

#: _weights_revision(service/bundled_llama) of the committed checkpoint. Retraining changes it:
#: then update it here and in README.md ("The bundled checkpoints").
REVISION = "sha256:b1c4ad444e49"
RECORD = json.loads((BUNDLED_LLAMA_DIR / "training_record.json").read_text())


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(BUNDLED_LLAMA_DIR, local_files_only=True,
                                             attn_implementation="eager", use_safetensors=True)
    return model.eval()


@pytest.fixture(scope="module")
def llama64(llama):
    import copy

    return copy.deepcopy(llama).double()


def test_config_is_llama_with_rope_gqa_rmsnorm_swiglu(llama):
    from transformers.models.llama import modeling_llama as ml

    c = llama.config
    assert c.model_type == "llama" and c.architectures == ["LlamaForCausalLM"]
    assert type(llama).__name__ == "LlamaForCausalLM"
    assert c.num_key_value_heads < c.num_attention_heads
    assert (c.num_attention_heads, c.num_key_value_heads) == (4, 2)
    assert c.rope_parameters["rope_type"] == "default" and c.rope_parameters["rope_theta"] == 1e4
    assert c.hidden_act == "silu" and not c.attention_bias and not c.mlp_bias
    assert c.vocab_size == 2048 and c.tie_word_embeddings
    d_head = c.hidden_size // c.num_attention_heads
    names = {n for n, _ in llama.named_parameters()}
    assert not any("position" in n or "wpe" in n for n in names)  # no learned positions: RoPE
    for layer in llama.model.layers:
        a = layer.self_attn
        assert a.q_proj.weight.shape == (c.num_attention_heads * d_head, c.hidden_size)
        assert a.k_proj.weight.shape == a.v_proj.weight.shape == (
            c.num_key_value_heads * d_head, c.hidden_size)
        assert isinstance(layer.input_layernorm, ml.LlamaRMSNorm)
        assert isinstance(layer.post_attention_layernorm, ml.LlamaRMSNorm)
        assert {"gate_proj", "up_proj", "down_proj"} <= {n for n, _ in layer.mlp.named_children()}
    assert isinstance(llama.model.norm, ml.LlamaRMSNorm)
    # small, like the bundled GPT-2 (2.8 MB)
    assert (BUNDLED_LLAMA_DIR / "model.safetensors").stat().st_size < 3_000_000


def _rms(x, w, eps):
    """RMSNorm x / sqrt(mean(x^2) + eps) * w (Zhang & Sennrich 2019), the normalisation in
    float32 as transformers' LlamaRMSNorm does whatever the model's dtype."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, theta):
    """x [pos, head, d_head] rotated by position (rotate-half form, all dimensions). The
    angles pos * theta^(-2i/d_head) and their cos/sin are float32, as transformers computes
    them whatever the model's dtype (float64 angles move the float64 pattern by ~5e-7)."""
    T, _, dh = x.shape
    inv = 1.0 / theta ** (torch.arange(0, dh, 2, dtype=torch.int64).float() / dh)
    ang = torch.arange(T).float()[:, None] * inv[None]  # [pos, d_head / 2], float32
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos().double()[:, None], emb.sin().double()[:, None]
    x1, x2 = x[..., : dh // 2], x[..., dh // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _pattern(layer, x, c, kv_of_head, theta=None, rope=True):
    """Layer's attention pattern [head, query_pos, key_pos] from its input x [pos, d_model],
    by hand: RMSNorm, q/k projections, RoPE (``theta``, default the config's), query head h
    reads key/value head kv_of_head(h); float64 scores, softmax in float32 as transformers'
    eager attention does (``softmax(..., dtype=torch.float32)``) whatever the model's dtype."""
    H, KV = c.num_attention_heads, c.num_key_value_heads
    dh = c.hidden_size // H
    theta = c.rope_parameters["rope_theta"] if theta is None else theta
    h = _rms(x, layer.input_layernorm.weight, c.rms_norm_eps)
    a = layer.self_attn
    q = (h @ a.q_proj.weight.T).view(-1, H, dh)
    k = (h @ a.k_proj.weight.T).view(-1, KV, dh)
    if rope:
        q, k = _rope(q, theta), _rope(k, theta)
    T = x.shape[0]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    out = []
    for head in range(H):
        s = q[:, head] @ k[:, kv_of_head(head)].T / math.sqrt(dh)  # [query_pos, key_pos]
        out.append(s.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32))
    return torch.stack(out).double()


def test_attention_and_mlp_equal_a_hand_computation_in_float64(llama64):
    """Every layer's eager pattern = softmax(RoPE(q) RoPE(k)^T / sqrt(d_head)) with query head h
    on key/value head h // (n_heads / n_kv_heads) (transformers' repeat_kv), <= 1e-6 (the
    float32 softmax); the other mapping (h % n_kv_heads), theta 5,000 or no rotation do not
    reproduce it (> 1e-3). RMSNorm and SwiGLU
    (down(silu(gate(x)) * up(x))) by hand equal the modules."""
    c = llama64.config
    group = c.num_attention_heads // c.num_key_value_heads
    ids = torch.tensor(RECORD["probes"]["previous_token_ids"][:48])[None]
    with torch.no_grad():
        out = llama64(input_ids=ids, output_attentions=True, output_hidden_states=True)
        for i, layer in enumerate(llama64.model.layers):
            x = out.hidden_states[i][0]
            got = out.attentions[i][0]
            kv = lambda h: h // group  # noqa: E731
            want = _pattern(layer, x, c, kv)
            assert (got - want).abs().max() < 1e-6, i
            # planted faults: the other kv-head mapping, another theta, no rotation
            for fault in (_pattern(layer, x, c, lambda h: h % c.num_key_value_heads),
                          _pattern(layer, x, c, kv, theta=5e3), _pattern(layer, x, c, kv, rope=False)):
                assert (got - fault).abs().max() > 1e-3, i
            m = layer.mlp
            hn = layer.post_attention_layernorm(x)
            assert (hn - _rms(x, layer.post_attention_layernorm.weight, c.rms_norm_eps)
                    ).abs().max() < 1e-12
            swiglu = (F.silu(hn @ m.gate_proj.weight.T) * (hn @ m.up_proj.weight.T)) @ \
                m.down_proj.weight.T
            assert (m(hn) - swiglu).abs().max() < 1e-12


def _prev_score(att):  # att [layer, head, query_pos, key_pos] -> [layer, head]
    T = att.shape[-1]
    q = torch.arange(1, T)
    return att[:, :, q, q - 1].mean(-1)


def _induction_score(att, seg):
    T = att.shape[-1]
    q = torch.arange(1 + seg, T)
    return att[:, :, q, q - seg + 1].mean(-1)


def test_training_record_scores_recomputed_from_the_checkpoint(llama):
    """The record's [layer][head] scores (rounded to 3 decimals) equal the checkpoint's:
    previous-token = mean weight on query_pos - 1 over the recorded held-out text, induction =
    mean weight on q - 25 + 1 over the repeats of the probe (BOS + 25 tokens of
    torch.Generator seed 0, 4 copies, regenerated here), and previous-token on the probe.
    The model has a clear previous-token head in layer 0 (on the random probe; on KJV prose
    it shares the mass with other positions) and clear induction heads in layer 1."""
    p = RECORD["probes"]
    seg = p["induction_segment"]
    assert seg == 25
    g = torch.Generator().manual_seed(0)
    body = torch.randint(0, 2048, (seg,), generator=g)  # BOS (id 0) in the body -> 0 anyway
    assert p["induction_ids"] == [0] + body.tolist() * 4
    with torch.no_grad():
        att = torch.stack(llama(input_ids=torch.tensor([p["previous_token_ids"]]),
                                output_attentions=True).attentions)[:, 0]
        prev = _prev_score(att)
        att = torch.stack(llama(input_ids=torch.tensor([p["induction_ids"]]),
                                output_attentions=True).attentions)[:, 0]
        ind = _induction_score(att, seg)
        prev_probe = _prev_score(att)
    assert len(p["previous_token_ids"]) == RECORD["args"]["text_len"] == 128
    for got, key in ((prev, "previous_token_score"), (ind, "induction_probe_score"),
                     (prev_probe, "previous_token_probe_score")):
        assert (got - torch.tensor(RECORD[key])).abs().max() <= 5.01e-4, key
    assert prev_probe[0].max() > 0.8 and ind[1].max() > 0.6, (prev_probe, ind)
    assert ind[0].max() < 0.05  # layer 0 cannot do induction alone
    # the record describes this checkpoint's recipe: the GPT-2's corpus, tokenizer, seed
    gpt2 = json.loads((BUNDLED_MODEL_DIR / "training_record.json").read_text())
    assert RECORD["data"] == gpt2["data"] and RECORD["seed"] == gpt2["seed"]
    assert RECORD["command"].startswith(".venv/bin/python training/train_bundled_llama.py")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (BUNDLED_LLAMA_DIR / name).read_bytes() == (BUNDLED_MODEL_DIR / name).read_bytes()


def test_revision_hash_is_stable(tmp_path):
    """The revision (sha256 over weights, config and tokenizer files) is the same for the
    directory and a copy, and the committed value; the training record does not enter it,
    one changed weight byte does."""
    from attnscope.service.runtime.loading import _weights_revision

    rev = _weights_revision(BUNDLED_LLAMA_DIR)
    assert rev.startswith("sha256:") and rev == _weights_revision(BUNDLED_LLAMA_DIR)
    assert rev == REVISION
    d = tmp_path / "copy"
    shutil.copytree(BUNDLED_LLAMA_DIR, d)
    assert _weights_revision(d) == rev
    (d / "training_record.json").write_text("{}")
    assert _weights_revision(d) == rev
    w = bytearray((d / "model.safetensors").read_bytes())
    w[-1] ^= 1
    (d / "model.safetensors").write_bytes(bytes(w))
    assert _weights_revision(d) != rev
    assert rev != _weights_revision(BUNDLED_MODEL_DIR)


def test_settings_bundled_llama_resolves_to_the_checkpoint():
    """``Settings(model="bundled-llama")`` (``--model bundled-llama``) names the checkpoint
    directory and its id; the loader reads that directory (its config is the Llama's)."""
    s = Settings(model="bundled-llama")
    path, model_id, recipe = BUNDLED[s.model]
    assert path == BUNDLED_LLAMA_DIR and model_id == BUNDLED_LLAMA_ID == "attnscope-tiny-llama"
    assert recipe == "training/train_bundled_llama.py"
    assert BUNDLED[BUNDLED_LLAMA_ID] == BUNDLED["bundled-llama"]
    assert BUNDLED["bundled"][0] == BUNDLED_MODEL_DIR  # the GPT-2 stays 'bundled'

    from attnscope.service.runtime.loading import _load_pretrained, _weights_revision

    model, tok, ident = _load_pretrained(s.model, s)
    assert ident == {"id": BUNDLED_LLAMA_ID, "revision": _weights_revision(BUNDLED_LLAMA_DIR)}
    assert model.config.model_type == "llama" and len(tok) == 2048


# ------------------------------------------------------------------ served end to end
@pytest.fixture(scope="module")
def llama_client():
    """The in-process app started on ``--model bundled-llama`` (its lifespan loads it)."""
    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app

    with TestClient(create_app(Settings(model="bundled-llama")),
                    raise_server_exceptions=False) as c:
        deadline = time.monotonic() + 300  # a safety net against a hang, not a figure
        while (r := c.get("/readyz")).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.05)  # the model loads after the app starts
        assert r.status_code == 200, r.text
        yield c


def test_served_model_is_the_bundled_llama(llama_client):
    from attnscope.service.runtime.loading import _weights_revision

    r = llama_client.get("/v1/model")
    assert r.status_code == 200, r.text
    m = r.json()
    assert m["id"] == BUNDLED_LLAMA_ID and m["requested"] == "bundled-llama"
    assert m["fallback"] is False and m["family"] == "llama"
    assert m["architecture"] == "LlamaForCausalLM"
    assert m["revision"] == _weights_revision(BUNDLED_LLAMA_DIR)
    assert (m["n_layers"], m["n_heads"], m["d_model"], m["vocab_size"]) == (2, 4, 128, 2048)


def _olsson_probe_score(att, start, seg, reps):
    """att [layer, head, query_pos, key_pos] on BOS + a segment of distinct tokens repeated:
    mean over the queries of repeats 2..reps of the mass on the tokens that followed the
    query's token in every earlier repeat -> [layer, head]."""
    vals = []
    for r in range(1, reps):
        for i in range(seg):
            q = start + r * seg + i
            keys = [start + e * seg + i + 1 for e in range(r)]
            vals.append(att[:, :, q, keys].sum(-1))
    return torch.stack(vals).mean(0)


def test_served_heads_find_the_induction_and_previous_token_heads(llama_client, llama):
    """/v1/heads on the bundled Llama: its probe labels the record's best layer-1 head
    'induction', with the probe scores an independent HF forward of the response's probe
    tokens gives (<= 1e-5); on the record's held-out text (its tokens, no BOS) every head's
    previous_s004 is the record's previous-token score; on the quick-start sentence the
    record's best layer-0 previous-token head is labelled 'previous_token'."""
    prev_rec = torch.tensor(RECORD["previous_token_score"])
    ind_rec = torch.tensor(RECORD["induction_probe_score"])
    ind_head = (1, int(ind_rec[1].argmax()))
    prev_head = (0, int(torch.tensor(RECORD["previous_token_probe_score"])[0].argmax()))
    ids = RECORD["probes"]["previous_token_ids"]
    r = llama_client.post("/v1/heads", json={"tokens": ids, "add_bos": False})
    assert r.status_code == 200, r.text
    body = r.json()
    heads = {(h["layer"], h["head"]): h for h in body["heads"]}
    assert len(heads) == 8
    h = heads[ind_head]
    assert h["label"] == "induction", h
    assert all(heads[(1, k)]["label"] == "induction" for k in range(4))  # README says so
    p = body["probe"]
    probe_ids = [t["id"] for t in p["tokens"]]
    with torch.no_grad():
        att = torch.stack(llama(input_ids=torch.tensor([probe_ids]),
                                output_attentions=True).attentions)[:, 0]
    want = _olsson_probe_score(att, p["start"], p["segment_length"], p["repeats"])
    got = torch.tensor([[heads[(l, k)]["scores"]["induction_probe"] for k in range(4)]
                        for l in range(2)])
    assert (got - want).abs().max() < 1e-5
    assert h["scores"]["induction_probe"] > 0.5
    got = torch.tensor([[heads[(l, k)]["scores"]["previous_s004"] for k in range(4)]
                        for l in range(2)])
    assert (got - prev_rec).abs().max() <= 5.01e-4

    r = llama_client.post("/v1/heads", json={"text": SENTENCE, "probe": {"enabled": False}})
    assert r.status_code == 200, r.text
    hp = {(h["layer"], h["head"]): h for h in r.json()["heads"]}[prev_head]
    assert hp["label"] == "previous_token" and hp["scores"]["previous_s004"] > 0.5, hp


def test_shipped_as_package_data_like_the_gpt2():
    """pyproject.toml lists the checkpoint as a package with all its files (so a wheel ships
    it, as the GPT-2's); the image COPYs service/ (tests/test_containers.py)."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    for pkg in ("attnscope.service.bundled_model", "attnscope.service.bundled_llama"):
        assert pkg in tool["packages"] and tool["package-data"][pkg] == ["*"], pkg
    assert BUNDLED_LLAMA_DIR == root / "service" / "bundled_llama"
