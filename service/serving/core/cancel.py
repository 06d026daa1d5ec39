"""Cancelling device work (issue 29 item 6): a job stops when its request's deadline passes,
its client disconnects or the server drains, and its device turn and memory budget are given
back at once.

A :class:`CancelToken` belongs to one request. The engine (service/serving/core/engine.py)
makes it, with the request's deadline (``request_timeout_s``, the TimeoutMiddleware's), cancels
it when the client's connection reports ``http.disconnect`` or the server drains, and runs the
request's device turn under :func:`running`. Inside the turn the token is checked

* at every torch operation made from Python (a ``TorchFunctionMode`` on the device thread:
  ~1 microsecond per op, measured 232 -> 234 ms for a GPT-2-small forward at T = 128, 755
  ops), so the recorded forward, the hooked forward (``service/runtime/hooked.py``) and the
  analyses stop between two ops, whoever wrote their loops;
* explicitly, by :func:`checkpoint`, between the pairs, chunks, prompts and layers of long
  jobs (path patching, the logit lens) and between forwards, also covering pure-Python work.

A cancelled job raises :class:`JobCancelled` (a ``BaseException``, like ``KeyboardInterrupt``,
so an analysis' ``except Exception`` cannot swallow it); the engine turns it into the
request's error (504 ``timeout``, 503 ``shutting_down``, or nothing for a client that went
away).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from torch.overrides import TorchFunctionMode

#: why a token was cancelled
DEADLINE, DISCONNECT, SHUTDOWN = "deadline", "disconnect", "shutdown"


class JobCancelled(BaseException):
    """Raised on the device thread when the running job's token is cancelled; ``reason`` is
    :data:`DEADLINE`, :data:`DISCONNECT` or :data:`SHUTDOWN`."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class CancelToken:
    """One request's cancel flag. ``deadline``: ``time.monotonic()`` past which the job stops
    (None: none). :meth:`cancel` may be called from any thread (a plain attribute write)."""

    __slots__ = ("deadline", "reason", "checks")

    def __init__(self, deadline: float | None = None):
        self.deadline = deadline
        self.reason: str | None = None
        self.checks = 0  # how often the job looked (tests, logs)

    def cancel(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    @property
    def cancelled(self) -> bool:
        if self.reason is None and self.deadline is not None and \
                time.monotonic() >= self.deadline:
            self.reason = DEADLINE
        return self.reason is not None

    def check(self) -> None:
        """Raise :class:`JobCancelled` when cancelled (or past the deadline)."""
        self.checks += 1
        if self.cancelled:
            raise JobCancelled(self.reason)


_local = threading.local()


def current() -> CancelToken | None:
    """The token of the job running on this thread (None outside a job)."""
    return getattr(_local, "token", None)


def checkpoint() -> None:
    """Stop here if this thread's job was cancelled (no-op outside a job). Long loops call it
    between their pairs, chunks, prompts or layers."""
    token = getattr(_local, "token", None)
    if token is not None:
        token.check()


class _CancelMode(TorchFunctionMode):
    """Checks the token before every torch function or Tensor method called from Python."""

    def __init__(self, token: CancelToken):
        super().__init__()
        self.token = token

    def __torch_function__(self, func, types, args=(), kwargs=None):
        t = self.token
        if t.reason is not None or (t.deadline is not None and
                                    time.monotonic() >= t.deadline):
            t.check()
        return func(*args, **(kwargs or {}))


@contextmanager
def running(token: CancelToken | None):
    """Run the body as ``token``'s job on this thread: :func:`checkpoint` and every torch op
    see it. Checks it once on entry (a job cancelled while it waited for the device never
    starts). ``None``: no token, nothing changes."""
    if token is None:
        yield
        return
    token.check()
    prev = getattr(_local, "token", None)
    _local.token = token
    try:
        with _CancelMode(token):
            yield
    finally:
        _local.token = prev
