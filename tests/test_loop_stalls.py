"""The event loop never walks a response body (issue 29 item 8, "The event loop never waits on
compute"): :func:`attnscope.service.encoding.responses.respond` sizes the body (one visit of
every object: a /v1/links body of 2 x 1,000 tokens and ``top_k`` 4,096 holds ~1M dicts, ~1 s
of Python) in a worker thread, which gives the GIL back every switch interval, never on the
loop. bench/loop_stalls.py measures the lag on a GPT-2-small-shaped model; here the walk's
thread is recorded by a list subclass in the body (its ``__iter__`` runs wherever the walk
runs; orjson serializes list subclasses without calling it)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import orjson
import pytest

from attnscope.service.encoding import responses


class _Spy(list):
    """A list that records the thread of every Python-level iteration over it."""

    def __init__(self, items, seen):
        super().__init__(items)
        self.seen = seen

    def __iter__(self):
        self.seen.append(threading.get_ident())
        return super().__iter__()


def _walk_threads(body_of, on_loop: bool) -> tuple[int, list[int], bytes]:
    """respond() on a fresh loop: (the loop's thread, the threads that walked the spy list,
    the response's bytes)."""
    seen: list[int] = []
    old = responses.SIZE_ON_LOOP
    responses.SIZE_ON_LOOP = on_loop

    async def main():
        loop_thread = threading.get_ident()
        resp = await responses.respond(body_of(seen))
        out = []

        async def receive():
            await asyncio.sleep(3600)

        async def send(msg):
            out.append(msg.get("body", b""))

        await resp({"type": "http", "path": "/x"}, receive, send)
        return loop_thread, b"".join(out)

    try:
        loop_thread, content = asyncio.run(main())
    finally:
        responses.SIZE_ON_LOOP = old
    return loop_thread, seen, content


def _small(seen):  # a one-shot body: a list of small dicts
    return {"links": _Spy([{"key_pos": i, "weight": 0.5} for i in range(300)], seen)}


def _big(seen):  # a streamed body: arrays past STREAM_MIN_BYTES and a list of dicts
    return {"a": np.ones(responses.STREAM_MIN_BYTES // 8 + 1),
            "links": _Spy([{"key_pos": i} for i in range(300)], seen)}


@pytest.mark.parametrize("body_of", [_small, _big], ids=["one-shot", "streamed"])
def test_the_response_body_is_sized_off_the_event_loop(body_of):
    loop_thread, seen, content = _walk_threads(body_of, on_loop=False)
    assert seen and loop_thread not in seen, (loop_thread, seen)
    got = orjson.loads(content)
    assert len(got["links"]) == 300 and got["links"][7] == body_of([])["links"][7]


def test_planted_fault_the_size_walk_on_the_loop_is_seen():
    loop_thread, seen, _ = _walk_threads(_small, on_loop=True)
    assert loop_thread in seen  # what the test above refuses
