"""The device slot and its own thread: forwards and analyses run on the slot thread, admission
(429 when full, admitted work never refused), concurrent requests equal serial ones, timeouts and
disconnects during device work, the event loop never blocked; the forward's contiguous buffers,
evict-before-forward and the cache-hit fast paths (service/serving/core/slot.py, model.py, cache.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import random
import re
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

from attnscope.service.config import Settings
from attnscope.service.errors import InvalidRequest, Overloaded
from attnscope.service.runtime import Runtime
from attnscope.service.runtime.cache import ByteLRU
from attnscope.service.serving.core.slot import DeviceSlot

from conftest import start_server, stop_server
from test_api import decode
from recorded_reference import hf_reference, words


# ------------------------------------------------------------------ ByteLRU.reserve / get_all
def test_reserve_evicts_least_recent_first_so_a_new_entry_fits():
    c = ByteLRU(10, 100, len)
    for k in "abcd":
        c.put(k, "x" * 25)  # 100 bytes: full
    c.get("a")  # a is now the most recent
    c.reserve(30)  # needs 30 free: b and c (the two least recent) go
    assert sorted(c._data) == ["a", "d"] and c.nbytes == 50
    c.reserve(50)  # fits already: nothing evicted
    assert len(c) == 2
    c.reserve(101)  # could never be stored: nothing evicted
    assert len(c) == 2
    c2 = ByteLRU(2, 10**6, len)
    c2.put("a", "x"), c2.put("b", "y")
    c2.reserve(1, entries=1)  # the entry count bounds too
    assert list(c2._data) == ["b"]


def test_get_all_is_all_or_nothing():
    c = ByteLRU(10, 100, len)
    c.put("a", "1"), c.put("b", "2")
    h, m = c.hits, c.misses
    assert c.get_all(["a", "zz"]) is None and (c.hits, c.misses) == (h, m)
    assert c.get_all(["a", "b", "a"]) == ["1", "2", "1"] and c.hits == h + 3
    assert list(c._data)[-1] == "a"  # made most recent


# ------------------------------------------------------------------ the recorded buffers
def test_recorded_tensors_are_few_contiguous_buffers_equal_to_hugging_face(gpt2_runtime):
    rt = gpt2_runtime
    rt.cache.clear()
    fw = rt.forward_many([rt.tokenize(f"Buffers {uuid.uuid4().hex}: the cat sat on the mat.")])[0]
    t = fw.tensors
    for name in ("pattern", "hidden_states", "attn_input", "attn_output"):
        x = getattr(t, name)
        assert x.is_contiguous() and x.untyped_storage().nbytes() == x.numel() * x.element_size(), name
    # GPT-2: q, k, v are views of one [layer, pos, 3 * d_model] buffer of c_attn outputs
    assert t.q.untyped_storage().data_ptr() == t.k.untyped_storage().data_ptr() == t.v.untyped_storage().data_ptr()
    L, H, T, dh = t.q.shape
    assert t.q.untyped_storage().nbytes() == L * T * 3 * H * dh * t.q.element_size()
    assert t.nbytes == sum(x.numel() * x.element_size() for x in
                           (t.pattern, t.hidden_states, t.q, t.k, t.v, t.attn_input, t.attn_output,
                            t.final_state))
    # the same numbers as Hugging Face's own outputs, bit for bit
    ids = torch.tensor([fw.tokens.input_ids])
    with torch.inference_mode():
        out = rt.adapter.base()(input_ids=ids, output_attentions=True, output_hidden_states=True)
    assert torch.equal(t.pattern, torch.stack([a[0] for a in out.attentions]))
    # the L+1 residual states: HF's 0..L-1, then the last block's output (pre-ln_f); HF's last
    # entry (ln_f's output) is the final state
    assert torch.equal(t.hidden_states[:-1], torch.stack([h[0] for h in out.hidden_states[:-1]]))
    assert torch.equal(t.final_state, out.hidden_states[-1][0])
    with torch.inference_mode():
        assert torch.equal(rt.adapter.base().ln_f(t.hidden_states[-1]), t.final_state)


def test_reserve_runs_before_the_forward_and_the_cache_stays_bounded():
    rt = Runtime.load(Settings(model="bundled", cache_bytes=1))  # entries never fit
    one = rt.forward_many([rt.tokenize("a b c d")])[0].tensors.nbytes
    rt2 = Runtime.load(Settings(model="bundled", cache_bytes=2 * one + one // 2))
    seen = []
    real = rt2._forward_batch

    def spy(batch):
        seen.append(len(rt2.cache))  # entries left when the forward starts
        return real(batch)

    rt2._forward_batch = spy
    for w in ("e", "f", "g", "h"):  # same length as "a b c d"
        rt2.forward_many([rt2.tokenize(f"{w} b c d")])
    assert seen == [0, 1, 1, 1]  # from the third on, the oldest was evicted before the forward
    assert len(rt2.cache) == 2 and rt2.cache.nbytes <= rt2.cache.max_bytes


# ------------------------------------------------------------------ the device thread
def test_forwards_and_analyses_run_on_the_slot_thread(make_client, gpt2_runtime, monkeypatch):
    from attnscope.service.analysis import heads as H
    from attnscope.service.analysis import verify as V
    import attnscope.service.serving.heads as heads_api
    import attnscope.service.serving.verify as verify_api

    c = make_client(gpt2_runtime)
    slot = c.app.state.slot
    slot_thread = c.portal.call(slot.run, threading.get_ident)
    seen: dict[str, set] = {"forward": set(), "heads": set(), "verify": set()}
    real_forward = gpt2_runtime._forward_batch  # the recorded forward (hooked or HF modules)
    monkeypatch.setattr(gpt2_runtime, "_forward_batch", lambda *a, **k: seen["forward"].add(
        threading.get_ident()) or real_forward(*a, **k))
    real_scores, real_verify = H.head_scores, V.verify_from_scratch
    monkeypatch.setattr(heads_api.H, "head_scores",
                        lambda *a, **k: seen["heads"].add(threading.get_ident()) or real_scores(*a, **k))
    monkeypatch.setattr(verify_api, "verify_from_scratch",
                        lambda *a, **k: seen["verify"].add(threading.get_ident()) or real_verify(*a, **k))
    text = f"Thread test {uuid.uuid4().hex}: the cat sat on the mat."
    for path, body in (("/v1/attention", {"text": text, "encoding": "base64"}),
                       ("/v1/heads", {"text": text}), ("/v1/links", {"text": text, "layer": 0}),
                       ("/v1/verify", {"text": text}),
                       ("/v1/attention", {"text": text + " again", "sparse": {"top_k": 2}})):
        assert c.post(path, json=body).status_code == 200, path
    assert seen["forward"] == seen["heads"] == seen["verify"] == {slot_thread}


def test_small_analysis_jobs_run_on_one_torch_thread(make_client, gpt2_runtime, monkeypatch):
    """Analyses of short texts run their torch ops on one intra-op thread (each small op
    would otherwise be an OpenMP region waiting for a second, shared core: analysis/_blas.py
    torch_threads_for); the slot thread's count comes back after the job, and long texts keep
    torch's count."""
    from attnscope.service.analysis import _blas
    from attnscope.service.analysis import heads as H
    from attnscope.service.analysis import links as Lk
    import attnscope.service.serving.attention as attention_api
    import attnscope.service.serving.heads as heads_api
    import attnscope.service.serving.links as links_api

    c = make_client(gpt2_runtime)
    slot = c.app.state.slot
    c.portal.call(slot.run, lambda: torch.set_num_threads(2))
    seen: dict[str, list] = {"heads": [], "links": [], "attention": []}
    real_scores, real_links, real_select = H.head_scores, Lk.strongest_links, attention_api.select_heads
    monkeypatch.setattr(heads_api.H, "head_scores", lambda *a, **k: seen["heads"].append(
        torch.get_num_threads()) or real_scores(*a, **k))
    monkeypatch.setattr(links_api, "strongest_links", lambda *a, **k: seen["links"].append(
        torch.get_num_threads()) or real_links(*a, **k))
    monkeypatch.setattr(attention_api, "select_heads", lambda *a, **k: seen["attention"].append(
        torch.get_num_threads()) or real_select(*a, **k))
    text = f"Threads {uuid.uuid4().hex}: the cat sat on the mat."
    for path, body in (("/v1/attention", {"text": text, "encoding": "base64"}),
                       ("/v1/heads", {"text": text}), ("/v1/links", {"text": text, "layer": 0})):
        assert c.post(path, json=body).status_code == 200, path
    assert seen == {"heads": [1], "links": [1], "attention": [1]}
    assert c.portal.call(slot.run, torch.get_num_threads) == 2  # restored
    monkeypatch.setattr(_blas, "SMALL_JOB_TOKENS", 3)  # this text is now "long"
    assert c.post("/v1/links", json={"text": text + " more", "layer": 0}).status_code == 200
    assert seen["links"] == [1, 2]


def test_admitted_work_is_never_refused_but_new_requests_are():
    async def main():
        slot = DeviceSlot(max_queue=0)
        gate = threading.Event()
        first = asyncio.ensure_future(slot.run(gate.wait))  # holds the device
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded):
            await slot.run(lambda: 1)
        second = asyncio.ensure_future(slot.run(lambda: threading.get_ident(), admit=False))
        await asyncio.sleep(0.05)
        assert not second.done()  # queued behind the first, not refused
        gate.set()
        await first
        tid = await second
        assert tid == await slot.run(threading.get_ident)  # always the same thread
        slot.close()

    asyncio.run(main())


def test_cached_only_tokenize_and_cached_forwards(gpt2_runtime):
    rt = gpt2_runtime
    text = f"Fast path {uuid.uuid4().hex}: the cat sat."
    assert rt.tokenize(text, cached_only=True) is None
    tt = rt.tokenize(text)
    assert rt.tokenize(text, cached_only=True) is tt
    with pytest.raises(InvalidRequest, match="max_text_chars"):  # the checks still run
        rt.tokenize("x" * (rt.settings.max_text_chars + 1), cached_only=True)
    assert rt.cached_forwards([tt]) is None
    fw = rt.forward_many([tt])[0]
    hit = rt.cached_forwards([tt])
    assert hit is not None and hit[0].cached and hit[0].tensors is fw.tensors


def test_evicted_values_are_freed_outside_the_lock():
    """Freeing an evicted forward (hundreds of MB at T = 1024) must not hold the lock that the
    event loop takes for cache hits: a value whose finaliser reads the cache would deadlock."""
    c = ByteLRU(10, 10, lambda v: v.size)
    seen = []

    class Val:
        size = 6

        def __del__(self):
            seen.append(c.get("probe") is None)  # takes the cache's lock

    def run():
        c.put("a", Val())
        c.put("b", Val())  # evicts a (6 + 6 > 10)
        c.reserve(10)  # evicts b
        c.put("c", Val())
        c.clear()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout=10)
    assert not th.is_alive(), "deadlock: an evicted value was freed while holding the lock"
    assert seen == [True, True, True]


def test_a_cached_text_is_admitted_at_its_analysis(make_client, gpt2_runtime):
    """Cache hits skip the forward's slot run, so their analysis is their admission: with the
    device busy and max_queue 0 they get 429 at once instead of queueing without bound."""
    c = make_client(gpt2_runtime, max_queue=0)
    text = f"Admission {uuid.uuid4().hex}: the cat sat on the mat."
    assert c.post("/v1/links", json={"text": text, "layer": 0}).status_code == 200  # cached now
    gate = threading.Event()
    fut = c.portal.start_task_soon(c.app.state.slot.run, gate.wait)  # holds the device
    try:
        for path, body in (("/v1/links", {"text": text, "layer": 0}), ("/v1/heads", {"text": text}),
                           ("/v1/verify", {"text": text}), ("/v1/attention", {"text": text})):
            r = c.post(path, json=body)
            assert r.status_code == 429, (path, r.status_code, r.text[:200])
            assert r.json()["error"]["type"] == "overloaded"
            assert r.headers["retry-after"] == "1"
    finally:
        gate.set()
        fut.result(timeout=30)
    assert c.post("/v1/links", json={"text": text, "layer": 0}).status_code == 200


# --- links: ranking ran on the event loop (/healthz waited 12 s behind one request) --------

@pytest.mark.regression
def test_links_do_not_block_the_event_loop(client):
    """Blocked, the loop waited behind the whole ranking (12 s, most of the request): the
    probe on the app's own loop (tests/loop_lag.py) wakes late by the block; here its lags
    while the request runs stay within the idle baseline's bound."""
    from loop_lag import InProcessLag, assert_responsive

    texts = [f"a{j} " + " ".join(["a"] * 200) for j in range(12)]
    client.post("/v1/tokenize", json={"texts": texts})
    with InProcessLag(client) as lag:
        idle = lag.idle()
        with lag.window() as busy:
            r = client.post("/v1/links", json={"texts": texts, "layer": 1, "top_k": 4096})
        assert client.get("/healthz").status_code == 200
    assert r.status_code == 200
    first = r.json()["results"][0]
    assert len(first["links"][-1]["links"]) == len(first["tokens"]) - 1
    # blocked, the loop waited behind the whole ranking: a busy machine slows both alike, so
    # the bound also allows half of the request's span (as the /healthz bound did)
    assert_responsive(idle, busy, "/v1/links", share=0.5)


# ------------------------------------------------------------------ recorded tensors, concurrency
@pytest.mark.regression
def test_concurrent_endpoints_on_a_fresh_text_equal_serial(make_client, gpt2_runtime):
    c = make_client(gpt2_runtime)
    text = "Concurrent stacking check: violet otters juggle seven brass lanterns."
    reqs = [("/v1/verify", {"text": text, "projections": True, "mode": "recorded_qkv"}),
            ("/v1/trajectories", {"text": text, "encoding": "base64"}),
            ("/v1/attention", {"text": text, "include_scores": True, "encoding": "base64"})] * 4
    barrier = threading.Barrier(len(reqs))

    def go(rq):
        barrier.wait()
        return c.post(rq[0], json=rq[1])

    with ThreadPoolExecutor(len(reqs)) as ex:
        conc = list(ex.map(go, reqs))
    serial = [c.post(p, json=b) for p, b in reqs[:3]]
    for i, r in enumerate(conc):
        assert r.status_code == 200, r.text
        a, b = r.json(), serial[i % 3].json()
        a.pop("timing", None), b.pop("timing", None)
        assert a == b


# --------------------------------------------------------------- concurrency, in process
@pytest.mark.regression
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
        # the reference on the tokens the response reports (add_bos null: BOS first, GPT-2)
        ids = list(gpt2_runtime.tokenize(t, add_bos=True).input_ids)
        assert [x["id"] for x in r["attention"]["tokens"]] == ids
        hf = hf_reference(gpt2_runtime, ids)
        assert np.array_equal(decode(r["attention"]["pattern"]), hf["pattern"].numpy())
    m = c.get("/metrics").text
    assert re.search(r"^attnscope_queue_depth 0\.0$", m, re.M), m[-2000:]
    ent = float(re.search(r"^attnscope_cache_entries (\S+)$", m, re.M).group(1))
    nb = float(re.search(r"^attnscope_cache_bytes (\S+)$", m, re.M).group(1))
    assert (ent, nb) == (len(gpt2_runtime.cache), gpt2_runtime.cache.nbytes)
    assert nb == sum(v[1] for v in gpt2_runtime.cache._data.values())


@pytest.mark.regression
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


# --------------------------------------------------------------- a real uvicorn
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


@pytest.fixture(scope="module")
def timeout_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("b4")
    s = start_server(tmp, "--model", "bundled", hold=tmp / "hold",
                     env={"ATTNSCOPE_REQUEST_TIMEOUT_S": "0.3", "ATTNSCOPE_MAX_QUEUE": "64",
                          "ATTNSCOPE_MAX_BATCH": "96"})
    s.hold = tmp / "hold"  # while it exists, every device job waits (tests/lag_serve.py)
    yield s
    stop_server(s)


@pytest.mark.regression
def test_timeouts_and_disconnects_during_device_work(timeout_server, gpt2_runtime):
    url = timeout_server.url
    tag = uuid.uuid4().hex[:6]
    heavy = [f"{tag} {i} " + words(150, (tag, i)) for i in range(96)]
    # 1) a request abandoned at the deadline with its forwards and analysis still to run: the
    # device is held by the test's gate until the 504 is in (on any hardware the work cannot
    # beat the deadline), then let go with the work still to do (96 forwards and their
    # float64 recomputation)
    timeout_server.hold.touch()
    r = httpx.post(url + "/v1/verify", json={"texts": heavy}, timeout=30)
    assert r.status_code == 504, r.text[:300]
    assert r.json()["error"]["type"] == "timeout"
    assert _metric(url, "attnscope_abandoned_requests") == 1
    # 2) clients that disconnect while their work is on the device thread (held there until
    # both are gone, then run for nobody)
    for k in range(2):
        body = httpx.Request("POST", url + "/v1/verify",
                             json={"texts": [t + f" d{k}" for t in heavy], "mode": "recorded_qkv"})
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            raw = (f"POST /v1/verify HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body.content)}\r\n\r\n").encode() + body.content
            s.sendall(raw)
            while _metric(url, "attnscope_queue_depth") < 2 + k:  # it reached the slot
                time.sleep(0.02)
    timeout_server.hold.unlink()
    _settle(url)
    # 3) the service still answers, with the right numbers, from what the abandoned work cached
    for t in heavy[:3] + [heavy[0] + " d1", f"Fresh {tag}"]:
        for _ in range(20):  # a 504 here only says the shared CPUs are busy (0.3 s limit)
            r = httpx.post(url + "/v1/attention", json={"text": t, "encoding": "base64"}, timeout=30)
            if r.status_code != 504:
                break
            _settle(url)  # let that abandoned forward finish (and fill the cache) first
        assert r.status_code == 200, r.text[:300]
        # the reference on the tokens the response reports (add_bos null: BOS first, GPT-2)
        ids = list(gpt2_runtime.tokenize(t, add_bos=True).input_ids)
        assert [x["id"] for x in r.json()["attention"]["tokens"]] == ids
        hf = hf_reference(gpt2_runtime, ids)
        assert np.array_equal(decode(r.json()["attention"]["pattern"]), hf["pattern"].numpy()), t[:60] + " | " + t[-30:]
    assert _metric(url, "attnscope_queue_depth") == 0
    assert timeout_server.proc.poll() is None
    log = timeout_server.log.read_text()
    assert "Traceback" not in log, log[-3000:]
