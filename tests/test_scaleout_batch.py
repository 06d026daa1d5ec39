"""``attnscope batch`` (clients/python/attnscope/client/batch.py) under the faults a load
balancer in front of replicas produces: non-JSON answers from the proxy, and a run whose
workers must all finish before the files close. The real app on the bundled model answers;
an httpx transport in front of it plants the fault (as in tests/test_client.py)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from attnscope.client import AsyncClient
from attnscope.client.batch import run_batch


def _app(runtime):
    from attnscope.service.app import create_app
    from attnscope.service.config import Settings

    return create_app(Settings(model="bundled"), runtime=runtime)


def _ids(path) -> list:
    try:
        with open(path) as f:
            return [json.loads(line)["id"] for line in f if line.strip()]
    except FileNotFoundError:
        return []


async def _run(app, transport, lines, out, fails, concurrency):
    """run_batch through ``transport`` with ``app``'s lifespan running (ASGITransport does not
    run it)."""
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=transport) as http:
            c = AsyncClient("http://app", http_client=http, max_retries=0)
            return await run_batch(c, lines, out, fails, {"tokenize": {}},
                                   concurrency=concurrency, progress=False)


def test_proxy_page_with_200_is_a_recorded_failure(gpt2_runtime, tmp_path):
    """Regression (batch lost the run on a non-JSON 2xx): a proxy or captive portal answering
    200 with an HTML page raised APIResponseValidationError out of run_batch, which ended the
    whole run. Now the item is a recorded failure ('invalid_response', with the status) and the
    others complete; every id is in exactly one file."""
    real = _app(gpt2_runtime)
    app = httpx.ASGITransport(app=real)

    async def handler(request):
        if json.loads(request.content)["text"] == "portal":
            return httpx.Response(200, text="<html>please log in</html>",
                                  headers={"content-type": "text/html"})
        return await app.handle_async_request(request)

    texts = ["a b", "portal", "c d e", "f"]
    lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(texts)]
    out, fails = str(tmp_path / "o.jsonl"), str(tmp_path / "f.jsonl")
    s = asyncio.run(_run(real, httpx.MockTransport(handler), lines, out, fails, 2))
    assert (s.done, s.failed, s.stopped) == (3, 1, None)
    assert s.failed_types == {"invalid_response": 1}
    rec = json.loads(open(fails).read())
    assert rec["id"] == 1 and rec["error"]["status"] == 200 and rec["analysis"] == "tokenize"
    assert sorted(_ids(out)) == [0, 2, 3]
    # the answers are the service's own
    for line in open(out):
        obj = json.loads(line)
        assert obj["results"]["tokenize"]["model"]["id"] == gpt2_runtime.info["id"]


def test_unexpected_error_lets_items_in_flight_finish(gpt2_runtime, tmp_path):
    """Regression (batch dropped the items in flight beside a crash): an unexpected exception in
    one worker left asyncio.gather at once; the files were closed while the other workers still
    held requests, which were then cancelled, unrecorded. Now no new item starts, the items in
    flight finish and are written, the error propagates, and a second run does the rest: every
    id exactly once."""
    real = _app(gpt2_runtime)
    app = httpx.ASGITransport(app=real)
    state = {"started": 0, "armed": True}
    all_in = asyncio.Event()
    crashed = asyncio.Event()

    async def handler(request):
        text = json.loads(request.content)["text"]
        if state["armed"]:
            state["started"] += 1
            if state["started"] == 4:
                all_in.set()
            await all_in.wait()  # four requests in flight at once
            if text == "boom":
                crashed.set()
                raise RuntimeError("planted client-side bug")
            await crashed.wait()
            for _ in range(5):  # let the crash reach run_batch before these answer
                await asyncio.sleep(0)
        return await app.handle_async_request(request)

    texts = ["one", "two", "boom", "three"] + [f"later {i}" for i in range(6)]
    lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(texts)]
    out, fails = str(tmp_path / "o.jsonl"), str(tmp_path / "f.jsonl")
    with pytest.raises(RuntimeError, match="planted"):
        asyncio.run(_run(real, httpx.MockTransport(handler), lines, out, fails, 4))
    assert sorted(_ids(out)) == [0, 1, 3]  # the three in flight beside the crash
    assert _ids(fails) == []
    state["armed"] = False  # the "fixed" client: the rest, and the crashed one, run now
    s = asyncio.run(_run(real, httpx.MockTransport(handler), lines, out, fails, 4))
    assert (s.done, s.skipped, s.failed) == (7, 3, 0)
    ids = _ids(out)
    assert sorted(ids) == list(range(10)) and len(ids) == len(set(ids))
