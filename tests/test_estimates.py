"""Every endpoint's response is inside its memory estimate, and the global memory budget
admits, waits, refuses and gives back (issue 17, "Bounded cost" points 2 and 3).

The estimates (service/serving/core/estimates.py, codecs.estimate_encoded_bytes) are what the
engine counts against ``max_request_bytes`` and the budget; the response body is the part of
a request's memory that is easy to measure exactly, so each request below checks
``len(body) <= Plan.response_bytes`` against the real app on the bundled model.
"""

from __future__ import annotations

import asyncio
import mmap
import numpy as np
import pytest

from attnscope import schemas
from attnscope.service.errors import MemoryLimitExceeded, Overloaded
from attnscope.service.serving.core.budget import MemoryBudget, default_budget, machine_memory_bytes
from attnscope.service.serving import attention, heads, links, scratch, trajectories, verify

LONG = " ".join(f"w{i % 97} and" for i in range(62))  # ~240 tokens of the bundled tokenizer

CASES = [
    ("/v1/attention", attention, schemas.AttentionRequest, {"text": LONG}),
    ("/v1/attention", attention, schemas.AttentionRequest, {"text": LONG, "round": 3}),
    ("/v1/attention", attention, schemas.AttentionRequest,
     {"texts": [LONG, LONG[:200]], "layout": "tril", "include_scores": True}),
    ("/v1/attention", attention, schemas.AttentionRequest,
     {"text": LONG, "sparse": {"threshold": 5e-324, "format": "coo"}}),
    ("/v1/attention", attention, schemas.AttentionRequest,
     {"text": LONG, "sparse": {"top_k": 4}, "encoding": "base64", "dtype": "float16"}),
    ("/v1/trajectories", trajectories, schemas.TrajectoriesRequest,
     {"texts": [LONG, LONG[:300]], "n_components": 128}),
    ("/v1/links", links, schemas.LinksRequest, {"texts": [LONG] * 2, "layer": 1, "top_k": 256}),
    ("/v1/heads", heads, schemas.HeadsRequest, {"texts": [LONG, "a b c d"]}),
    ("/v1/verify", verify, schemas.VerifyRequest, {"text": LONG, "mode": "recorded_qkv", "projections": True}),
    ("/v1/scratch-attention", scratch, schemas.ScratchAttentionRequest,
     {"text": LONG[:400], "n_heads": 4}),
    ("/v1/scratch-attention", scratch, schemas.ScratchAttentionRequest,
     {"q": np.ones((64, 32)).tolist(), "k": np.ones((96, 32)).tolist(),
      "v": np.ones((96, 16)).tolist(), "n_heads": 2}),
]


@pytest.mark.parametrize("path,serving,model,body", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_response_is_inside_its_estimate(client, gpt2_runtime, path, serving, model, body):
    rt = gpt2_runtime
    req = model(**body)
    items = ([] if path == "/v1/scratch-attention"
             else [rt.tokenize(t, req.add_bos) for t in req.all_texts()])
    est = serving.plan(rt, req, items).response_bytes
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text[:300]
    assert 0 < len(r.content) <= est, (len(r.content), est)


def test_an_estimate_that_is_too_small_fails_the_check(client, gpt2_runtime):
    """Planted fault: the same comparison sees a response larger than a shrunk estimate."""
    req = schemas.AttentionRequest(text=LONG)
    items = [gpt2_runtime.tokenize(LONG)]
    est = attention.plan(gpt2_runtime, req, items).response_bytes
    r = client.post("/v1/attention", json={"text": LONG})
    assert not len(r.content) <= est // 20


# ------------------------------------------------------------------------------- budget
def test_budget_admits_waits_in_order_and_refuses():
    async def main():
        b = MemoryBudget(100, wait_s=30)
        t1 = await b.acquire(60)
        order = []

        async def want(n, tag):
            t = await b.acquire(n)
            order.append(tag)
            return t

        w1 = asyncio.create_task(want(50, "big"))
        await asyncio.sleep(0)
        w2 = asyncio.create_task(want(10, "small"))  # fits now, but waits behind "big"
        await asyncio.sleep(0.01)
        assert order == [] and b.waiting == 2 and b.in_use == 60
        t1.release()
        t1.release()  # idempotent
        ta, tb = await w1, await w2
        assert order == ["big", "small"] and b.in_use == 60
        with pytest.raises(MemoryLimitExceeded):
            await b.acquire(101)  # never fits: 422 at once
        quick = MemoryBudget(100, wait_s=0.05)
        held = await quick.acquire(90)
        with pytest.raises(Overloaded) as e:
            await quick.acquire(20)
        assert e.value.status == 429 and int(e.value.headers["Retry-After"]) >= 1
        assert quick.waiting == 0 and quick.in_use == 90
        held.release()
        assert quick.in_use == 0
        ta.release(), tb.release()
        assert b.in_use == 0 and b.peak == 60  # never over the budget
    asyncio.run(main())


def test_budget_default_is_derived_from_the_machine():
    total = machine_memory_bytes()
    assert total and total > 1 << 30
    d = default_budget(1 << 30)
    assert 256 << 20 <= d < total


def test_concurrent_requests_over_the_budget_get_429_and_the_budget_is_given_back(
        make_client, gpt2_runtime):
    """Each request fits the budget alone; two at once do not: while one streams its big
    response (held open by a client that does not read), the other waits budget_wait_s and
    gets 429 with Retry-After. Once the first ends, the budget is back to 0 and a request
    passes."""
    body = {"text": LONG + " fresh budget text", "layout": "tril", "include_scores": True}
    req = schemas.AttentionRequest(**body)
    rt = gpt2_runtime
    from attnscope.service.serving.core.memory import check_memory

    need = check_memory(rt, [len(rt.tokenize(body["text"]))],
                        attention.plan(rt, req, [rt.tokenize(body["text"])]).response_bytes)
    c = make_client(rt, memory_budget_bytes=int(need * 1.5), budget_wait_s=0.2)
    app = c.app
    assert c.post("/v1/attention", json=body).status_code == 200
    budget = app.state.budget
    assert budget.in_use == 0 and budget.total == int(need * 1.5)
    # hold one request in flight: a ticket of the same size, as a streaming response holds it
    loop_ticket = c.portal.call(budget.acquire, need)
    r = c.post("/v1/attention", json=body)
    assert r.status_code == 429, r.text[:200]
    assert r.json()["error"]["type"] == "overloaded" and r.headers["retry-after"] == "1"
    c.portal.call(loop_ticket.release)
    assert budget.in_use == 0
    assert c.post("/v1/attention", json=body).status_code == 200
    assert budget.in_use == 0


def test_budget_counts_resident_memory_left_by_finished_requests():
    """Leftover RSS (issue 29 item 8): memory a finished request leaves resident (here 400 MiB
    of real, touched pages held after its ticket went back) is counted in use when the budget
    is next idle: a request that fits the estimates alone waits and gets 429 naming the
    leftover; once the memory is freed the same request is admitted. Planted fault: without
    the leftover the first acquire is granted."""
    from attnscope.service.serving.core.budget import rss_bytes

    async def main():
        b = MemoryBudget(1 << 30, wait_s=0.05, slack=64 << 20)
        t = await b.acquire(100 << 20)
        hog = mmap.mmap(-1, 400 << 20)  # the request's allocation, still resident after it
        for _ in range(400):  # touched: resident (one mapping, whatever the allocator)
            hog.write(b"\x01" * (1 << 20))
        t.release()
        assert b.in_use == 0 and b.leftover >= (400 - 64 - 32) << 20, b.leftover
        with pytest.raises(Overloaded) as e:
            await b.acquire(800 << 20)  # fits the estimates (0 in use), not the leftover
        assert "left resident by earlier requests" in e.value.args[0]
        before = rss_bytes()
        hog.close()  # munmap
        assert rss_bytes() < before - (300 << 20)
        ok = await b.acquire(800 << 20)
        assert b.leftover < 300 << 20
        ok.release()
    asyncio.run(main())


def test_the_engines_budget_does_not_count_the_forward_cache_as_leftover(client, gpt2_runtime):
    """The engine's budget is told what the forward cache holds on purpose (``held``), so
    cached forwards are not counted again as memory left by finished requests (the automatic
    budget already subtracts cache_bytes). Planted fault: a budget without ``held`` reads 0."""
    r = client.post("/v1/attention", json={"text": "the forward cache is held on purpose"})
    assert r.status_code == 200, r.text
    b = client.app.state.engine.budget
    assert b._held is not None
    assert b._held() == gpt2_runtime.cache.nbytes > 0
    assert MemoryBudget(1 << 30)._held is None  # (the fault the engine's budget must not have)
