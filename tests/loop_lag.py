"""Event-loop responsiveness measured on the loop itself, not by a wall-clock bound on a
request: a probe task on the server's event loop sleeps 10 ms again and again and records how
late it wakes (its *lag*). A loop blocked by synchronous work (a JSON encode, a ranking, a
parse on the loop) wakes it late by as long as the block; a busy machine makes every wake a
little late, idle or not. So a test takes an idle baseline first, in the same test, then the
lags while the heavy request runs, and :func:`assert_responsive` bounds the second by the
first: ``RATIO`` times the idle worst plus ``MARGIN_S`` (generous: on an idle 2-core machine
the idle worst is a few ms, the bound ~1 s, the old /healthz figure; the regressions these
tests pin blocked the loop for seconds). A test whose request is long may also allow a
``share`` of the request's own span (as measured by the same probe: its wakes and their lags),
so a loaded machine that stretches the request stretches the bound with it.

* :class:`InProcessLag` probes an in-process app: the loop of a ``TestClient`` (its anyio
  portal, where the app's requests run);
* :class:`ServerLag` reads the probe of a real uvicorn started by ``conftest.start_server(...,
  lag_log=path)``: ``tests/lag_serve.py`` runs ``attnscope serve`` with the probe on its loop,
  writing one lag a line.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager
from pathlib import Path

PERIOD_S = 0.01
RATIO = 10.0
MARGIN_S = 1.0
WAIT_S = 300  # a safety net against a probe that stopped, never a figure


async def probe(record) -> None:
    """Sleep ``PERIOD_S`` forever, calling ``record(lag)`` after each wake."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(PERIOD_S)
        record(max(0.0, loop.time() - t - PERIOD_S))


class _Lags:
    def samples(self) -> list[float]:
        raise NotImplementedError

    def _wait_count(self, n: int) -> None:
        raise NotImplementedError

    def idle(self, n: int = 100) -> list[float]:
        """``n`` fresh lags with nothing else asked of the loop (the baseline)."""
        start = len(self.samples())
        self._wait_count(start + n)
        return self.samples()[start:start + n]

    @contextmanager
    def window(self):
        """The lags of the wakes during the ``with`` block (and the one that spans its end);
        a list, filled when the block ends."""
        got: list[float] = []
        start = len(self.samples())
        yield got
        end = len(self.samples()) + 1
        self._wait_count(end)
        got.extend(self.samples()[start:end])


class InProcessLag(_Lags):
    """The probe on a ``TestClient``'s event loop (the client must be entered)."""

    def __init__(self, client):
        self._client = client
        self._lags: list[float] = []
        self._cond = threading.Condition()

    def _record(self, lag: float) -> None:
        with self._cond:
            self._lags.append(lag)
            self._cond.notify_all()

    def __enter__(self):
        assert self._client.portal is not None, "enter the TestClient first"
        self._future = self._client.portal.start_task_soon(probe, self._record)
        return self

    def __exit__(self, *exc):
        self._future.cancel()

    def samples(self) -> list[float]:
        with self._cond:
            return list(self._lags)

    def _wait_count(self, n: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self._lags) >= n, WAIT_S), \
                f"the loop probe stopped at {len(self._lags)} of {n} wakes"


class ServerLag(_Lags):
    """The lags a server started with ``lag_log=path`` writes (tests/lag_serve.py)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def samples(self) -> list[float]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        return [float(x) for x in text.split("\n")[:-1] if x]  # the last line may be partial

    def _wait_count(self, n: int) -> None:
        deadline = time.monotonic() + WAIT_S  # a safety net, not a figure
        while len(self.samples()) < n:
            assert time.monotonic() < deadline, \
                f"the server's loop probe stopped at {len(self.samples())} of {n} wakes"
            time.sleep(0.02)


def bound(idle: list[float], busy: list[float] | None = None, share: float = 0.0) -> float:
    """``RATIO`` x the idle worst + ``MARGIN_S``, or ``share`` of ``busy``'s span if more."""
    span = sum(busy) + PERIOD_S * len(busy) if busy else 0.0
    return max(RATIO * max(idle) + MARGIN_S, share * span)


def assert_responsive(idle: list[float], busy: list[float], what: str = "",
                      share: float = 0.0) -> None:
    """The loop stayed responsive during ``busy``: at least 3 wakes, and the latest no later
    than :func:`bound` (``RATIO`` x the idle worst + ``MARGIN_S``, or ``share`` of the
    request's span)."""
    assert idle and busy, (what, len(idle), len(busy))
    b = bound(idle, busy, share)
    assert max(busy) <= b, (f"{what}: the event loop was blocked: woke {max(busy):.3f} s late "
                            f"(idle worst {max(idle):.3f} s, bound {b:.3f} s); the 5 latest "
                            f"{sorted(busy)[-5:]}")
    assert len(busy) >= 3, f"{what}: only {len(busy)} wakes while it ran"
