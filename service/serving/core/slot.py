"""One device slot with bounded admission (TGI's router pattern: semaphore, Overloaded -> 429).

Forward passes run one at a time on the slot's own thread (always the same OS thread); at most
``max_queue`` requests wait. A request arriving when the queue is full is refused at once with
:class:`Overloaded`. The event loop never blocks on torch.

Why one fixed thread rather than any thread of anyio's pool: glibc gives each thread its own
malloc arena, and memory freed into one arena serves only allocations made from it. When the
forward ran on whichever pool thread was free, the tensors the forward cache evicted were freed
into other threads' arenas, so at steady state every GPT-2-small forward at 128 tokens still
faulted in ~14k fresh pages (~55 MB) and the heap's free memory grew until it was trimmed.
The analyses' own torch work (head scores, links, encoding the pattern, verify) runs on the same
thread, in the same turn as the request's forwards (``service/serving/core/engine.py``): each OS thread that runs a parallel torch op gets its own
OpenMP team, and once the teams' threads outnumber the cores libgomp stops spinning between
parallel regions, so every op waits for its team to wake up. Measured on 2 cores (GPT-2 small,
T = 128): /v1/verify's recomputation 19-20 ms with one team, 27-29 ms once a second thread had
run torch ops.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import anyio

from ...errors import Overloaded

T = TypeVar("T")


class DeviceSlot:
    def __init__(self, max_queue: int, max_request_bytes: int = 0):
        self.max_queue = max_queue
        #: the app's per-request memory limit (0 = none), checked before a forward is admitted
        self.max_request_bytes = max_request_bytes
        self._limiter = anyio.CapacityLimiter(1)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnscope-device")
        self._lock = threading.Lock()
        self._pending = 0  # waiting + running

    @property
    def depth(self) -> int:
        """Requests waiting for or holding the device."""
        return self._pending

    async def run(self, fn: Callable[..., T], *args, admit: bool = True) -> T:
        """Run ``fn(*args)`` on the slot's thread when the device is free (first come, first
        served). A request cancelled while waiting leaves the queue; once ``fn`` has started it
        runs to the end and the caller waits for it (as ``anyio.to_thread.run_sync``).
        ``admit=False``: work of a request already admitted (its analysis after its forward),
        never refused.

        Raises:
            Overloaded: ``max_queue`` requests are already waiting (429 at once; ``admit``).
        """
        with self._lock:
            if admit and self._pending >= self.max_queue + 1:
                raise Overloaded(
                    f"the service is busy: {self._pending - 1} requests are waiting for the "
                    f"device (max_queue={self.max_queue}); retry later"
                )
            self._pending += 1
        try:
            async with self._limiter:
                ctx = contextvars.copy_context()  # the request id etc. reach the thread's logs
                fut = self._executor.submit(ctx.run, fn, *args)
                with anyio.CancelScope(shield=True):
                    return await asyncio.wrap_future(fut)
        finally:
            with self._lock:
                self._pending -= 1

    def close(self) -> None:
        """Let the slot's thread end once its current work is done (app shutdown)."""
        self._executor.shutdown(wait=False)
