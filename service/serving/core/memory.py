"""Memory estimates of a request, checked before any forward runs (issue 6, "Cache and memory").

The estimate counts the big tensors only (activations are O(T^2) or O(T * d_model); weights,
the tokenizer and Python objects are outside it), from the model's shapes:

* recorded, per text of T tokens (what :class:`ForwardTensors` keeps, in the model dtype):
  pattern ``L*H*T^2`` + hidden states and the final norm's output ``(L+2)*T*D`` + q, k, v
  ``L*T*W`` + attention input and output ``2*L*T*D`` elements, where ``W`` = q, k and v's widths
  together, ``(n_heads + 2 * n_kv_heads) * d_head`` (:func:`qkv_width`: ``3*D`` for GPT-2, less
  with grouped-query attention, other than ``3*D`` where ``n_heads * d_head != d_model``, Gemma);
* transient, per padded forward chunk of ``b`` texts padded to ``Tp`` tokens (Hugging Face's
  eager attention with ``output_attentions``): all layers' attentions ``b*L*H*Tp^2`` (kept until
  unpadded), one layer's scores + softmax ``2*b*H*Tp^2``, hidden states ``b*(L+1)*Tp*D``, the
  captured q/k/v + attention input/output ``b*L*Tp*(W+2*D)``, the MLP ``4*b*Tp*D``;
* plus what the endpoint says its response needs (``extra``, e.g.
  :func:`attnscope.service.encoding.estimate_encoded_bytes`).

A forward runs chunks of ``forward_batch_size`` texts one after another, so the transient part
is the largest chunk's; every text's recorded tensors are alive until the response is built.
Measured against the server's resident memory by ``bench/`` (README "Benchmark").
"""

from __future__ import annotations

import ctypes
import gc
import sys
import threading
from typing import Sequence

import torch

from ...errors import MemoryLimitExceeded
from ...runtime.results import recorded_bytes


def qkv_width(adapter) -> int:
    """Recorded q, k and v's widths together per token and layer:
    ``(n_heads + 2 * n_kv_heads) * d_head`` (q ``[head, pos, d_head]``, k/v on the key/value
    heads ``[kv_head, pos, d_head]``)."""
    return (adapter.n_heads + 2 * adapter.n_kv_heads) * adapter.d_head


def forward_bytes(
    n_layers: int, n_heads: int, d_model: int, lengths: Sequence[int], element_size: int,
    batch_size: int, qkv_width: int | None = None,
) -> int:
    """Estimated peak bytes of the forwards of texts of ``lengths`` tokens, in chunks of
    ``batch_size`` texts (padded to the chunk's longest), dtype of ``element_size`` bytes;
    ``qkv_width``: q, k and v's widths together (:func:`qkv_width`; default ``3 * d_model``)."""
    L, H, D = n_layers, n_heads, d_model
    W = 3 * D if qkv_width is None else int(qkv_width)
    total = sum(recorded_bytes(L, H, D, T, element_size, qkv_width=W) for T in lengths)
    transient = 0
    for s in range(0, len(lengths), max(1, batch_size)):
        chunk = lengths[s : s + batch_size]
        b, Tp = len(chunk), max(chunk)
        t = b * (L * H * Tp * Tp + 2 * H * Tp * Tp + (L + 1) * Tp * D + (W + 2 * D) * L * Tp + 4 * Tp * D)
        transient = max(transient, element_size * t)
    return total + transient


def _fmt(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} bytes"


def check_memory(
    rt, lengths: Sequence[int], extra: int = 0, what: str = "response", limit: int | None = None,
    detail: str = "", param: str | None = None,
) -> int:
    """Raise :class:`MemoryLimitExceeded` (422) when the forwards of texts of ``lengths`` tokens
    plus ``extra`` bytes (the endpoint's ``what``) exceed ``rt.settings.max_request_bytes``.

    ``rt``: a Runtime (its adapter's n_layers/n_heads/n_kv_heads/d_head/d_model, the weights' dtype, the
    settings' forward_batch_size). ``limit``: the app's ``max_request_bytes`` when it differs
    from the runtime's (an app built around an existing Runtime); the smaller non-zero of the
    two applies. ``detail`` is appended to the text count in the message (e.g. ", one of them
    the induction probe"). Returns the estimate in bytes. A limit of 0 disables it.
    """
    if rt is None:  # a job with no model and no forward (e.g. scratch attention on matrices)
        a, fwd = None, 0
    else:
        a = rt.adapter
        es = torch.empty((), dtype=next(rt.model.parameters()).dtype).element_size()
        fwd = forward_bytes(a.n_layers, a.n_heads, a.d_model, list(lengths), es,
                            rt.settings.forward_batch_size, qkv_width=qkv_width(a))
    total = fwd + int(extra)
    limits = [x for x in (getattr(getattr(rt, "settings", None), "max_request_bytes", 0), limit) if x]
    limit = min(limits) if limits else 0
    if limit and total > limit:
        n, longest = len(lengths), max(lengths) if lengths else 0
        if a is None:
            raise MemoryLimitExceeded(
                f"this request needs an estimated {_fmt(total)} ({total} bytes) of memory "
                f"({what}); the limit is {_fmt(limit)} (max_request_bytes = {limit})", param)
        raise MemoryLimitExceeded(
            f"this request needs an estimated {_fmt(total)} ({total} bytes) of memory (forward {_fmt(fwd)} for "
            f"{n} text{'s' if n != 1 else ''}{detail}, longest {longest} tokens, {a.n_layers} layers x "
            f"{a.n_heads} heads, d_model {a.d_model}; {what} {_fmt(int(extra))}); the limit is "
            f"{_fmt(limit)} (max_request_bytes = {limit}). Send fewer or shorter texts, select "
            "layers/heads, or use the sparse, 'tril' or base64 float16 encodings",
            "texts" if n > 1 else "text",
        )
    return total


_LIBC = None
#: Free heap bytes glibc may keep before :func:`release_memory` trims (Settings.trim_free_bytes).
TRIM_FREE_BYTES = 256 << 20


def set_trim_free_bytes(n: int) -> None:
    """Set the process-wide trim threshold (the allocator is process-wide; the app calls this
    once at start-up with ``Settings.trim_free_bytes``) and make glibc keep freed memory
    until then (:func:`keep_freed_memory`)."""
    global TRIM_FREE_BYTES
    TRIM_FREE_BYTES = int(n)
    keep_freed_memory(TRIM_FREE_BYTES)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's own ceiling for its dynamic threshold (64-bit)


def keep_freed_memory(trim_bytes: int) -> bool:
    """glibc ``mallopt``: blocks up to 32 MiB come from the heap (not a fresh ``mmap`` each
    time) and the heap's free top is given back only beyond ``trim_bytes`` (min 32 MiB), so
    :func:`release_memory` alone decides when memory goes back to the OS.

    Without it, glibc returns a freed block at the top of a worker thread's heap at once, and
    the next request faults every page of it in again: measured in the server at T = 128 (GPT-2
    small), /v1/trajectories' float64 copy took 9 ms and its standardisation 13 ms instead of
    ~1 ms each (page faults cost ~4 us here). Blocks over 32 MiB (T = 1024 patterns) are still
    mapped and unmapped by themselves. Returns True when glibc accepted both settings."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        lib = _libc()
        ok = lib.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        ok &= lib.mallopt(_M_TRIM_THRESHOLD, max(int(trim_bytes), MMAP_THRESHOLD_BYTES) if
                          trim_bytes > 0 else MMAP_THRESHOLD_BYTES)
        return bool(ok)
    except (OSError, AttributeError):
        return False


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc():
    global _LIBC
    if _LIBC is None:
        # published only once mallinfo2's struct return type is set: a thread that saw the
        # library before would call it as returning int, and glibc would write the 80-byte
        # struct through a garbage pointer (the hidden return-slot argument)
        lib = ctypes.CDLL("libc.so.6")
        try:
            lib.mallinfo2.restype = _MallInfo2
        except AttributeError:  # glibc < 2.33: free_heap_bytes() gives None
            pass
        _LIBC = lib
    return _LIBC


def free_heap_bytes() -> int | None:
    """Bytes glibc holds free in its arenas (``mallinfo2().fordblks``, ~0.1-0.3 ms), or None
    where that is not available (not glibc >= 2.33)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return int(_libc().mallinfo2().fordblks)
    except (OSError, AttributeError):
        return None


def release_memory(min_free_bytes: int | None = None) -> bool:
    """Give freed heap memory back to the OS (glibc ``malloc_trim(0)``) once glibc holds more
    than ``min_free_bytes`` free (default :data:`TRIM_FREE_BYTES`; 0 = always trim); a no-op
    elsewhere. Returns True when memory was released.

    glibc keeps freed chunks of 1-32 MB (q/k/v, hidden states, per-layer attention of
    mid-length texts, encoded bodies) in its heaps: measured by bench/ (GPT-2 small, 200 mixed
    requests up to T = 1024), the server's RSS stayed at 4.4 GB, 2 GB above idle + cache, with
    no trimming. Trimming after every forward held it at 1.3 GB but made the next forward fault
    its pages in again: +25 ms (13%) per T = 128 forward. So it trims only when the free heap
    is large: a T = 128 forward of GPT-2 small leaves ~100 MB free (reused by the next one, never
    trimmed), a T = 1024 one ~440 MB (trimmed). RSS then stays within idle + cache budget +
    about ``min_free_bytes`` + the live request.
    """
    if not sys.platform.startswith("linux"):
        return False
    threshold = TRIM_FREE_BYTES if min_free_bytes is None else min_free_bytes
    if threshold > 0:
        free = free_heap_bytes()
        if free is not None and free <= threshold:
            return False
    try:
        return bool(_libc().malloc_trim(0))
    except (OSError, AttributeError):
        return False


def set_numpy_hugepages(enabled: bool) -> bool | None:
    """Turn numpy's transparent-huge-page advice for arrays of 4 MiB and more on or off for the
    whole process (``numpy._core.multiarray._set_madvise_hugepage``, numpy's documented
    switch, also set by the environment variable ``NUMPY_MADVISE_HUGEPAGE``;
    Settings.numpy_hugepages). Returns the previous setting, or None where this numpy has no
    such switch (then nothing changes)."""
    try:
        from numpy._core import multiarray as ma
    except ImportError:  # numpy < 2
        from numpy.core import multiarray as ma  # type: ignore[no-redef]
    setter = getattr(ma, "_set_madvise_hugepage", None)
    if setter is None:
        return None
    return bool(setter(bool(enabled)))


def freeze_startup_objects() -> int:
    """Collect once, then move every object alive now (modules, the model, the tokenizer,
    scikit-learn and scipy) out of the cyclic garbage collector's reach (``gc.freeze``).
    Returns the number of objects frozen. Undo with :func:`unfreeze_startup_objects` (the app
    does at shutdown).

    Why: a served model keeps ~500k objects that the collector tracks, and an occasional full
    (generation 2) collection walks all of them: measured 250 ms with GPT-2 small, torch,
    transformers and scikit-learn loaded, paid by whichever request allocated at the wrong
    moment. After the freeze a full collection walks only what requests created (< 1 ms).
    Reference counting still frees everything as usual; only cycles among frozen objects
    are never collected, which for start-up objects that live as long as the process is
    what happens anyway.
    """
    global _FREEZES
    with _FREEZE_LOCK:
        gc.collect()
        gc.freeze()
        _FREEZES += 1
        return gc.get_freeze_count()


def unfreeze_startup_objects() -> None:
    """Undo one :func:`freeze_startup_objects`: the objects go back to the collector
    (``gc.unfreeze``) only when every freeze has been undone (several apps in one process)."""
    global _FREEZES
    with _FREEZE_LOCK:
        _FREEZES = max(0, _FREEZES - 1)
        if _FREEZES == 0:
            gc.unfreeze()


_FREEZES = 0
_FREEZE_LOCK = threading.Lock()
