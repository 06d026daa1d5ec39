"""Runtime on real checkpoints, cross-checked against Hugging Face's own output_attentions."""

from __future__ import annotations

import threading
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from attnscope.service.config import Settings
from attnscope.service.errors import ContextLengthExceeded, InvalidRequest
from attnscope.service.runtime import ModelLoadError, Runtime

from conftest import SENTENCE, minilm_dir
from recorded_reference import hf_reference as hf_reference_with_qkv, words

TEXTS = [
    SENTENCE,
    "Short.",
    "A considerably longer text, so that the batch needs padding: and the earth was without form.",
    "Hello",
]


def hf_reference(path, causal: bool, text: str):
    tok = AutoTokenizer.from_pretrained(path)
    cls = AutoModelForCausalLM if causal else AutoModel
    model = cls.from_pretrained(path, attn_implementation="eager").eval()
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        out = model(**enc, output_attentions=True, output_hidden_states=True)
    return enc["input_ids"][0].tolist(), torch.stack(out.attentions)[:, 0], torch.stack(out.hidden_states)[:, 0]


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_attention_and_hidden_states_equal_huggingface(family, gpt2_runtime, bert_runtime, bundled_dir, minilm_path):
    rt, path = (gpt2_runtime, bundled_dir) if family == "gpt2" else (bert_runtime, minilm_path)
    ids, ref_att, ref_hid = hf_reference(path, rt.adapter.causal, SENTENCE)
    (fw,) = rt.forward_many([rt.tokenize(SENTENCE)])
    assert list(fw.tokens.input_ids) == ids
    assert fw.pattern.shape == (rt.adapter.n_layers, rt.adapter.n_heads, len(ids), len(ids))
    assert (fw.pattern - ref_att).abs().max().item() <= 1e-6
    L = rt.adapter.n_layers
    assert fw.hidden_states.shape == (L + 1, len(ids), rt.adapter.d_model)
    # the residual-stream states: HF's entries 0..L-1; HF's last entry is the final state
    assert (fw.hidden_states[:L] - ref_hid[:L]).abs().max().item() <= 1e-6
    assert (fw.tensors.final_hidden_state - ref_hid[L]).abs().max().item() <= 1e-6
    if family == "gpt2":  # state L is the last block's output BEFORE ln_f; ln_f of it is HF's last
        with torch.no_grad():
            assert (rt.adapter.base().ln_f(fw.hidden_states[L]) - ref_hid[L]).abs().max().item() <= 1e-6
    else:  # no final LayerNorm: the last state is HF's last entry
        assert fw.tensors.final_state is None
        assert (fw.hidden_states[L] - ref_hid[L]).abs().max().item() <= 1e-6


@pytest.mark.parametrize("family", ["gpt2", "bert"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_batch_equals_alone(family, side, gpt2_runtime, bert_runtime):
    rt = gpt2_runtime if family == "gpt2" else bert_runtime
    items = [rt.tokenize(t) for t in TEXTS]
    assert len({len(i) for i in items}) > 2  # lengths differ: padding happens
    rt.cache.clear()
    alone = [rt.forward_many([it])[0] for it in items]
    rt.cache.clear()
    old = rt.settings.padding_side, rt.settings.forward_batch_size
    rt.settings.padding_side, rt.settings.forward_batch_size = side, 16
    try:
        batch = rt.forward_many(items)
    finally:
        rt.settings.padding_side, rt.settings.forward_batch_size = old
        rt.cache.clear()
    for a, b in zip(alone, batch):
        assert not b.cached
        assert a.pattern.shape == b.pattern.shape
        for name in ("pattern", "hidden_states", "q", "k", "v", "attn_input", "attn_output",
                     "final_hidden_state"):
            x, y = getattr(a.tensors, name), getattr(b.tensors, name)
            # 1e-5, plus float32 rounding that grows with the value: a padded batch takes other
            # matmul blocking, and residual-stream entries of ~30 differ by up to ~7 ulps
            # (1.2e-5) on AMD EPYC; 1e-6 relative is ~8 ulps
            assert ((x - y).abs() <= 1e-5 + 1e-6 * y.abs()).all(), (
                name, (x - y).abs().max().item())


def test_scores_softmax_gives_pattern_and_mask_is_explicit(gpt2_runtime, bert_runtime):
    for rt in (gpt2_runtime, bert_runtime):
        (fw,) = rt.forward_many([rt.tokenize(SENTENCE)])
        s = fw.scores()
        assert (s.softmax(-1) - fw.pattern).abs().max().item() <= 1e-6
        T = fw.n_tokens
        upper = torch.ones(T, T, dtype=torch.bool).triu(1)
        if rt.adapter.causal:
            assert torch.isneginf(s[..., upper]).all()
            assert torch.isfinite(s[..., ~upper]).all()
        else:
            assert torch.isfinite(s).all()


def test_qkv_are_the_models_own(gpt2_runtime):
    """q/k/v recorded from c_attn: recomputing the layer-0 pattern from them matches."""
    rt = gpt2_runtime
    (fw,) = rt.forward_many([rt.tokenize(SENTENCE)])
    attn = rt.model.transformer.h[0].attn
    x = fw.tensors.attn_input[0]
    # Conv1D: y = x @ W + b, W stored [d_model, 3*d_model]
    qkv = x @ attn.c_attn.weight + attn.c_attn.bias
    q = qkv[:, : rt.adapter.d_model].reshape(-1, rt.adapter.n_heads, rt.adapter.d_head).transpose(0, 1)
    assert (q - fw.tensors.q[0]).abs().max().item() <= 1e-5


def test_special_token_text_stays_text(gpt2_runtime, bert_runtime):
    tt = gpt2_runtime.tokenize("a <|endoftext|> b")
    eot = gpt2_runtime.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert eot not in tt.input_ids
    assert not any(t.special for t in tt.tokens)
    tb = bert_runtime.tokenize("hello [SEP] world")
    assert tb.input_ids.count(bert_runtime.tokenizer.sep_token_id) == 1  # only the framing
    assert tb.tokens[0].label == "[CLS]" and tb.tokens[0].special and tb.tokens[0].start is None
    assert tb.tokens[-1].label == "[SEP]" and tb.tokens[-1].special


def test_labels_and_offsets(gpt2_runtime):
    text = "Then I tried café naïve 😀 ok"
    tt = gpt2_runtime.tokenize(text)
    for t in tt.tokens:
        assert "Ġ" not in t.label and "Ã" not in t.label
        assert text[t.start : t.end] != "" or t.start == t.end
    # full characters reassemble: the labels of complete tokens are exactly their text
    whole = [t for t in tt.tokens if "\\x" not in t.label]
    assert all(text[t.start : t.end] == t.label for t in whole)
    # the emoji is split across byte tokens and shown honestly as escapes
    split = [t for t in tt.tokens if "\\x" in t.label]
    assert split, "expected the emoji to be split across byte-level tokens"
    raw = b"".join(bytes(int(h, 16) for h in t.label.split("\\x")[1:]) for t in split if t.label.startswith("\\x"))
    assert "😀".encode() in raw or len(raw) > 0


def test_add_bos(gpt2_runtime, bert_runtime):
    plain = gpt2_runtime.tokenize("Hello there")
    bos = gpt2_runtime.tokenize("Hello there", add_bos=True)
    assert bos.input_ids[0] == gpt2_runtime.tokenizer.bos_token_id
    assert bos.input_ids[1:] == plain.input_ids
    assert bos.tokens[0].special and bos.tokens[0].start is None and bos.tokens[1].position == 1
    with pytest.raises(InvalidRequest):
        bert_runtime.tokenize("Hello", add_bos=True)


def test_context_limit_names_limit_and_count(gpt2_runtime):
    n_ctx = gpt2_runtime.adapter.n_ctx
    with pytest.raises(ContextLengthExceeded) as e:
        gpt2_runtime.tokenize("word " * (n_ctx + 10))
    assert str(n_ctx) in e.value.message and "tokens" in e.value.message


def test_tokenize_cache_returns_the_same_tokens_and_still_checks(gpt2_runtime):
    """Several analyses of one text tokenize it once: a repeat is the cached object, equal to a
    fresh tokenizer pass; add_bos is part of the key; refused texts are never cached."""
    from attnscope.service.runtime import model as M

    rt = gpt2_runtime
    text = "tokenize me once, analyse me five times"
    a = rt.tokenize(text)
    assert rt.tokenize(text) is a
    assert a == rt._tokenize(text, False, "text")
    bos = rt.tokenize(text, add_bos=True)
    assert bos is not a and bos.input_ids[1:] == a.input_ids
    long = "word " * (rt.adapter.n_ctx + 10)
    for _ in range(2):
        with pytest.raises(ContextLengthExceeded):
            rt.tokenize(long, param="texts.3")
    assert (long, False) not in rt._tok_cache
    for i in range(M.TOKENIZE_CACHE_ENTRIES + 5):
        rt.tokenize(f"text number {i}")
    assert len(rt._tok_cache) == M.TOKENIZE_CACHE_ENTRIES and (text, False) not in rt._tok_cache


def test_cache_hit_and_byte_bound(gpt2_runtime):
    rt = gpt2_runtime
    rt.cache.clear()
    it = rt.tokenize("cache me if you can")
    n0 = rt.forward_count
    a = rt.forward_many([it])[0]
    b = rt.forward_many([it])[0]
    assert rt.forward_count == n0 + 1 and b.cached and b.tensors is a.tensors
    assert rt.cache.nbytes == a.tensors.nbytes
    assert not a.pattern.requires_grad


def test_default_gpt2_falls_back_to_bundled_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rt = Runtime.load(Settings(model="gpt2"))
    assert rt.info["fallback"] is True and rt.info["id"] == "attnscope-tiny-gpt2"
    assert rt.info["fallback_reason"]
    with pytest.raises(ModelLoadError):
        Runtime.load(Settings(model="gpt2", strict_model=True))


def test_bad_model_dir_is_a_clear_startup_error(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        Runtime.load(Settings(model=str(tmp_path)))
    assert "could not load model" in str(e.value)
    # a path that is not there (or a file) is said as such, not as a hub id left uncached
    (tmp_path / "weights.bin").write_bytes(b"x")
    for name, why in ((str(tmp_path / "no" / "such"), "no such directory"),
                      ("./no-such-checkpoint", "no such directory"),
                      (str(tmp_path / "weights.bin"), "a file, not a checkpoint directory")):
        with pytest.raises(ModelLoadError) as e:
            Runtime.load(Settings(model=name, strict_model=True))
        assert why in str(e.value) and "hub" not in str(e.value), str(e.value)


def test_serve_names_the_flag_of_a_bad_setting(capsys):
    from attnscope.service import cli

    assert cli.main(["serve", "--port", "abc", "--max-batch", "0"]) == 2
    err = capsys.readouterr().err
    assert "attnscope serve: --port (env ATTNSCOPE_PORT): " in err and "(got 'abc')" in err
    assert "--max-batch (env ATTNSCOPE_MAX_BATCH): " in err
    assert "pydantic" not in err and "validation error for" not in err


def test_probe_rejects_non_eager_attention(bundled_dir):
    """A model whose attention does not return weights fails the start-up probe."""
    model = AutoModelForCausalLM.from_pretrained(bundled_dir, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(bundled_dir)
    from attnscope.service.runtime.adapters import GPT2Adapter

    ad = GPT2Adapter(model)
    rt = Runtime(model, tok, ad, {"id": "x", "revision": "x"}, Settings(model="bundled"))
    with pytest.raises(ModelLoadError) as e:
        rt.probe()
    assert "attention layers" in str(e.value)


# ------------------------------------------------------------------ recorded tensors, concurrency
@pytest.mark.regression
def test_recorded_tensors_read_concurrently_are_one_object_and_equal_a_batch_copy(gpt2_runtime):
    text = f"A fresh text for the lazy stacking race {threading.get_ident()} zebra quartz."
    ref = gpt2_runtime.forward_many([gpt2_runtime.tokenize(text), gpt2_runtime.tokenize("ab")])
    ref = ref[0].tensors  # a batch of 2: its rows are copies (clone), stacked serially below
    serial = {n: getattr(ref, n).clone() for n in ref._NAMES}
    gpt2_runtime.cache.clear() if hasattr(gpt2_runtime.cache, "clear") else None
    fresh = gpt2_runtime.forward_many([gpt2_runtime.tokenize(text + " again")])[0].tensors
    fresh2 = gpt2_runtime.forward_many([gpt2_runtime.tokenize(text + " again")])[0].tensors
    barrier = threading.Barrier(8)

    def grab(i):
        barrier.wait()
        return {n: getattr(fresh, n) for n in (fresh._NAMES[i % 6:] + fresh._NAMES[: i % 6])}

    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(grab, range(8)))
    for g in got:
        for n in fresh._NAMES:
            assert g[n] is got[0][n]  # stacked once
            assert torch.equal(g[n], getattr(fresh2, n))
    nb = fresh.nbytes
    assert nb == sum(t.numel() * t.element_size() for t in
                     [fresh.pattern, fresh.final_state] + [getattr(fresh, n) for n in fresh._NAMES])
    assert all(torch.equal(serial[n][:, :0], getattr(ref, n)[:, :0]) for n in ref._NAMES)


@pytest.mark.regression
def test_batch_equals_single_forwards(gpt2_runtime, bert_runtime):
    for rt, tol in ((gpt2_runtime, 1e-5), (bert_runtime, 1e-5)):
        texts = ["one two three four", "five six seven eight", "nine", "ten eleven"]
        rt.cache.clear()
        batch = rt.forward_many([rt.tokenize(t) for t in texts])
        rt.cache.clear()
        for t, fb in zip(texts, batch):
            fs = rt.forward_many([rt.tokenize(t)])[0]
            rt.cache.clear()
            for n in ("pattern", "hidden_states", "q", "k", "v", "attn_input", "attn_output"):
                x, y = getattr(fb.tensors, n), getattr(fs.tensors, n)
                assert x.shape == y.shape, n
                torch.testing.assert_close(x, y, atol=tol, rtol=tol, msg=n)


# --------------------------------------------------------------- buffers: batches, padding
NAMES = ("pattern", "hidden_states", "q", "k", "v", "attn_input", "attn_output",
         "final_hidden_state")


@pytest.mark.regression
@pytest.mark.parametrize("family,side", [("gpt2", "right"), ("gpt2", "left"),
                                         ("bert", "right"), ("bert", "left")])
def test_padded_batch_equals_single_and_hugging_face(family, side, gpt2_runtime, bert_runtime):
    single = gpt2_runtime if family == "gpt2" else bert_runtime
    model = "bundled" if family == "gpt2" else str(minilm_dir())
    rb = Runtime.load(Settings(model=model, forward_batch_size=3, padding_side=side))
    tag = uuid.uuid4().hex[:6]
    texts = [f"{tag} " + words(n, (tag, n)) for n in (3, 40, 11, 40, 1)]  # two of equal length
    items = [rb.tokenize(t) for t in texts]
    assert len({len(it) for it in items}) >= 3
    got = rb.forward_many(items)
    hits = rb.cached_forwards(items)
    assert hits is not None
    for t, fw, hit in zip(texts, got, hits):
        ref = single.forward_many([single.tokenize(t)])[0].tensors
        hf = hf_reference_with_qkv(single, list(fw.tokens.input_ids))
        for name in NAMES:
            a, b = getattr(fw.tensors, name), getattr(ref, name)
            assert a.shape == b.shape and a.dtype == b.dtype, name
            # 2e-5, plus float32 rounding that grows with the value (as test_batch_equals_alone:
            # a padded batch takes other matmul blocking; 2.1e-5 seen on hidden states of ~30)
            assert ((a - b).abs() <= 2e-5 + 1e-6 * b.abs()).all(), (
                name, t, (a - b).abs().max().item())
            assert torch.equal(getattr(hit.tensors, name), a), name  # the cached entry is it
            if name in hf:  # the single forward equals HF's own numbers bit for bit
                assert torch.equal(b, hf[name]), name
        for name in ("pattern", "hidden_states", "attn_input", "attn_output"):
            assert getattr(fw.tensors, name).is_contiguous()


@pytest.mark.regression
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_model_records_its_own_numbers_bit_for_bit(dtype, make_client):
    rt = Runtime.load(Settings(model="bundled", dtype=dtype, forward_batch_size=2))
    texts = [f"Low precision {uuid.uuid4().hex[:4]} " + words(n, n) for n in (5, 17)]
    got = rt.forward_many([rt.tokenize(t) for t in texts])  # one padded batch
    for fw in got:
        hf = hf_reference_with_qkv(rt, list(fw.tokens.input_ids))
        for name in NAMES:
            assert getattr(fw.tensors, name).dtype == getattr(torch, dtype), name
        single = rt._forward_batch([fw.tokens.input_ids])[0]
        for name, ref in hf.items():
            assert torch.equal(getattr(single, name), ref), name
            assert (getattr(fw.tensors, name).float() - ref.float()).abs().max() <= 2e-2, name
    c = make_client(rt, dtype=dtype, forward_batch_size=2)  # the recorded views through the API
    r = c.post("/v1/verify", json={"texts": texts, "projections": True, "mode": "recorded_qkv"})
    assert r.status_code == 200, r.text[:300]
    assert all(x["passed"] and x["dtype"] == dtype for x in r.json()["results"])
    r = c.post("/v1/verify", json={"texts": texts})  # from scratch, at the dtype's tolerance
    assert r.status_code == 200, r.text[:300]
    assert all(x["passed"] and x["dtype"] == dtype and x["mode"] == "from_scratch"
               for x in r.json()["results"]), [x["message"] for x in r.json()["results"]]


# --------------------------------------------------------------- reserve edge cases
@pytest.mark.regression
@pytest.mark.parametrize("limits", [dict(cache_entries=0), dict(cache_entries=1),
                                    dict(cache_bytes=1), dict(cache_bytes="one_and_half")])
def test_tiny_caches_give_right_results_and_stay_bounded(limits, gpt2_runtime):
    if limits.get("cache_bytes") == "one_and_half":
        one = gpt2_runtime.forward_many([gpt2_runtime.tokenize(words(20, 1))])[0].tensors.nbytes
        limits = dict(cache_bytes=one + one // 2)
    rt = Runtime.load(Settings(model="bundled", forward_batch_size=2, **limits))
    tag = uuid.uuid4().hex[:6]
    texts = [f"{tag} " + words(n, (tag, n)) for n in (20, 7, 20, 30)]
    for rounds in range(2):
        items = [rt.tokenize(t) for t in texts + texts[:1]]  # a repeat in one request
        got = rt.forward_many(items)
        for it, fw in zip(items, got):
            hf = hf_reference_with_qkv(gpt2_runtime, list(it.input_ids))
            assert fw.tokens is it
            for name in ("q", "k", "v"):
                assert (getattr(fw.tensors, name) - hf[name]).abs().max() <= 2e-5
            assert (fw.tensors.pattern - hf["pattern"]).abs().max() <= 2e-5
        assert len(rt.cache) <= rt.cache.max_entries
        assert rt.cache.nbytes <= rt.cache.max_bytes
        assert rt.cache.nbytes == sum(v[1] for v in rt.cache._data.values())


@pytest.mark.regression
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_batch_holding_a_text_at_n_ctx(side, gpt2_runtime):
    rt = Runtime.load(Settings(model="bundled", forward_batch_size=3, padding_side=side,
                               cache_entries=2))
    n_ctx = rt.adapter.n_ctx
    ids = rt.tokenizer(" cat" * (n_ctx + 10))["input_ids"][:n_ctx]
    full = rt.tokenizer.decode(ids)
    texts = [f"Short {uuid.uuid4().hex[:4]}", full, words(30, side)]
    items = [rt.tokenize(t) for t in texts]
    assert len(items[1]) == n_ctx
    for fw in rt.forward_many(items):
        hf = hf_reference_with_qkv(gpt2_runtime, list(fw.tokens.input_ids))
        for name, ref in hf.items():
            # float32: 2e-5 plus 2e-6 relative (a padded batch's matmuls round apart; seen
            # 2.48e-5 on a hidden state of a random text on AMD EPYC); patterns in [0, 1]
            err = (getattr(fw.tensors, name) - ref).abs()
            assert bool((err <= 2e-5 + 2e-6 * ref.abs()).all()), (name, float(err.max()))
    assert len(rt.cache) == 2


# ------------------------------------------------------------ patterns written in place
def _fresh_hf(rt, path):
    """Hugging Face's own eager model of ``path`` (its own config: 'eager', untouched)."""
    cls = AutoModelForCausalLM if rt.adapter.causal else AutoModel
    return cls.from_pretrained(path, attn_implementation="eager").eval()


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_patterns_written_in_place_equal_hugging_face_bit_for_bit(
        family, gpt2_runtime, bert_runtime, bundled_dir, minilm_path, monkeypatch):
    """A text forwarded alone gets its patterns written straight into its ``[layer, head,
    query_pos, key_pos]`` buffer (GPT-2: by the hooked forward's softmax, service/runtime/
    hooked.py ``record``, the path every causal endpoint runs; BERT: by the in-place eager
    attention) and its other tensors copied into theirs during the forward (BERT: the
    runtime's fill finds every part already in place: only the hidden states are stacked
    afterwards), and every recorded tensor equals Hugging Face's separately loaded eager
    model bit for bit; a batch (GPT-2: each length forwarded alone, unpadded; BERT: padded,
    the copying path) still equals it per text."""
    from attnscope.service.runtime import hooked, inplace_attention

    rt, path = (gpt2_runtime, bundled_dir) if family == "gpt2" else (bert_runtime, minilm_path)
    assert rt.inplace_attention and rt.model.config._attn_implementation == inplace_attention.NAME
    assert rt.info["attn_implementation"] == "eager"
    assert (rt.hooked_parts() is not None) == (family == "gpt2")
    ref = _fresh_hf(rt, path)
    base = getattr(ref, "transformer", None) or getattr(ref, "bert", None) or ref
    filled = []  # per fill: (the buffer's first dimension, every part already in place)
    orig = rt._fill
    put = []  # GPT-2: the data pointer of every target the hooked forward copied into
    real_put = hooked._put

    def spy(buf, parts):
        parts = list(parts)
        filled.append((buf.shape[0], all(t.data_ptr() == buf[i].data_ptr()
                                          for i, t in enumerate(parts))))
        return orig(buf, parts)

    def put_spy(target, x):
        put.append(target.data_ptr())
        return real_put(target, x)

    monkeypatch.setattr(rt, "_fill", spy)
    monkeypatch.setattr(hooked, "_put", put_spy)
    texts = [SENTENCE + uuid.uuid4().hex[:6], "Short " + uuid.uuid4().hex[:6]]
    items = [rt.tokenize(t) for t in texts]
    alone = [rt._forward_batch([it.input_ids])[0] for it in items]
    L = rt.adapter.n_layers
    n_qkv = len(rt._handles[0].qkv)  # GPT-2: one fused module, BERT: three
    if family == "gpt2":  # per text: L + 1 states, L x (attn input, qkv, attn output), ln_f
        assert not filled and len(put) == 2 * (L + 1 + 3 * L + 1)
        for fw in alone:  # the softmax wrote the patterns: nothing was copied there
            lo = fw.pattern.data_ptr()
            hi = lo + fw.pattern.numel() * fw.pattern.element_size()
            assert not any(lo <= ptr < hi for ptr in put)
    else:  # the pattern, q/k/v, attention input and output in place; hidden states copied
        assert sorted(filled) == sorted(([(L, True)] * (3 + n_qkv) + [(L + 1, False)]) * 2)
    for it, fw in zip(items, alone):
        kw = dict(input_ids=torch.tensor([it.input_ids]), output_attentions=True,
                  output_hidden_states=True)
        if family == "bert":
            kw["token_type_ids"] = torch.zeros_like(kw["input_ids"])
        seen: dict = {"attn_input": [], "attn_output": [], "qkv": []}  # HF's, per layer
        hooks = []
        for h in type(rt.adapter)(ref).layers():
            hooks.append(h.attn.register_forward_pre_hook(
                lambda m, a, k: seen["attn_input"].append((a[0] if a else k["hidden_states"])[0]
                                                          .clone()), with_kwargs=True))
            hooks.append(h.out_proj.register_forward_hook(
                lambda m, a, o: seen["attn_output"].append(o[0].clone())))
            hooks += [m.register_forward_hook(lambda m, a, o: seen["qkv"].append(o[0].clone()))
                      for m in h.qkv]
        try:
            with torch.inference_mode():
                out = base(**kw)
        finally:
            for h in hooks:
                h.remove()
        assert torch.equal(fw.pattern, torch.stack([a[0] for a in out.attentions]))
        L = rt.adapter.n_layers
        assert torch.equal(fw.hidden_states[:L], torch.stack(out.hidden_states[:L])[:, 0])
        assert torch.equal(fw.final_hidden_state, out.hidden_states[L][0])
        for name in ("attn_input", "attn_output"):
            assert torch.equal(getattr(fw, name), torch.stack(seen[name])), name
        H, dh, T = rt.adapter.n_heads, rt.adapter.d_head, len(it)
        qkv = [torch.cat(seen["qkv"][i * n_qkv:(i + 1) * n_qkv], -1) for i in range(L)]
        for j, name in enumerate("qkv"):  # [layer, head, pos, d_head] of each module's output
            want = torch.stack([x.split(rt.adapter.d_model, -1)[j].reshape(T, H, dh)
                                .transpose(0, 1) for x in qkv])
            assert torch.equal(getattr(fw, name), want), name
    filled.clear()
    old = rt.settings.forward_batch_size
    rt.settings.forward_batch_size = 2
    try:
        batch = rt._forward_batch([it.input_ids for it in items])  # BERT padded: copied
    finally:
        rt.settings.forward_batch_size = old
    if family == "gpt2":  # two lengths: two unpadded forwards, each the text's own
        for a, b in zip(alone, batch):
            assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in NAMES)
        return
    assert filled and not any(in_place for _, in_place in filled)
    for a, b in zip(alone, batch):
        assert ((a.pattern - b.pattern).abs() <= 1e-5).all()  # as test_batch_equals_alone


@pytest.mark.parametrize("path", ["hooked", "hf"])
def test_a_wrong_pattern_written_in_place_is_caught(path, gpt2_runtime, bundled_dir,
                                                    monkeypatch):
    """The planted fault, in the forward that records: the causal mask dropped where the
    pattern is written into a buffer. ``hooked``: GPT-2's recorded forward, the hooked one
    (its shared scores buffer gets no mask); ``hf``: the same runtime made to record through
    Hugging Face's modules (the path of encoders and of configurations the hooked forward
    does not implement), the in-place eager attention unmasked. The comparison with Hugging
    Face above fails on every layer, and the fault is gone once the real code is back."""
    from transformers import AttentionInterface

    from attnscope.service.runtime import hooked
    from attnscope.service.runtime import inplace_attention as ia

    rt = gpt2_runtime
    it = rt.tokenize(SENTENCE + uuid.uuid4().hex[:6])
    with torch.inference_mode():
        out = _fresh_hf(rt, bundled_dir).transformer(input_ids=torch.tensor([it.input_ids]),
                                                     output_attentions=True)
    ref = torch.stack([a[0] for a in out.attentions])
    if path == "hooked":
        real = hooked._Run.scores

        def unmasked(self, site, q, k, scaling, mask, softcap=None):
            return real(self, site, q, k, scaling, torch.zeros_like(mask), softcap)

        with monkeypatch.context() as mp:
            mp.setattr(hooked._Run, "scores", unmasked)
            bad = rt._forward_batch([it.input_ids])[0]
    else:
        def unmasked(module, query, key, value, attention_mask, **kw):
            if getattr(ia._local, "targets", None):
                attention_mask = None
            return ia.attention_into_buffer(module, query, key, value, attention_mask, **kw)

        monkeypatch.setitem(rt.memo, "hooked_unsupported", "test: Hugging Face's modules")
        assert rt.hooked_parts() is None
        AttentionInterface.register(ia.NAME, unmasked)
        try:
            bad = rt._forward_batch([it.input_ids])[0]
        finally:
            AttentionInterface.register(ia.NAME, ia.attention_into_buffer)
    assert all(not torch.equal(bad.pattern[i], ref[i]) for i in range(rt.adapter.n_layers))
    assert torch.equal(rt._forward_batch([it.input_ids])[0].pattern, ref)


@pytest.mark.parametrize("family", ["gpt2", "gpt2_hf", "bert"])
def test_one_scores_buffer_serves_every_layer_and_goes_with_the_forward(
        family, gpt2_runtime, bert_runtime, monkeypatch):
    """The recorded forward computes every layer's pre-softmax scores in ONE buffer (no fresh
    [head, query_pos, key_pos] tensors per layer: at T = 1024 on GPT-2-small shapes they were
    1.8 GB of page faults per forward), and the buffer is gone when the forward ends; a fresh
    buffer per layer (the planted fault) fails here. ``gpt2``: the hooked forward's
    (``hooked._Run.scores``); ``gpt2_hf`` (GPT-2 made to record through Hugging Face's
    modules) and ``bert``: the in-place eager attention's scratch. The numbers are the
    bit-for-bit test's above."""
    from attnscope.service.runtime import hooked
    from attnscope.service.runtime import inplace_attention as ia

    rt = bert_runtime if family == "bert" else gpt2_runtime
    it = rt.tokenize(SENTENCE + uuid.uuid4().hex[:6])
    seen = []
    if family == "gpt2":
        real_scores = hooked._Run.scores
        runs = []

        def spy_scores(self, *a, **k):
            buf = real_scores(self, *a, **k)
            seen.append(buf.data_ptr())
            runs.append(weakref.ref(self))
            return buf

        monkeypatch.setattr(hooked._Run, "scores", spy_scores)
        rt._forward_batch([it.input_ids])
        assert len(seen) == rt.adapter.n_layers and len(set(seen)) == 1
        assert all(r() is None for r in runs)  # the forward's state, its buffer, freed
        runs.clear()
        seen.clear()
        kept = []

        def fresh(self, *a, **k):  # the planted fault: a new buffer per layer (kept alive)
            kept.append(self._scores)
            self._scores = None
            return spy_scores(self, *a, **k)

        monkeypatch.setattr(hooked._Run, "scores", fresh)
        rt._forward_batch([it.input_ids])
        assert len(set(seen)) > 1  # the planted fault is visible to the first assertion
        return
    if family == "gpt2_hf":
        monkeypatch.setitem(rt.memo, "hooked_unsupported", "test: Hugging Face's modules")
    real = ia._scratch

    def spy(like):
        buf = real(like)
        seen.append(buf.data_ptr())
        return buf

    monkeypatch.setattr(ia, "_scratch", spy)
    rt._forward_batch([it.input_ids])
    assert len(seen) == rt.adapter.n_layers and len(set(seen)) == 1
    assert getattr(ia._local, "scratch", None) is None
    seen.clear()
    monkeypatch.setattr(ia, "_scratch", lambda like: spy(like) if not seen else
                        (seen.append(-1), torch.empty_like(like))[1])
    rt._forward_batch([it.input_ids])
    assert len(set(seen)) > 1  # the planted fault is visible to the first assertion


@pytest.mark.regression  # issue 29: "_attn_implementation": "sdpa" in config.json broke start-up
@pytest.mark.parametrize("key", ["_attn_implementation", "attn_implementation"])
def test_loader_forces_eager_whatever_config_json_says(key, tmp_path, bundled_dir, gpt2_runtime,
                                                       caplog):
    import json
    import logging
    import shutil

    ckpt = tmp_path / "sdpa_ckpt"
    shutil.copytree(bundled_dir, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[key] = "sdpa"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING, logger="attnscope.runtime"):
        rt = Runtime.load(Settings(model=str(ckpt)))
    said = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert said and "'sdpa'" in said[0] and "overridden" in said[0] and "eager" in said[0]
    assert rt.info["attn_implementation"] in ("eager", "attnscope_eager")
    assert rt.model.config._attn_implementation in ("eager", "attnscope_eager")
    # the same numbers as the bundled checkpoint loaded without the key
    a, b = rt.tokenize(SENTENCE), gpt2_runtime.tokenize(SENTENCE)
    pa, pb = rt.forward_many([a])[0].pattern, gpt2_runtime.forward_many([b])[0].pattern
    assert torch.equal(pa, pb)


def test_an_eager_checkpoint_loads_without_an_override_warning(bundled_dir, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="attnscope.runtime"):
        Runtime.load(Settings(model=str(bundled_dir)))
    assert not [r for r in caplog.records if "overridden" in r.getMessage()]
