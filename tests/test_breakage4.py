"""Breakage tests for the device thread, the pre-allocated recorded buffers, evict-before-forward
and the cache-hit fast paths (service/runtime/slot.py, model.py, cache.py, memory.py,
service/api/common.py, service/ops.py). Real models only."""

from __future__ import annotations

import concurrent.futures as cf
import gc
import random
import re
import socket
import threading
import time
import uuid

import httpx
import numpy as np
import pytest
import torch

from attnscope.service.config import Settings
from attnscope.service.runtime import Runtime

from conftest import minilm_dir, start_server, stop_server
from test_api import decode

NAMES = ("pattern", "hidden_states", "q", "k", "v", "attn_input", "attn_output",
         "final_hidden_state")
WORDS = "the cat sat on a mat and then it ran far away from home".split()


def words(n: int, seed) -> str:
    r = random.Random(str(seed))
    return " ".join(r.choice(WORDS) for _ in range(n))


def hf_reference(rt: Runtime, ids: list[int]):
    """Hugging Face's own forward of one unpadded text, with q/k/v from manual hooks on the
    q/k/v modules (split into heads here) and the last block's output from a hook on it: the
    recorded tensors (hidden_states = the L+1 residual-stream states, the last pre-ln_f;
    final_hidden_state = HF's last hidden_states entry)."""
    caps: list[list] = [[None] * len(h.qkv) for h in rt._handles]
    base = rt.adapter.base()
    last_block = (base.h if rt.adapter.causal else base.encoder.layer)[-1]
    last = []
    hooks = [last_block.register_forward_hook(
        lambda m, a, o: last.append((o[0] if isinstance(o, tuple) else o)[0].clone()))]
    for i, h in enumerate(rt._handles):
        for j, m in enumerate(h.qkv):
            def hook(mod, args, out, i=i, j=j):
                caps[i][j] = out[0].clone()
            hooks.append(m.register_forward_hook(hook))
    kw = dict(input_ids=torch.tensor([ids]), output_attentions=True, output_hidden_states=True)
    if rt.adapter.family == "bert":
        kw["token_type_ids"] = torch.zeros_like(kw["input_ids"])
    try:
        with torch.inference_mode():
            out = rt.adapter.base()(**kw)
    finally:
        for h in hooks:
            h.remove()
    H, dh = rt.adapter.n_heads, rt.adapter.d_head
    qs, ks, vs = [], [], []
    for layer in caps:
        parts = layer[0].split(rt.adapter.d_model, dim=-1) if len(layer) == 1 else layer
        q, k, v = (p.reshape(len(ids), H, dh).transpose(0, 1) for p in parts)
        qs.append(q), ks.append(k), vs.append(v)
    return dict(pattern=torch.stack([a[0] for a in out.attentions]),
                hidden_states=torch.stack([h[0] for h in out.hidden_states[:-1]] + last),
                final_hidden_state=out.hidden_states[-1][0],
                q=torch.stack(qs), k=torch.stack(ks), v=torch.stack(vs))


# --------------------------------------------------------------- buffers: batches, padding
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
        hf = hf_reference(single, list(fw.tokens.input_ids))
        for name in NAMES:
            a, b = getattr(fw.tensors, name), getattr(ref, name)
            assert a.shape == b.shape and a.dtype == b.dtype, name
            assert (a - b).abs().max().item() <= 2e-5, (name, t)
            assert torch.equal(getattr(hit.tensors, name), a), name  # the cached entry is it
            if name in hf:  # the single forward equals HF's own numbers bit for bit
                assert torch.equal(b, hf[name]), name
        for name in ("pattern", "hidden_states", "attn_input", "attn_output"):
            assert getattr(fw.tensors, name).is_contiguous()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_model_records_its_own_numbers_bit_for_bit(dtype, make_client):
    rt = Runtime.load(Settings(model="bundled", dtype=dtype, forward_batch_size=2))
    texts = [f"Low precision {uuid.uuid4().hex[:4]} " + words(n, n) for n in (5, 17)]
    got = rt.forward_many([rt.tokenize(t) for t in texts])  # one padded batch
    for fw in got:
        hf = hf_reference(rt, list(fw.tokens.input_ids))
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


def test_text_at_n_ctx_through_the_app_is_bit_exact(client, gpt2_runtime):
    rt = gpt2_runtime
    n_ctx = rt.adapter.n_ctx if hasattr(rt.adapter, "n_ctx") else 256
    text = " the" * (n_ctx + 40)
    ids = rt.tokenizer(text)["input_ids"]
    # cut to exactly n_ctx tokens
    text = rt.tokenizer.decode(ids[:n_ctx]) + f""
    tt = rt.tokenize(text)
    assert len(tt) == n_ctx
    r = client.post("/v1/attention", json={"text": text, "encoding": "base64"})
    assert r.status_code == 200, r.text
    got = decode(r.json()["attention"]["pattern"])
    hf = hf_reference(rt, list(tt.input_ids))
    assert np.array_equal(got, hf["pattern"].numpy())
    r = client.post("/v1/attention", json={"text": text + " the"})
    assert r.status_code == 422


# --------------------------------------------------------------- reserve edge cases
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
            hf = hf_reference(gpt2_runtime, list(it.input_ids))
            assert fw.tokens is it
            for name in ("q", "k", "v"):
                assert (getattr(fw.tensors, name) - hf[name]).abs().max() <= 2e-5
            assert (fw.tensors.pattern - hf["pattern"]).abs().max() <= 2e-5
        assert len(rt.cache) <= rt.cache.max_entries
        assert rt.cache.nbytes <= rt.cache.max_bytes
        assert rt.cache.nbytes == sum(v[1] for v in rt.cache._data.values())


# --------------------------------------------------------------- concurrency, in process
def test_concurrent_mixed_requests_equal_sequential_results(make_client, gpt2_runtime):
    c = make_client(gpt2_runtime, max_queue=256, forward_batch_size=2)
    tag = uuid.uuid4().hex[:6]
    texts = [f"{tag} " + words(n, (tag, n)) for n in (4, 9, 30, 9, 60, 2)]
    reqs = []
    for i, t in enumerate(texts * 3):
        reqs.append(("/v1/attention", {"text": t, "encoding": "base64"}))
        if i % 2:
            reqs.append(("/v1/heads", {"text": t}))
        if i % 3 == 0:
            reqs.append(("/v1/attention", {"texts": texts[:3], "encoding": "base64"}))
        if i % 4 == 0:
            reqs.append(("/v1/links", {"text": t, "layer": 1}))
    random.Random(7).shuffle(reqs)
    with cf.ThreadPoolExecutor(8) as ex:
        conc = list(ex.map(lambda pr: c.post(pr[0], json=pr[1]), reqs))
    gpt2_runtime.cache.clear()
    seq = [c.post(p, json=b) for p, b in reqs]
    for (p, b), x, y in zip(reqs, conc, seq):
        assert x.status_code == y.status_code == 200, (p, x.text[:300])
        jx, jy = x.json(), y.json()
        jx.pop("timing", None), jy.pop("timing", None)
        assert jx == jy, p
    for t in texts:  # and the concurrent answers are Hugging Face's numbers
        r = c.post("/v1/attention", json={"text": t, "encoding": "base64"}).json()
        hf = hf_reference(gpt2_runtime, list(gpt2_runtime.tokenize(t).input_ids))
        assert np.array_equal(decode(r["attention"]["pattern"]), hf["pattern"].numpy())
    m = c.get("/metrics").text
    assert re.search(r"^attnscope_queue_depth 0\.0$", m, re.M), m[-2000:]
    ent = float(re.search(r"^attnscope_cache_entries (\S+)$", m, re.M).group(1))
    nb = float(re.search(r"^attnscope_cache_bytes (\S+)$", m, re.M).group(1))
    assert (ent, nb) == (len(gpt2_runtime.cache), gpt2_runtime.cache.nbytes)
    assert nb == sum(v[1] for v in gpt2_runtime.cache._data.values())


def test_admitted_requests_are_never_refused_after_their_forward(make_client, gpt2_runtime):
    """max_queue 0: a burst of requests is refused (429) or answered (200), never a 500, and
    every 200 is right; afterwards the slot is empty and the service answers."""
    c = make_client(gpt2_runtime, max_queue=0)
    tag = uuid.uuid4().hex[:6]
    texts = [f"{tag} " + words(n, (tag, n)) for n in (50, 60, 70, 80)]
    reqs = [(p, {"text": t}) for t in texts for p in ("/v1/heads", "/v1/links", "/v1/verify")]
    reqs = [(p, {**b, "layer": 0}) if p == "/v1/links" else (p, b) for p, b in reqs]
    with cf.ThreadPoolExecutor(8) as ex:
        out = list(ex.map(lambda pr: c.post(pr[0], json=pr[1]), reqs * 2))
    codes = [r.status_code for r in out]
    assert set(codes) <= {200, 429}, [r.text[:200] for r in out if r.status_code not in (200, 429)]
    assert 200 in codes
    assert c.app.state.slot.depth == 0
    for (p, b), r in zip(reqs * 2, out):
        if r.status_code == 200:
            again = c.post(p, json=b)
            assert again.status_code == 200
            x, y = r.json(), again.json()
            x.pop("timing", None), y.pop("timing", None)
            assert x == y, p


# --------------------------------------------------------------- app lifecycle
def _ready(c, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if c.get("/readyz").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError("not ready")


def test_app_loaded_shut_down_and_created_again_in_one_process(gpt2_runtime):
    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app

    text = f"Lifecycle {uuid.uuid4().hex[:6]} the cat sat."
    hf = hf_reference(gpt2_runtime, list(gpt2_runtime.tokenize(text).input_ids))
    before = gc.get_freeze_count()
    threads = []
    for round_ in range(2):
        app = create_app(Settings(model="bundled"))
        with TestClient(app, raise_server_exceptions=False) as c:
            _ready(c)
            assert gc.get_freeze_count() > before  # the start-up objects were frozen
            r = c.post("/v1/attention", json={"text": text, "encoding": "base64"})
            assert r.status_code == 200, r.text
            assert np.array_equal(decode(r.json()["attention"]["pattern"]), hf["pattern"].numpy())
            slot_thread = c.portal.call(app.state.slot.run, threading.current_thread)
            assert slot_thread.name.startswith("attnscope-device")
            threads.append(slot_thread)
        assert gc.get_freeze_count() == 0  # unfrozen at shutdown
        slot_thread.join(timeout=10)
        assert not slot_thread.is_alive()  # the slot's thread ended
    assert threads[0] is not threads[1]


# --------------------------------------------------------------- a real uvicorn
@pytest.fixture(scope="module")
def timeout_server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("b4"), "--model", "bundled",
                     env={"ATTNSCOPE_REQUEST_TIMEOUT_S": "0.6", "ATTNSCOPE_MAX_QUEUE": "64",
                          "ATTNSCOPE_MAX_BATCH": "96"})
    yield s
    stop_server(s)


def _metric(url, name) -> float:
    m = httpx.get(url + "/metrics", timeout=10).text
    found = re.search(rf"^{name} ([0-9.e+-]+)$", m, re.M)
    assert found, name
    return float(found.group(1))


def _settle(url, stall_s=120.0):
    """Wait until no request waits for or holds the device slot and no abandoned forward is
    still finishing. No deadline on the whole wait (a loaded 2-core machine may take minutes
    over the abandoned work): it fails only when nothing moves, i.e. neither the queue depth,
    the abandoned count nor the forward counter changed for ``stall_s`` seconds, which is what
    a slot that is never released looks like. The work is finite, so the wait ends."""
    def state():
        return (_metric(url, "attnscope_queue_depth"),
                _metric(url, "attnscope_abandoned_requests"),
                _metric(url, "attnscope_forwards_total"))

    last, last_change = state(), time.monotonic()
    while last[:2] != (0, 0):
        time.sleep(0.25)
        now = state()
        if now != last:
            last, last_change = now, time.monotonic()
        elif time.monotonic() - last_change > stall_s:
            raise AssertionError(f"the slot never emptied: queue depth {now[0]:g}, abandoned "
                                 f"{now[1]:g}, no forward for {stall_s:g} s")


def test_timeouts_and_disconnects_during_device_work(timeout_server, gpt2_runtime):
    url = timeout_server.url
    tag = uuid.uuid4().hex[:6]
    heavy = [f"{tag} {i} " + words(150, (tag, i)) for i in range(96)]  # ~1.5 s of work
    # 1) a request abandoned at the deadline while its forwards and analysis run
    r = httpx.post(url + "/v1/heads", json={"texts": heavy}, timeout=30)
    assert r.status_code == 504, r.text[:300]
    assert r.json()["error"]["type"] == "timeout"
    # 2) clients that disconnect while their forwards run on the device thread
    for k in range(2):
        body = httpx.Request("POST", url + "/v1/verify",
                             json={"texts": [t + f" d{k}" for t in heavy], "mode": "recorded_qkv"})
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            raw = (f"POST /v1/verify HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body.content)}\r\n\r\n").encode() + body.content
            s.sendall(raw)
            time.sleep(0.02)
    _settle(url)
    # 3) the service still answers, with the right numbers, from what the abandoned work cached
    for t in heavy[:3] + [heavy[0] + " d1", f"Fresh {tag}"]:
        for _ in range(20):  # a 504 here only says the shared CPUs are busy (0.6 s limit)
            r = httpx.post(url + "/v1/attention", json={"text": t, "encoding": "base64"}, timeout=30)
            if r.status_code != 504:
                break
            _settle(url)  # let that abandoned forward finish (and fill the cache) first
        assert r.status_code == 200, r.text[:300]
        hf = hf_reference(gpt2_runtime, list(gpt2_runtime.tokenize(t).input_ids))
        assert np.array_equal(decode(r.json()["attention"]["pattern"]), hf["pattern"].numpy())
    assert _metric(url, "attnscope_queue_depth") == 0
    assert timeout_server.proc.poll() is None
    log = timeout_server.log.read_text()
    assert "Traceback" not in log, log[-3000:]


def test_model_load_is_not_recorded_as_a_request_forward():
    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app

    app = create_app(Settings(model="bundled"))
    with TestClient(app, raise_server_exceptions=False) as c:
        _ready(c)
        m = c.get("/metrics").text
        counts = {name: float(re.search(rf"^{name}_count (\S+)$", m, re.M).group(1))
                  for name in ("attnscope_forward_seconds", "attnscope_queue_wait_seconds")}
        assert counts == {"attnscope_forward_seconds": 0.0, "attnscope_queue_wait_seconds": 0.0}
        text = f"Metrics {uuid.uuid4().hex[:6]} the cat sat."
        assert c.post("/v1/heads", json={"text": text}).status_code == 200  # one forward
        assert c.post("/v1/heads", json={"text": text}).status_code == 200  # cached: not timed
        m = c.get("/metrics").text
        assert re.search(r"^attnscope_forward_seconds_count 1\.0$", m, re.M)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_scores_from_the_qkv_views_equal_a_manual_recomputation(family, make_client, gpt2_runtime,
                                                                 bert_runtime):
    rt = gpt2_runtime if family == "gpt2" else bert_runtime
    c = make_client(rt, forward_batch_size=4, padding_side="left")
    tag = uuid.uuid4().hex[:6]
    texts = [f"{tag} " + words(n, (tag, n)) for n in (2, 25, 9)]
    for _ in range(2):  # computed, then from the cache
        r = c.post("/v1/attention", json={"texts": texts, "include_scores": True,
                                          "encoding": "base64"})
        assert r.status_code == 200, r.text[:300]
        for t, res in zip(texts, r.json()["results"]):
            ids = list(rt.tokenize(t).input_ids)
            hf = hf_reference(rt, ids)
            scores = decode(res["scores"]).astype(np.float64)
            want = (hf["q"].double() @ hf["k"].double().transpose(-1, -2)).numpy()
            want = want * np.array(rt.scaling)[:, None, None, None]
            if rt.adapter.causal:
                want = np.where(np.tril(np.ones((len(ids), len(ids)), bool)), want, -np.inf)
            assert scores.shape == want.shape
            fin = np.isfinite(want)
            assert np.array_equal(np.isfinite(scores), fin)
            assert np.abs(scores[fin] - want[fin]).max() <= 1e-4
            assert np.abs(decode(res["pattern"]) - hf["pattern"].numpy()).max() <= 2e-6


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
        hf = hf_reference(gpt2_runtime, list(fw.tokens.input_ids))
        for name, ref in hf.items():
            assert (getattr(fw.tensors, name) - ref).abs().max() <= 2e-5, name
    assert len(rt.cache) == 2


def test_one_app_object_entered_twice_gets_a_fresh_slot_thread(gpt2_runtime):
    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app

    app = create_app(Settings(model="bundled", max_queue=0), runtime=gpt2_runtime)
    text = f"Twice {uuid.uuid4().hex[:6]} a b c"
    hf = hf_reference(gpt2_runtime, list(gpt2_runtime.tokenize(text).input_ids))
    frozen = gc.get_freeze_count()
    seen = []
    for _ in range(2):
        with TestClient(app, raise_server_exceptions=False) as c:
            for p in ("/v1/attention", "/v1/heads", "/v1/verify"):
                r = c.post(p, json={"text": text, **({"encoding": "base64"} if p == "/v1/attention" else {})})
                assert r.status_code == 200, (p, r.text[:300])
                if p == "/v1/attention":
                    assert np.array_equal(decode(r.json()["attention"]["pattern"]), hf["pattern"].numpy())
            seen.append(c.portal.call(app.state.slot.run, threading.current_thread))
            assert app.state.slot.depth == 0
        seen[-1].join(timeout=10)
        assert not seen[-1].is_alive()
    assert seen[0] is not seen[1]
    assert gc.get_freeze_count() == frozen  # an app given its runtime freezes nothing


def test_one_apps_shutdown_keeps_another_running_apps_objects_frozen():
    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app

    with TestClient(create_app(Settings(model="bundled")), raise_server_exceptions=False) as a:
        _ready(a)
        frozen_a = gc.get_freeze_count()
        assert frozen_a > 0
        with TestClient(create_app(Settings(model="bundled")), raise_server_exceptions=False) as b:
            _ready(b)
        assert gc.get_freeze_count() >= frozen_a  # a still serves: its objects stay frozen
