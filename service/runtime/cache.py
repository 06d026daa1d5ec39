"""A bounded LRU cache of forward results, bounded by entry count and by tensor bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

V = TypeVar("V")


class ByteLRU(Generic[V]):
    """Thread-safe LRU: evicts least-recently-used entries beyond ``max_entries`` or ``max_bytes``.

    An item larger than ``max_bytes`` on its own is not stored. ``size_of(value)`` gives bytes.
    """

    def __init__(self, max_entries: int, max_bytes: int, size_of):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._data: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            item = self._data.get(key)
            if item is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return item[0]

    def get_all(self, keys: list[Hashable]) -> list[V] | None:
        """The values of all ``keys`` (each counted as a hit and made most recent), or None
        when any is missing (then nothing is counted or moved)."""
        with self._lock:
            items = [self._data.get(k) for k in keys]
            if any(item is None for item in items):
                return None
            for k in keys:
                self._data.move_to_end(k)
            self.hits += len(keys)
            return [item[0] for item in items]

    def put(self, key: Hashable, value: V) -> None:
        size = self._size_of(value)
        dropped = []  # freed after the lock is released (freeing big tensors takes time)
        with self._lock:
            if key in self._data:
                old, s = self._data.pop(key)
                self._bytes -= s
                dropped.append(old)
            if self.max_entries <= 0 or size > self.max_bytes:
                return
            self._data[key] = (value, size)
            self._bytes += size
            self._evict(0, 0, dropped)
        del dropped

    def reserve(self, size: int, entries: int = 1) -> None:
        """Evict least-recently-used entries now so that ``entries`` new items of ``size``
        bytes in all will fit (nothing when they would not be stored anyway). The runtime calls
        it before a forward: the evicted tensors' memory is then free when the forward's own
        are allocated, and is reused for them (the same sizes, for texts of the same length)."""
        dropped = []  # freed after the lock is released: the event loop also takes it
        with self._lock:
            if self.max_entries <= 0 or size > self.max_bytes:
                return
            self._evict(size, entries, dropped)
        del dropped

    def _evict(self, size: int, entries: int, dropped: list) -> None:
        """Under the lock: pop least-recently-used entries into ``dropped`` until ``entries``
        more items of ``size`` bytes in all fit (0, 0: until the bounds hold)."""
        while self._data and (len(self._data) + entries > self.max_entries
                              or self._bytes + size > self.max_bytes):
            _, (v, s) = self._data.popitem(last=False)
            self._bytes -= s
            dropped.append(v)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            data, self._data = self._data, OrderedDict()
            self._bytes = 0
        del data
