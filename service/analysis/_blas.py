"""One BLAS thread for the small float64 linear algebra of the analyses; one torch thread
for the small tensor work of an analysis (:func:`torch_threads_for`).

The analyses' matrix products are small (a few MB) and run right after a torch forward,
whose OpenMP threads may still be spinning, on cores that other work shares. Measured on
the 2-core development machine (GPT-2 small shapes, T = 128): scikit-learn's randomized
PCA on [1536, 768] float64 takes ~23 ms with one OpenBLAS thread and ~32 ms with two when
idle, 24 vs 130 ms right after a forward, 30 vs 177 ms beside a torch matmul loop; a
[144, 16384] float64 matrix-vector product 0.4 ms with one thread, ~8 ms with two.

threadpoolctl's ``threadpool_limits`` rescans every loaded library on each call (~2.5 ms);
a ``ThreadpoolController`` built once (after numpy's and scipy's BLAS are loaded) and its
``limit`` cost ~20 us. The limiter must be used as a context manager: threadpoolctl >= 3.6
lets only one "controlling" thread change OpenBLAS's (process-wide) thread count and frees
that role in ``__exit__``; a bare ``restore_original_limits()`` keeps it, after which every
other thread's limits are silently ignored.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_controller = None


def _get_controller():
    global _controller
    with _lock:
        if _controller is None:
            import numpy  # noqa: F401  (load numpy's and scipy's BLAS before the scan)
            import scipy.linalg  # noqa: F401
            from threadpoolctl import ThreadpoolController

            _controller = ThreadpoolController()
    return _controller


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """Context manager: every BLAS library loaded when first used (numpy's and scipy's
    OpenBLAS) runs one thread inside the block; the previous counts come back on exit.
    Nests. BLAS thread counts are process-wide: two threads inside at once share the limit
    (threadpoolctl lets the first one set it), as with ``threadpool_limits``."""
    with _get_controller().limit(limits=1, user_api="blas"):
        yield


def preload_analysis_libraries() -> None:
    """Import scikit-learn's PCA and scaler (~0.7 s; otherwise the first /v1/trajectories
    pays it) and build the controller, so every BLAS they use is loaded and known."""
    import numpy as np
    import sklearn.decomposition  # noqa: F401
    import sklearn.preprocessing  # noqa: F401

    _get_controller()
    # one tiny fit per solver path: their lazy imports (scipy.linalg/sparse submodules,
    # array-API helpers) hold the GIL for ~1 s on a busy machine; a first request should not
    # (issue 17: /healthz stalled past 1 s on a cold server's first /v1/trajectories)
    x = np.random.default_rng(0).random((64, 16))
    for n in (2, 12):
        sklearn.decomposition.PCA(n, random_state=0).fit_transform(
            sklearn.preprocessing.StandardScaler().fit_transform(x))


def one_blas_thread_for_process() -> None:
    """Set every loaded BLAS to one thread for the whole process, for good (a server: call it
    once from the main thread after :func:`preload_analysis_libraries`).

    OpenBLAS's thread count is process-wide and threadpoolctl lets only one live thread change
    it: with per-call limits in the server's worker threads, a request that ends restores two
    threads under another request still computing (measured: /v1/trajectories 41 ms instead of
    33 ms). Torch's own threads are not affected."""
    _get_controller().limit(limits=1, user_api="blas")


#: texts up to this many tokens make "small" analysis jobs (:func:`torch_threads_for`)
SMALL_JOB_TOKENS = 256


@contextmanager
def torch_threads_for(n_tokens: int) -> Iterator[None]:
    """Context manager: torch ops in the block run on one intra-op thread when the job's
    longest text has at most :data:`SMALL_JOB_TOKENS` tokens (else torch's own count). For
    the calling thread (torch keeps a count per thread; a thread started inside the block
    starts with it, and keeps it: /v1/heads hands its helper the job's count); the previous
    count comes back.

    Small jobs are many small ops (/v1/heads' norm scores: ~10 ops of ~100k elements per
    layer), each above torch's grain size, so each an OpenMP parallel region; when the cores
    are shared every region waits for its second thread. Measured on the 2-core machine
    under load (GPT-2 small, T = 128, the jobs in-process on a recorded forward): /v1/heads'
    job 114-997 ms with two threads, 17-21 ms with one."""
    import torch

    prev = torch.get_num_threads()
    if n_tokens > SMALL_JOB_TOKENS or prev == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
