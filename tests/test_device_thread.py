"""The device slot's own thread, the forward's contiguous buffers, evict-before-forward, and the
cache-hit fast paths (service/runtime/slot.py, model.py, cache.py, api/common.py)."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
import torch

from attnscope.service.config import Settings
from attnscope.service.errors import InvalidRequest, Overloaded
from attnscope.service.runtime import Runtime
from attnscope.service.runtime.cache import ByteLRU
from attnscope.service.runtime.slot import DeviceSlot


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
    handle = gpt2_runtime.adapter.base().register_forward_hook(
        lambda *a: seen["forward"].add(threading.get_ident()))
    real_scores, real_verify = H.head_scores, V.verify_from_scratch
    monkeypatch.setattr(heads_api.H, "head_scores",
                        lambda *a, **k: seen["heads"].add(threading.get_ident()) or real_scores(*a, **k))
    monkeypatch.setattr(verify_api, "verify_from_scratch",
                        lambda *a, **k: seen["verify"].add(threading.get_ident()) or real_verify(*a, **k))
    try:
        text = f"Thread test {uuid.uuid4().hex}: the cat sat on the mat."
        for path, body in (("/v1/attention", {"text": text, "encoding": "base64"}),
                           ("/v1/heads", {"text": text}), ("/v1/links", {"text": text, "layer": 0}),
                           ("/v1/verify", {"text": text}),
                           ("/v1/attention", {"text": text + " again", "sparse": {"top_k": 2}})):
            assert c.post(path, json=body).status_code == 200, path
    finally:
        handle.remove()
    assert seen["forward"] == seen["heads"] == seen["verify"] == {slot_thread}


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
