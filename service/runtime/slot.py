"""One device slot with bounded admission (TGI's router pattern: semaphore, Overloaded -> 429).

Forward passes run in a worker thread, one at a time; at most ``max_queue`` requests wait.
A request arriving when the queue is full is refused at once with :class:`Overloaded`.
The event loop never blocks on torch.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

import anyio
import anyio.to_thread

from attnscope.service.errors import Overloaded

T = TypeVar("T")


class DeviceSlot:
    def __init__(self, max_queue: int, max_request_bytes: int = 0):
        self.max_queue = max_queue
        #: the app's per-request memory limit (0 = none), checked before a forward is admitted
        self.max_request_bytes = max_request_bytes
        self._limiter = anyio.CapacityLimiter(1)
        self._lock = threading.Lock()
        self._pending = 0  # waiting + running

    @property
    def depth(self) -> int:
        """Requests waiting for or holding the device."""
        return self._pending

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Run ``fn(*args)`` in a worker thread when the device is free.

        Raises:
            Overloaded: ``max_queue`` requests are already waiting (429 at once).
        """
        with self._lock:
            if self._pending >= self.max_queue + 1:
                raise Overloaded(
                    f"the service is busy: {self._pending - 1} requests are waiting for the "
                    f"device (max_queue={self.max_queue}); retry later"
                )
            self._pending += 1
        try:
            return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        finally:
            with self._lock:
                self._pending -= 1
