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
"""

from __future__ import annotations

import asyncio
import math
import os
from collections import deque

from ...errors import MemoryLimitExceeded, Overloaded

MIN_BUDGET = 256 << 20


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

    def __init__(self, total: int, wait_s: float = 5.0):
        self.total = int(total)
        self.wait_s = float(wait_s)
        self.in_use = 0
        self.peak = 0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

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
        if not self._waiters and self.in_use + n <= self.total:
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
            err = Overloaded(
                f"the service is busy: the requests in flight hold {self.in_use} of its "
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
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self.in_use + n > self.total:
                return
            self._waiters.popleft()
            fut.set_result(self._take(n))
