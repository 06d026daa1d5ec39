"""The global memory budget (issue 17, "A global memory budget"): admission counts the
estimated bytes of ALL in-flight requests against one budget, not each request alone.

Issue 17 measured 3 concurrent 'tril' requests, each under ``max_request_bytes``, peaking at
+4.75 GB together. With the budget, a request is admitted only while the estimates of the
requests in flight (from admission until their response's last byte is sent or the client
goes away) plus its own fit in ``Settings.memory_budget_bytes``; otherwise it waits, first
come first served, up to ``Settings.budget_wait_s``, then gets 429 ``overloaded`` with
``Retry-After``. A request bigger than the whole budget can never fit: 422
``memory_limit_exceeded`` at once. The estimates are the engine's (service/serving/core/memory.py
for the forwards, service/serving/core/estimates.py for the responses and the jobs' tensors).

The default budget (``memory_budget_bytes = 0``: auto) is derived from the machine: the
memory this process may use (cgroup v2/v1 limit or ``MemTotal``, the smaller) minus what it
holds at start-up (RSS: the model's weights, torch, tokenizer), minus the forward cache's
budget (``cache_bytes``), minus a margin of 10% of the usable memory (allocator
fragmentation, Python objects outside the estimates); at least 256 MiB.

Leftover memory (issue 29 item 8): a finished request may leave the process's resident memory
higher than before it (allocator caches, heap not returned to the OS: the security pass saw
3.2-4.9 GB between requests against ~2.15 GB expected). Whenever no request holds the budget,
the budget reads the RSS and counts ``leftover = max(0, RSS - baseline - held() - slack)`` as
in use until the next such reading (``baseline``: the RSS when the budget was made, with the
model loaded; ``held()``: memory other parts own on purpose, e.g. the forward cache's tensors;
``slack``: :data:`LEFTOVER_SLACK`, the heap's own growth and fragmentation), so admission sees
memory that no estimate covers.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections import deque
from typing import Callable

from ...errors import MemoryLimitExceeded, Overloaded

MIN_BUDGET = 256 << 20
#: resident growth over the baseline not counted as leftover (Python heap, thread stacks, the
#: allocator's fragmentation; tests/test_abuse.py's RSS_MARGIN is 384 MiB)
LEFTOVER_SLACK = 256 << 20


def machine_memory_bytes() -> int | None:
    """What this process may use at most: the cgroup memory limit when there is one, else
    the machine's MemTotal (Linux); None where neither can be read."""
    found = []
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = open(path).read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 60:
            found.append(int(raw))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except OSError:
        pass
    return min(found) if found else None


def rss_bytes() -> int:
    """This process's resident memory now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def default_budget(cache_bytes: int) -> int:
    """The auto budget of the module docstring (call once the model is loaded)."""
    total = machine_memory_bytes()
    if total is None:
        return 8 << 30
    usable = total - rss_bytes() - cache_bytes
    return max(MIN_BUDGET, int(usable - 0.10 * total))


class Ticket:
    """Bytes held in the budget by one request; :meth:`release` (idempotent) gives them back."""

    __slots__ = ("budget", "nbytes", "_held")

    def __init__(self, budget: "MemoryBudget", nbytes: int):
        self.budget, self.nbytes, self._held = budget, nbytes, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.budget._give_back(self.nbytes)


class MemoryBudget:
    """Estimated bytes of the requests in flight, against ``total`` (0 = unlimited).

    Single event loop: ``acquire`` and ``release`` run on it (no lock needed). Waiters are
    served in arrival order: a big request at the head is not overtaken forever by small ones.
    """

    def __init__(self, total: int, wait_s: float = 5.0, *,
                 rss: Callable[[], int] = rss_bytes, held: Callable[[], int] | None = None,
                 slack: int = LEFTOVER_SLACK):
        self.total = int(total)
        self.wait_s = float(wait_s)
        self.in_use = 0
        self.peak = 0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()
        self._rss, self._held, self.slack = rss, held, int(slack)
        self.baseline = rss() if self.total > 0 else 0
        #: resident bytes above the baseline that no request in flight accounts for, read
        #: when the budget was last idle (module docstring); counted like ``in_use``
        self.leftover = 0

    def measure_leftover(self) -> int:
        """Read the leftover (module docstring) now; call only while nothing is in use.
        Returns it."""
        held = int(self._held()) if self._held is not None else 0
        self.leftover = max(0, int(self._rss()) - self.baseline - held - self.slack)
        return self.leftover

    def _fits(self, n: int) -> bool:
        return self.in_use + self.leftover + n <= self.total

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, nbytes: int) -> Ticket:
        """Hold ``nbytes`` for a request: at once when they fit, else after waiting (at most
        ``wait_s``) for requests in flight to finish.

        Raises:
            MemoryLimitExceeded: ``nbytes`` exceeds the whole budget (422: it never fits).
            Overloaded: still no room after ``wait_s`` (429, ``Retry-After``).
        """
        n = max(0, int(nbytes))
        if self.total <= 0:
            return Ticket(self, 0)
        if n > self.total:
            raise MemoryLimitExceeded(
                f"this request needs an estimated {n} bytes of memory; the service's whole "
                f"memory budget is {self.total} bytes (memory_budget_bytes). Send fewer or "
                "shorter texts, select layers/heads, or use the sparse, 'tril' or base64 "
                "float16 encodings", "texts")
        if self.in_use == 0:
            self.measure_leftover()
        if not self._waiters and self._fits(n):
            return self._take(n)
        fut = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.wait_s)
        except asyncio.TimeoutError:
            if fut.done() and not fut.cancelled():  # granted at the last moment
                return fut.result()
            self._drop(entry)
            retry = max(1, math.ceil(self.wait_s))
            left = (f" (and {self.leftover} bytes left resident by earlier requests)"
                    if self.leftover else "")
            err = Overloaded(
                f"the service is busy: the requests in flight hold {self.in_use}{left} of its "
                f"{self.total} bytes of memory budget (memory_budget_bytes) and this one needs "
                f"{n}; waited {self.wait_s:g} s (budget_wait_s). Retry later")
            err.headers = {"Retry-After": str(retry)}
            raise err from None
        except BaseException:
            if fut.done() and not fut.cancelled():
                fut.result().release()  # granted, but the request went away
            else:
                self._drop(entry)
            raise
        return fut.result()

    def _take(self, n: int) -> Ticket:
        self.in_use += n
        self.peak = max(self.peak, self.in_use)
        return Ticket(self, n)

    def _drop(self, entry) -> None:
        try:
            self._waiters.remove(entry)
        except ValueError:
            pass
        entry[1].cancel()
        self._grant()

    def _give_back(self, n: int) -> None:
        self.in_use -= n
        if self.in_use == 0 and self.total > 0:
            self.measure_leftover()
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if not self._fits(n):
                return
            self._waiters.popleft()
            fut.set_result(self._take(n))
