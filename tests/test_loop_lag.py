"""tests/loop_lag.py's probe (the event-loop responsiveness check of the abuse, e2e and device
slot tests): a planted block on the loop fails it; the same work off the loop passes."""

from __future__ import annotations

import asyncio
import time

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from loop_lag import PERIOD_S, InProcessLag, assert_responsive, bound

BLOCK: dict = {}


async def on_loop(request):
    time.sleep(BLOCK["s"])  # the planted fault: synchronous work on the event loop
    return PlainTextResponse("done")


async def off_loop(request):
    await asyncio.to_thread(time.sleep, BLOCK["s"])
    return PlainTextResponse("done")


@pytest.fixture
def client():
    app = Starlette(routes=[Route("/on", on_loop), Route("/off", off_loop)])
    with TestClient(app) as c:
        yield c


def test_work_off_the_loop_passes_and_a_block_on_it_fails(client):
    with InProcessLag(client) as lag:
        idle = lag.idle()
        BLOCK["s"] = 2 * bound(idle)  # longer than the bound, whatever the machine's load
        with lag.window() as off:
            assert client.get("/off").text == "done"
        with lag.window() as on:
            assert client.get("/on").text == "done"
    assert_responsive(idle, off, "off the loop")
    assert max(on) >= BLOCK["s"] - PERIOD_S  # the wake that spanned the block: late by it
    with pytest.raises(AssertionError, match="event loop was blocked"):
        assert_responsive(idle, on, "on the loop")
