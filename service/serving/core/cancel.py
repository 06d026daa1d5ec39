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
  jobs (path patching, the logit lens) and between forwards, also covering pure-Python work;
  :func:`progress` is such a checkpoint that also tells the token's ``progress`` sink how far
  the job is (a streamed response's progress lines, service/serving/core/engine.py).

The mode also counts the FLOP of every matrix product the job runs (``F.linear``, ``addmm``,
``matmul``, ``bmm``, ...: the bulk of a transformer's work) against the token's
``flops_limit``: a job whose work was not estimated beforehand, or was estimated too low,
still stops once it has run that much (:data:`OVER_LIMIT`, 422 ``device_limit_exceeded``).

A cancelled job raises :class:`JobCancelled` (a ``BaseException``, like ``KeyboardInterrupt``,
so an analysis' ``except Exception`` cannot swallow it); the engine turns it into the
request's error (504 ``timeout``, 503 ``shutting_down``, or nothing for a client that went
away).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

#: why a token was cancelled
DEADLINE, DISCONNECT, SHUTDOWN, OVER_LIMIT = "deadline", "disconnect", "shutdown", "over_limit"


class JobCancelled(BaseException):
    """Raised on the device thread when the running job's token is cancelled; ``reason`` is
    :data:`DEADLINE`, :data:`DISCONNECT` or :data:`SHUTDOWN`."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class CancelToken:
    """One request's cancel flag. ``deadline``: ``time.monotonic()`` past which the job stops
    (None: none). :meth:`cancel` may be called from any thread (a plain attribute write)."""

    __slots__ = ("deadline", "reason", "checks", "flops", "flops_limit", "progress")

    def __init__(self, deadline: float | None = None, flops_limit: float = 0.0):
        self.deadline = deadline
        self.reason: str | None = None
        self.checks = 0  # how often the job looked (tests, logs)
        #: matrix-multiply FLOP the job has run so far (counted by the torch mode), and the
        #: most it may run (0 = no limit): past it the job stops (:data:`OVER_LIMIT`)
        self.flops = 0.0
        self.flops_limit = float(flops_limit or 0)
        #: ``progress(done, total)``, called on the device thread by :func:`progress` (None:
        #: nobody listens; the engine sets it for a streamed response)
        self.progress = None

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


def progress(done: int, total: int) -> None:
    """A :func:`checkpoint` that also reports ``done`` of ``total`` units of work (cells of a
    patching grid, pairs of path patching) to this thread's job's ``progress`` sink, if any.
    Callers report a fixed ``total`` and a non-decreasing ``done`` that ends at ``total``."""
    token = getattr(_local, "token", None)
    if token is None:
        return
    token.check()
    if token.progress is not None:
        token.progress(int(done), int(total))


def _matmul_flops(func, args, kwargs) -> float:
    """Floating-point operations of one matrix product (a multiply-add = 2), from shapes."""
    try:
        if func is F.linear:
            x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            return 2.0 * x.numel() * w.shape[0]
        if func in (torch.addmm, torch.Tensor.addmm, torch.baddbmm, torch.Tensor.baddbmm):
            a, b = args[1], args[2]
        else:
            a, b = args[0], args[1]
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() == 0:
            return 0.0
        k = a.shape[-1]
        rows = a.numel() // max(k, 1)
        cols = b.shape[-1] if b.dim() > 1 else 1
        if b.dim() > 2:  # batched on b's side too: the larger batch counts
            rows = max(rows, (b.numel() // max(b.shape[-2] * b.shape[-1], 1)) *
                       (a.shape[-2] if a.dim() > 1 else 1))
        return 2.0 * rows * k * cols
    except Exception:  # noqa: BLE001 - an odd call: not counted, never an error
        return 0.0


_MATMULS = frozenset({
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm,
    torch.bmm, torch.Tensor.bmm, torch.addmm, torch.Tensor.addmm, torch.baddbmm,
    torch.Tensor.baddbmm, F.linear,
})


class _CancelMode(TorchFunctionMode):
    """Checks the token before every torch function or Tensor method called from Python, and
    counts the matrix products' FLOP against its ``flops_limit``."""

    def __init__(self, token: CancelToken):
        super().__init__()
        self.token = token

    def __torch_function__(self, func, types, args=(), kwargs=None):
        t = self.token
        if t.flops_limit and func in _MATMULS:
            t.flops += _matmul_flops(func, args, kwargs or {})
            if t.flops > t.flops_limit:
                t.cancel(OVER_LIMIT)
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
