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


# --- /v1/links: a million gc-tracked objects set off full collections ----------------------
# A links body of 2 x 1,000 tokens with top_k 4,096 held ~1M Link dataclass objects (each one
# tracked by the cyclic garbage collector) while it was built: full (generation 2) collections
# on the device thread, 0.1-0.3 s each with the start-up objects frozen, 0.25-0.35 s without,
# each holding the GIL and so the event loop (faulthandler watchdog on the loop, gc.callbacks).
# Now the links are lists of ints and floats and the body dicts of atomic values, which the
# collector does not track: the tracked objects grow with the queries, not with the links.


def _tracked(obj) -> tuple[int, int]:
    """(objects the cyclic collector tracks, objects) reachable from ``obj`` through dicts,
    lists, tuples and dataclass fields."""
    import dataclasses
    import gc

    tracked = total = 0
    stack = [obj]
    while stack:
        x = stack.pop()
        total += 1
        tracked += gc.is_tracked(x)
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif dataclasses.is_dataclass(x):
            stack.extend(getattr(x, f.name) for f in dataclasses.fields(x))
    return tracked, total


def _links_job(gpt2_runtime):
    from attnscope.schemas import LinksRequest
    from attnscope.service.analysis.links import strongest_links
    from attnscope.service.serving import links as links_api

    text = " ".join(f"w{i % 89} x" for i in range(50))
    fw = gpt2_runtime.forward_many([gpt2_runtime.tokenize(text)])[0]
    req = LinksRequest(text=text, layer=0, top_k=4096)
    found = strongest_links(fw.pattern[0].mean(0), 4096)
    return fw.n_tokens, found, links_api._build(req, [fw])


def test_a_links_job_makes_no_gc_tracked_object_per_link(gpt2_runtime):
    n, found, body = _links_job(gpt2_runtime)
    n_links = sum(len(ql.keys) for ql in found)
    assert n > 150 and n_links > 10_000, (n, n_links)
    for what, obj in (("strongest_links", found), ("the body", body)):
        tracked, total = _tracked(obj)
        assert total > n_links and tracked <= 4 * n + 20, (what, tracked, total, n, n_links)


def test_planted_fault_link_objects_are_counted(gpt2_runtime, monkeypatch):
    from attnscope.service.analysis import links as Lk

    @dataclasses_frozen
    class OldQueryLinks:  # the old shape: one tracked Link object per link
        query_pos: int
        links: tuple

    n, found, _ = _links_job(gpt2_runtime)
    old = [OldQueryLinks(ql.query_pos, ql.links) for ql in found]
    assert all(isinstance(x, Lk.Link) for x in old[-1].links)
    tracked, _ = _tracked(old)
    assert tracked > 4 * n + 20  # what the test above refuses


def dataclasses_frozen(cls):
    import dataclasses

    return dataclasses.dataclass(frozen=True)(cls)
