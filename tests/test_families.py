"""Llama, Mistral, Qwen2, Gemma, Gemma 2 and GPT-NeoX through the recorded forward (issue 28).

Random small checkpoints of every family (tests/families.py: GQA 4 query / 2 key-value heads,
partial rotary, sliding window 8, soft-capping, q/k/v biases) are served by the runtime and
compared with Hugging Face's own eager forward, run independently in the test: patterns,
hidden states, the final norm's output and the logits bit for bit in float32, alone and in a
padded batch; q and k after rotary (HF's own ``apply_rotary_pos_emb`` on HF's projections) and
k/v on the key/value heads; every analysis endpoint answers, and the grouped-query norms equal
a hand computation from HF hooks.
"""

from __future__ import annotations

import importlib
import math
import uuid

import numpy as np
import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM

from attnscope.schemas import ModelInfo
from attnscope.service.analysis import rollout as RO
from attnscope.service.analysis.verify_recorded import AttentionParams, verify
from attnscope.service.config import Settings
from attnscope.service.runtime import Runtime, inplace_attention

from conftest import _client
from families import FAMILIES, family_checkpoint

TEXT = ("The cat sat on the mat. The cat sat on the mat again, and the dog barked at the "
        "cat twice.")
WINDOWED = {"mistral": (8, 8), "gemma2": (8, None)}


@pytest.fixture(scope="session")
def family_root(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


_RUNTIMES: dict = {}


@pytest.fixture(scope="session")
def runtime_of(family_root):
    """``runtime_of(family, **settings)``: one Runtime per (family, settings), loaded once."""
    def get(family, **settings):
        key = (family, tuple(sorted(settings.items())))
        if key not in _RUNTIMES:
            path = family_checkpoint(family, family_root)
            _RUNTIMES[key] = Runtime.load(Settings(model=str(path), **settings))
        return _RUNTIMES[key]
    return get


_HF: dict = {}


def hf_model(family, root):
    """Hugging Face's own model of the checkpoint, loaded apart from the runtime's (eager)."""
    if family not in _HF:
        path = family_checkpoint(family, root)
        _HF[family] = AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="eager", dtype=torch.float32).eval()
        _HF[family].requires_grad_(False)
    return _HF[family]


def hf_forward(model, ids, **kw):
    with torch.no_grad():
        return model(input_ids=ids, output_attentions=True, output_hidden_states=True,
                     use_cache=False, **kw)


def final_logits(rt, state):
    """The LM head of the served model on the recorded final-norm output (with Gemma 2's final
    soft-cap, as its CausalLM forward applies it)."""
    with torch.no_grad():
        logits = rt.model.get_output_embeddings()(state)
    cap = getattr(rt.model.config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


@pytest.mark.parametrize("family", FAMILIES)
def test_patterns_hidden_states_and_logits_equal_hugging_face_bit_for_bit(
        family, runtime_of, family_root):
    rt = runtime_of(family)
    assert rt.inplace_attention
    # the hooked forward records (service/runtime/hooked_families.py, the path every causal
    # endpoint runs): Hugging Face's attention function is not called
    assert rt.hooked_parts() is not None
    calls = []
    mods = [h.attn for h in rt._handles]
    saved = [m._attnscope_eager for m in mods]
    for m, fn in zip(mods, saved):
        m._attnscope_eager = (lambda fn: lambda *a, **k: (calls.append(1), fn(*a, **k))[1])(fn)
    try:
        tt = rt.tokenize(f"{uuid.uuid4().hex[:6]} {TEXT}", add_bos=True)
        (fw,) = rt.forward_many([tt])
    finally:
        for m, fn in zip(mods, saved):
            m._attnscope_eager = fn
    assert not calls, "the family's eager function ran: the hooked forward did not record"
    out = hf_forward(hf_model(family, family_root), torch.tensor([tt.input_ids]))
    L = rt.adapter.n_layers
    assert torch.equal(fw.pattern, torch.stack(out.attentions)[:, 0])
    assert torch.equal(fw.hidden_states[:L], torch.stack(out.hidden_states[:L])[:, 0])
    assert torch.equal(fw.tensors.final_state, out.hidden_states[L][0])
    # state L is the last block's output: the final norm of it is HF's last entry
    with torch.no_grad():
        assert torch.equal(rt.adapter.final_norm()(fw.hidden_states[L]), out.hidden_states[L][0])
    assert torch.equal(final_logits(rt, fw.tensors.final_state), out.logits[0])
    if family in WINDOWED:  # the window is in the pattern: keys outside it get exactly 0
        for layer, w in enumerate(WINDOWED[family]):
            T = fw.n_tokens
            assert T > w if w else True
            outside = ~fw.mask(layer)
            assert torch.equal(fw.mask(layer), torch.ones(T, T, dtype=torch.bool).tril()
                               .triu(-(w - 1)) if w else torch.ones(T, T, dtype=torch.bool).tril())
            assert (fw.pattern[layer][:, outside] == 0).all()
            assert (fw.pattern[layer][:, fw.mask(layer)] > 0).all()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_low_precision_rotary_model_equals_hugging_face_bit_for_bit(family, family_root):
    """bfloat16: the rotary families' eager softmax is in float32 (the hooked forward's too,
    so its pattern is cast, not written by the softmax): still Hugging Face's numbers
    exactly."""
    path = family_checkpoint(family, family_root)
    rt = Runtime.load(Settings(model=str(path), dtype="bfloat16"))
    (fw,) = rt.forward_many([rt.tokenize(TEXT, add_bos=True)])
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                              dtype=torch.bfloat16).eval()
    out = hf_forward(hf, torch.tensor([fw.tokens.input_ids]))
    assert fw.pattern.dtype == torch.bfloat16
    assert torch.equal(fw.pattern, torch.stack(out.attentions)[:, 0])
    assert torch.equal(fw.tensors.final_state, out.hidden_states[-1][0])


def test_a_rotary_family_without_the_attention_function_is_a_startup_error(family_root):
    """Its q/k after rotary exist only in the attention function: no function, no start."""
    from transformers import AutoTokenizer

    from attnscope.service.runtime import ModelLoadError
    from attnscope.service.runtime.adapters import LlamaAdapter

    path = family_checkpoint("llama", family_root)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    with pytest.raises(ModelLoadError, match="llama: q/k after rotary"):
        Runtime(model, AutoTokenizer.from_pretrained(path), LlamaAdapter(model),
                {"id": "x", "revision": "x"}, Settings(model=str(path)))


def test_a_dropped_soft_cap_in_the_recorded_forward_is_caught(runtime_of, family_root,
                                                             monkeypatch):
    """Planted fault: the recorded forward (the hooked one) without Gemma 2's soft-cap
    differs from HF; restored, it equals HF again."""
    import dataclasses

    rt = runtime_of("gemma2")
    with monkeypatch.context() as mp:
        mp.setitem(rt.memo, "hooked_parts",
                   dataclasses.replace(rt.hooked_parts(), attn_softcap=None))
        tt = rt.tokenize(f"{uuid.uuid4().hex[:6]} {TEXT}", add_bos=True)
        (fw,) = rt.forward_many([tt])
    out = hf_forward(hf_model("gemma2", family_root), torch.tensor([tt.input_ids]))
    assert not torch.equal(fw.pattern, torch.stack(out.attentions)[:, 0])
    (again,) = rt.forward_many([rt.tokenize(f"{uuid.uuid4().hex[:6]} {TEXT}", add_bos=True)])
    ref = hf_forward(hf_model("gemma2", family_root), torch.tensor([again.tokens.input_ids]))
    assert torch.equal(again.pattern, torch.stack(ref.attentions)[:, 0])  # restored


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("side", ["right", "left"])
def test_a_batch_is_forwarded_per_length_and_equals_hugging_face_bit_for_bit(
        family, side, runtime_of, family_root):
    """A batch of texts of different lengths: the recorded forward runs each length apart,
    unpadded (texts of one length together), so whatever the padding side each text equals
    Hugging Face's own forward bit for bit (alone, or with the texts of its length as its
    batch) and the runtime's forward of it alone."""
    rb = runtime_of(family, forward_batch_size=4, padding_side=side)
    alone = runtime_of(family)
    tag = f"{family} {side}"  # texts of their own (deterministic: the figures reproduce)
    texts = [f"{tag} the cat", f"{tag} {TEXT}", f"{tag} the dog barked at the cat again."]
    items = [rb.tokenize(t, add_bos=True) for t in texts]
    twin = list(items[1].input_ids)  # another text of text 1's length: batched with it
    twin[2] = (twin[2] + 1) % min(len(rb.tokenizer), rb.info["vocab_size"])
    items.append(rb.tokenized_from_ids(twin))
    n0 = rb.forward_count
    got = rb.forward_many(items)
    assert rb.forward_count == n0 + 3  # three lengths
    L = rb.adapter.n_layers
    model = hf_model(family, family_root)
    pair = hf_forward(model, torch.tensor([items[1].input_ids, items[3].input_ids]))
    for b, (it, fw) in enumerate(zip(items, got)):
        if b in (1, 3):  # HF's batch of the two (equal lengths, no padding)
            out, row = pair, (0 if b == 1 else 1)
        else:
            out, row = hf_forward(model, torch.tensor([it.input_ids])), 0
        assert torch.equal(fw.pattern, torch.stack(out.attentions)[:, row]), (family, side, b)
        hs = torch.stack(out.hidden_states)[:, row]
        assert torch.equal(fw.hidden_states[:L], hs[:L])
        assert torch.equal(fw.tensors.final_state, hs[L])
        ref = alone.forward_many([alone.tokenized_from_ids(list(it.input_ids))])[0].tensors
        for name in ("pattern", "hidden_states", "q", "k", "v", "attn_input", "attn_output"):
            a, r = getattr(fw.tensors, name), getattr(ref, name)
            assert a.shape == r.shape, name
            if b in (0, 2):  # alone in its group: the same forward
                assert torch.equal(a, r), name
            else:  # a batch of two: another matmul blocking may round apart
                scale = max(1.0, float(r.abs().max()))
                assert float((a - r).abs().max()) <= 2e-5 * scale, (name, scale)


def _hf_rotated_qkv(family, root, ids):
    """q ``[layer, head, pos, d_head]``, k, v ``[layer, kv_head, pos, d_head]`` from HF's own
    projections (forward hooks) rotated by HF's own ``apply_rotary_pos_emb`` and rotary
    embedding, and the attention input and output-projection output ``[layer, pos, d_model]``:
    independent of the runtime's recording."""
    model = hf_model(family, root)
    base = model.base_model
    mod = importlib.import_module(type(model).__module__)
    seen, hooks = {}, []
    for i, blk in enumerate(base.layers):
        attn = getattr(blk, "self_attn", None) or blk.attention
        names = ("q_proj", "k_proj", "v_proj") if hasattr(attn, "q_proj") else ("query_key_value",)
        for n in names + (("o_proj",) if hasattr(attn, "o_proj") else ("dense",)):
            hooks.append(getattr(attn, n).register_forward_hook(
                lambda m, a, o, i=i, n=n: seen.__setitem__((i, n), o.detach())))
        hooks.append(attn.register_forward_pre_hook(  # the attention input (the norm's output)
            lambda m, a, kw, i=i: seen.__setitem__((i, "in"), (a[0] if a else kw["hidden_states"])
                                                   .detach()), with_kwargs=True))
    try:
        hf_forward(model, ids)
    finally:
        for h in hooks:
            h.remove()
    cfg = model.config
    H = cfg.num_attention_heads
    dh = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    T = ids.shape[1]
    x = torch.zeros(1, T, cfg.hidden_size)
    cos, sin = base.rotary_emb(x, torch.arange(T)[None])
    qs, ks, vs = [], [], []
    for i in range(cfg.num_hidden_layers):
        if (i, "query_key_value") in seen:  # GPT-NeoX: per head [q | k | v]
            qkv = seen[(i, "query_key_value")].view(1, T, H, 3 * dh).transpose(1, 2)
            q, k, v = qkv.chunk(3, dim=-1)
        else:
            q, k, v = (seen[(i, n)].view(1, T, -1, dh).transpose(1, 2)
                       for n in ("q_proj", "k_proj", "v_proj"))
        q, k = mod.apply_rotary_pos_emb(q, k, cos, sin)
        qs.append(q[0]), ks.append(k[0]), vs.append(v[0])
    ins = torch.stack([seen[(i, "in")][0] for i in range(cfg.num_hidden_layers)])
    outs = torch.stack([seen.get((i, "o_proj"), seen.get((i, "dense")))[0]
                        for i in range(cfg.num_hidden_layers)])
    return torch.stack(qs), torch.stack(ks), torch.stack(vs), ins, outs


@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_q_k_are_after_rotary_and_k_v_on_the_key_value_heads(
        family, runtime_of, family_root):
    rt = runtime_of(family)
    (fw,) = rt.forward_many([rt.tokenize(TEXT, add_bos=True)])
    q, k, v, ins, outs = _hf_rotated_qkv(family, family_root, torch.tensor([fw.tokens.input_ids]))
    assert torch.equal(fw.tensors.attn_input, ins) and torch.equal(fw.tensors.attn_output, outs)
    a = rt.adapter
    assert fw.tensors.q.shape == (a.n_layers, a.n_heads, fw.n_tokens, a.d_head)
    assert fw.tensors.k.shape == fw.tensors.v.shape == (a.n_layers, a.n_kv_heads, fw.n_tokens,
                                                        a.d_head)
    assert torch.equal(fw.tensors.q, q) and torch.equal(fw.tensors.k, k)
    assert torch.equal(fw.tensors.v, v)
    # q.k^T * scaling (soft-capped, masked) reproduces the pattern
    assert torch.equal(fw.scores().softmax(-1), fw.pattern)
    if a.n_kv_heads != a.n_heads:  # planted fault: query head h on kv head h % n_kv, not h // G
        wrong = fw.tensors.k[0].repeat(a.n_heads // a.n_kv_heads, 1, 1)
        s = torch.matmul(fw.tensors.q[0], wrong.transpose(-1, -2)) * fw.scaling[0]
        cap = fw.softcaps[0]
        s = torch.tanh(s / cap) * cap if cap else s
        s = s.masked_fill(~fw.mask(0), float("-inf"))
        assert (s.softmax(-1) - fw.pattern[0]).abs().max() > 1e-2
        assert [a.kv_head(h) for h in range(a.n_heads)] == [0, 0, 1, 1]


@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_verification_passes_and_catches_planted_faults(family, runtime_of):
    rt = runtime_of(family)
    (fw,) = rt.forward_many([rt.tokenize(TEXT, add_bos=True)])
    a = rt.adapter
    params = {lyr: AttentionParams.of(a, lyr) for lyr in range(a.n_layers)}
    res = verify(fw.tensors, params, projections=True)
    assert res["passed"] and res["max_abs_diff"] == 0.0, res["message"]

    def fails(layer=0, **change):
        p = {lyr: AttentionParams(**{**vars(params[lyr]), **(change if lyr == layer else {})})
             for lyr in params}
        return not verify(fw.tensors, p, projections=True)["passed"]

    rot = params[0].rotary
    assert fails(rotary={**rot, "inv_freq": rot["inv_freq"] * 1.5})  # wrong theta
    if family in WINDOWED:  # window off by one
        assert fails(window=WINDOWED[family][0] - 1)
        assert fails(window=WINDOWED[family][0] + 1)
    if params[0].softcap is not None:  # missing soft-cap
        assert fails(softcap=None)
    if a.n_kv_heads != a.n_heads:  # wrong kv-head mapping: the recorded k/v of other heads
        t = fw.tensors.replace(k=fw.tensors.k.flip(1), v=fw.tensors.v.flip(1))
        assert not verify(t, params)["passed"]


@pytest.fixture(scope="session")
def family_client(runtime_of):
    opened = {}

    def get(family):
        if family not in opened:
            c = _client(runtime_of(family))
            c.__enter__()
            opened[family] = c
        return opened[family]
    yield get
    for c in opened.values():
        c.__exit__(None, None, None)


EXPECTED = {  # (n_kv_heads, rotary_dim, theta, windows, softcap, final cap, norm, parallel, bias)
    "llama": (2, 16, 1e4, None, None, None, "rmsnorm", False, False),
    "mistral": (2, 16, 1e4, [8, 8], None, None, "rmsnorm", False, False),
    "qwen2": (2, 16, 1e6, None, None, None, "rmsnorm", False, True),
    "gemma": (2, 16, 1e4, None, None, None, "rmsnorm_1p", False, False),
    "gemma2": (2, 16, 1e4, [8, None], 50.0, 30.0, "rmsnorm_1p", False, False),
    "gpt_neox": (4, 4, 1e4, None, None, None, "layernorm", True, True),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_model_info_reports_the_attention_facts(family, family_client):
    info = ModelInfo.model_validate(family_client(family).get("/v1/model").json())
    assert info.family == family and info.causal and info.n_heads == 4 and info.d_head == 16
    kv, rdim, theta, wins, cap, fcap, norm, par, bias = EXPECTED[family]
    f = info.attention
    assert info.n_kv_heads == f.n_kv_heads == kv
    assert f.kv_head_of_query_head == [h // (4 // kv) for h in range(4)]
    assert f.positions == "rotary" and f.rotary_dim == rdim and f.rotary_fraction == rdim / 16
    assert f.rope_theta == theta and f.rope_scaling is None
    assert f.sliding_window_layers == wins
    assert f.sliding_window == (max(w for w in wins if w) if wins else None)
    assert (f.attn_logit_softcap, f.final_logit_softcap) == (cap, fcap)
    assert (f.norm, f.parallel_residual, f.qkv_bias) == (norm, par, bias)
    assert f.scaling == [0.25, 0.25]


def test_model_info_of_gpt2_says_learned_positions(client):
    f = ModelInfo.model_validate(client.get("/v1/model").json()).attention
    assert f.positions == "learned_absolute" and f.rotary_dim is None
    assert f.n_kv_heads == len(f.kv_head_of_query_head) and f.sliding_window is None


def decode(t):
    return np.array(t, dtype=np.float64)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_analysis_endpoint_runs(family, family_client, runtime_of):
    c = family_client(family)
    rt = runtime_of(family)
    fw = rt.forward_many([rt.tokenize(TEXT, add_bos=True)])[0]
    T = fw.n_tokens
    r = c.post("/v1/tokenize", json={"text": TEXT})
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()["tokens"]["tokens"]] == list(fw.tokens.input_ids)
    r = c.post("/v1/attention", json={"text": TEXT, "include_scores": True})
    assert r.status_code == 200, r.text
    got = decode(r.json()["attention"]["pattern"])
    assert np.array_equal(got.astype(np.float32), fw.pattern.numpy())  # float32 round trip
    sc = decode(r.json()["attention"]["scores"])
    vis = np.isfinite(sc)
    assert np.array_equal(vis, np.stack([fw.mask(lyr).numpy() for lyr in range(2)])[:, None]
                          .repeat(4, 1))
    r = c.post("/v1/heads", json={"text": TEXT, "norm_scores": True})
    assert r.status_code == 200, r.text
    assert r.json()["sink_is_bos"] == [True] and len(r.json()["heads"]) == 8
    assert all(math.isfinite(h["norm_scores"]["noop"]) for h in r.json()["heads"])
    from attnscope.service.analysis import heads as H

    want = H.head_scores(fw.pattern, fw.tokens.input_ids, True, windows=rt.windows)
    for h in r.json()["heads"]:  # the window reaches the entropy normaliser
        assert math.isclose(h["scores"]["entropy_normalized"],
                            float(want["entropy_normalized"][h["layer"], h["head"]]),
                            rel_tol=1e-9, abs_tol=1e-12)
    r = c.post("/v1/heads", json={"text": TEXT, "add_bos": False, "probe": {"enabled": False}})
    assert r.status_code == 200 and r.json()["sink_is_bos"] == [False], r.text
    r = c.post("/v1/links", json={"text": TEXT, "layer": 1, "by": "norm"})
    assert r.status_code == 200, r.text
    r = c.post("/v1/trajectories", json={"text": TEXT, "include_final": True, "n_components": 3})
    assert r.status_code == 200, r.text
    r = c.post("/v1/attention-norms", json={"text": TEXT})
    assert r.status_code == 200, r.text
    kvmap = r.json()["kv_head_of_query_head"]
    assert kvmap == (None if rt.adapter.n_kv_heads == 4 else [0, 0, 1, 1])
    r = c.post("/v1/rollout", json={"text": TEXT, "discard": 0.2})
    assert r.status_code == 200, r.text
    wins = WINDOWED.get(family)
    assert r.json()["sliding_windows"] == (None if wins is None else list(wins))
    roll = decode(r.json()["rollout"]["rollout"])
    want = RO.rollout(RO.augmented_matrices(fw.pattern, True, discard=0.2, windows=wins))
    assert np.allclose(roll, want.numpy(), atol=1e-6) and roll.shape == (2, T, T)
    if wins is not None:  # the window changes what discard drops
        plain = RO.rollout(RO.augmented_matrices(fw.pattern, True, discard=0.2))
        assert not np.allclose(roll, plain.numpy(), atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_neox"])
def test_norms_equal_a_hand_computation_from_hugging_face_hooks(
        family, family_client, family_root):
    """Kobayashi et al. 2020's ||alpha f(x)|| with f_h(x) = (x W_V^g + b_V^g) W_O^h, g = h // G:
    HF's own value projection (a forward hook), HF's attentions and o_proj's weight."""
    c = family_client(family)
    body = c.post("/v1/attention-norms", json={"text": TEXT}).json()
    ids = torch.tensor([[t["id"] for t in body["norms"]["tokens"]]])
    model = hf_model(family, family_root)
    base = model.base_model
    seen, hooks = {}, []
    for i, blk in enumerate(base.layers):
        attn = getattr(blk, "self_attn", None) or blk.attention
        m = getattr(attn, "v_proj", None) or attn.query_key_value
        hooks.append(m.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o[0])))
    try:
        out = hf_forward(model, ids)
    finally:
        for h in hooks:
            h.remove()
    cfg = model.config
    H, T = cfg.num_attention_heads, ids.shape[1]
    dh = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    KV = getattr(cfg, "num_key_value_heads", None) or H
    got = decode(body["norms"]["norms"])  # [layer, head, query, key]
    summed = decode(body["norms"]["summed"])
    for layer, blk in enumerate(base.layers):
        attn = getattr(blk, "self_attn", None) or blk.attention
        if hasattr(attn, "o_proj"):
            v = seen[layer].view(T, KV, dh).double()
            W_o = attn.o_proj.weight.double()  # [d_model, H * dh]
        else:  # GPT-NeoX: per head [q | k | v]
            v = seen[layer].view(T, H, 3 * dh)[..., 2 * dh:].double()
            W_o = attn.dense.weight.double()
        A = out.attentions[layer][0].double()  # [head, query, key]
        want = torch.empty(H, T, T, dtype=torch.float64)
        total = torch.zeros(T, T, W_o.shape[0], dtype=torch.float64)
        for h in range(H):
            g = h // (H // KV)
            f = v[:, g] @ W_o[:, h * dh:(h + 1) * dh].t()  # [key, d_model]
            want[h] = A[h] * f.norm(dim=-1)[None]
            total += A[h][..., None] * f[None]
        assert np.allclose(got[layer], want.numpy(), rtol=1e-4, atol=1e-5), layer
        assert np.allclose(summed[layer], total.norm(dim=-1).numpy(), rtol=1e-4, atol=1e-5)
        if KV != H:  # planted fault: query head h on kv head h % KV differs
            f_wrong = v[:, 1 % KV] @ W_o[:, dh:2 * dh].t()
            assert not np.allclose(got[layer][1], (A[1] * f_wrong.norm(dim=-1)[None]).numpy(),
                                   rtol=1e-3, atol=1e-4)


def test_entropy_normalized_counts_the_keys_inside_a_sliding_window():
    """Hand-built: uniform attention over a window of 3 (a Mistral-like layer) has normalised
    entropy exactly 1 with the window, below 1 when normalised by all q + 1 earlier keys."""
    from attnscope.service.analysis import heads as H

    T, w = 7, 3
    vis = torch.ones(T, T, dtype=torch.bool).tril().triu(-(w - 1))
    A = vis.float() / vis.float().sum(-1, keepdim=True)
    P = torch.stack([A, torch.ones(T, T).tril() / torch.arange(1, T + 1)[:, None]])[:, None]
    ids = list(range(T))
    got = H.head_scores(P, ids, True, windows=[w, None])["entropy_normalized"]
    assert torch.allclose(got, torch.ones(2, 1, dtype=torch.float64), atol=1e-6)  # float32 A
    plain = H.head_scores(P, ids, True)["entropy_normalized"]
    assert plain[0, 0] < 0.95 and abs(float(plain[1, 0]) - 1) < 1e-6
    with pytest.raises(ValueError, match="one entry per layer"):
        H.head_scores(P, ids, True, windows=[w])


def test_rollout_discard_counts_only_keys_inside_a_sliding_window():
    """Hand-built: 1 layer, 1 head, T = 4, window 2: the pattern is 0 outside the window, so
    the candidates are the 4 + 3 = 7 entries inside it; discard 0.3 zeroes floor(2.1) = 2 of
    them (the smallest), not 3 of the 10 causal entries of which 3 are already 0."""
    A = torch.tensor([[1.0, 0, 0, 0], [0.3, 0.7, 0, 0], [0, 0.45, 0.55, 0], [0, 0, 0.2, 0.8]])
    P = A[None, None]
    win = RO.augmented_matrices(P, True, residual=0.0, discard=0.3, windows=[2])
    full = RO.augmented_matrices(P, True, residual=0.0, discard=0.3)
    # window: the two smallest candidates inside it, 0.2 (3, 2) and 0.3 (1, 0), are zeroed
    keep = A.clone()
    keep[3, 2] = keep[1, 0] = 0
    assert torch.allclose(win[0], (keep / keep.sum(-1, keepdim=True)).double())
    # without it, 3 of the 10 causal entries go, all of them 0s already: nothing changes
    assert torch.allclose(full[0], A.double())
    with pytest.raises(ValueError, match="one entry per layer"):
        RO.augmented_matrices(P, True, windows=[2, 2])
    assert math.isclose(float(win[0].sum()), 4.0)


def _sentencepiece_tokenizer():
    """A SentencePiece-style fast tokenizer as Llama 2 / Mistral ship it: '▁' for a space
    (normalizer Prepend + Replace), BPE with byte fallback (<0xNN> tokens), decoder Replace +
    ByteFallback + Fuse + Strip."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["\u2581", *"abcdefghijklmnopqrstuvwxyzHW", "ll", "\u2581w", "\u2581wo"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("l", "l"), ("\u2581", "w"), ("\u2581w", "o")]
    tk = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                              fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                          normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def test_sentencepiece_tokens_are_labelled_by_their_text_and_bytes(family_root):
    """Llama 2 / Mistral / Gemma tokenizers spell a space '▁' and fall back to <0xNN> bytes:
    labels and bytes are the text (' world', the two bytes of 'ö', each partial), as byte-level
    pieces are for GPT-2; the ids and the forward are the tokenizer's own."""
    path = family_checkpoint("llama", family_root / "sentencepiece")
    tok = _sentencepiece_tokenizer()
    tok.save_pretrained(path)
    rt = Runtime.load(Settings(model=str(path)))
    assert rt.piece_style == "sentencepiece"
    text = "Hello w\u00f6rld\nall"
    tt = rt.tokenize(text, add_bos=True)
    assert list(tt.input_ids) == [1, *tok(text, add_special_tokens=False)["input_ids"]]
    toks = tt.tokens
    assert toks[0].special and toks[0].label == "<s>"
    # the normalizer's leading '▁' is a space the text does not have; the rest is the text
    assert b"".join(t.raw for t in toks[1:]) == b" " + text.encode("utf-8")
    o = [t for t in toks if t.raw in (b"\xc3", b"\xb6")]
    assert [t.label for t in o] == ["\\xc3", "\\xb6"] and all(t.partial for t in o)
    assert [t.label for t in toks if t.raw == b"\n"] == ["\\n"]
    assert " w" in [t.label for t in toks] and not any("\u2581" in t.label for t in toks)
    assert rt.token_refs([vocab_id := tok.convert_tokens_to_ids("\u2581wo")])[0]["bytes"] == \
        b" wo".hex() and vocab_id > 258
    # bytelevel stays bytelevel: the bundled GPT-2 tokenizer of the other checkpoints
    assert Runtime.load(Settings(model=str(family_checkpoint("llama", family_root)))) \
        .piece_style == "bytelevel"


def test_llama3_rope_scaling_is_reported_and_served_exactly(family_root):
    """A Llama 3 rope (rope_type 'llama3', theta 5e5, factor 8): GET /v1/model's rope_theta and
    rope_scaling are the config's; patterns equal HF's bit for bit; the recorded verification
    (projections rotated by the model's own scaled inv_freq) matches exactly."""
    import shutil

    from attnscope.service.config import BUNDLED_MODEL_DIR
    from families import family_config

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    path = family_root / "llama3-rope"
    if not (path / "model.safetensors").exists():
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(family_config("llama", rope_parameters=rope),
                                             attn_implementation="eager")
        m.save_pretrained(path)
        for n in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(BUNDLED_MODEL_DIR / n, path / n)
    rt = Runtime.load(Settings(model=str(path)))
    facts = rt.info["attention"]
    assert facts["rope_theta"] == 500000.0
    assert facts["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    (fw,) = rt.forward_many([rt.tokenize(TEXT, add_bos=True)])
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    out = hf_forward(hf, torch.tensor([fw.tokens.input_ids]))
    assert torch.equal(fw.pattern, torch.stack(out.attentions)[:, 0])
    params = {lyr: AttentionParams.of(rt.adapter, lyr) for lyr in range(2)}
    assert verify(fw.tensors, params, projections=True)["max_abs_diff"] == 0.0


def test_bundled_llama_is_served_bit_for_bit():
    """``--model bundled-llama`` (RoPE, GQA 4/2, RMSNorm, SwiGLU): patterns and the final
    norm's output equal HF eager's; GET /v1/model's facts say so."""
    from attnscope.service.config import BUNDLED

    rt = Runtime.load(Settings(model="bundled-llama"))
    f = rt.info["attention"]
    assert rt.info["family"] == "llama" and f["positions"] == "rotary"
    assert f["n_kv_heads"] < rt.adapter.n_heads and f["norm"] == "rmsnorm"
    (fw,) = rt.forward_many([rt.tokenize("In the beginning God created the heaven and the "
                                         "earth.", add_bos=True)])
    hf = AutoModelForCausalLM.from_pretrained(BUNDLED["bundled-llama"][0],
                                              attn_implementation="eager").eval()
    out = hf_forward(hf, torch.tensor([fw.tokens.input_ids]))
    assert torch.equal(fw.pattern, torch.stack(out.attentions)[:, 0])
    assert torch.equal(fw.tensors.final_state, out.hidden_states[-1][0])
    assert torch.equal(fw.scores().softmax(-1), fw.pattern)
