"""Process-wide memory settings applied at start-up: numpy's huge-page advice
(Settings.numpy_hugepages) and the garbage collector's freeze of start-up objects."""

from __future__ import annotations

import gc
import sys
from types import SimpleNamespace as NS

import numpy as np
import pytest

from attnscope.service.serving.core import memory


def _numpy_flag():
    from numpy._core import multiarray as ma

    return ma._get_madvise_hugepage()


@pytest.fixture
def restore_numpy_flag():
    saved = _numpy_flag()
    yield
    memory.set_numpy_hugepages(saved)


def test_numpy_hugepages_off_by_default_and_settable(make_client, gpt2_runtime, restore_numpy_flag,
                                                     monkeypatch):
    from attnscope.service.config import Settings

    memory.set_numpy_hugepages(True)
    c = make_client(gpt2_runtime)  # default: off, applied in the lifespan
    assert _numpy_flag() is False
    assert c.get("/v1/model").status_code == 200
    make_client(gpt2_runtime, numpy_hugepages=True)
    assert _numpy_flag() is True
    monkeypatch.setenv("ATTNSCOPE_NUMPY_HUGEPAGES", "false")
    assert Settings(model="bundled").numpy_hugepages is False
    monkeypatch.setenv("ATTNSCOPE_NUMPY_HUGEPAGES", "maybe")
    with pytest.raises(Exception, match="numpy_hugepages"):
        Settings(model="bundled")


def test_set_numpy_hugepages_returns_the_previous_value(restore_numpy_flag):
    memory.set_numpy_hugepages(False)
    assert memory.set_numpy_hugepages(True) is False
    assert _numpy_flag() is True
    assert memory.set_numpy_hugepages(False) is True
    # arrays still work either way (the advice only changes how pages are backed)
    a = np.ones((1024, 1024))
    assert a.sum() == 1024 * 1024


def test_freeze_startup_objects_freezes_what_is_alive_and_later_cycles_still_collect():
    class Node:
        pass

    keep = [Node() for _ in range(1000)]
    before = len(gc.get_objects())
    try:
        n = memory.freeze_startup_objects()
        assert abs(n - gc.get_freeze_count()) <= 10 and n >= 1000  # frozen objects may still die
        # everything alive moved to the permanent generation: the collector walks none of it
        assert len(gc.get_objects()) < before - 1000 and n > before // 2
        # a cycle made after the freeze is garbage-collected as usual
        a, b = Node(), Node()
        a.other, b.other = b, a
        import weakref

        ref = weakref.ref(a)
        del a, b
        gc.collect()
        assert ref() is None
        assert keep is not None
    finally:
        memory.unfreeze_startup_objects()
    assert gc.get_freeze_count() == 0


def test_live_server_freezes_its_start_up_objects(live_server):
    text = live_server.log.read_text()
    assert "start-up objects frozen for the garbage collector" in text, text[-2000:]


# ------------------------------------------------------------------ trim_free_bytes
@pytest.mark.regression
def test_trim_free_bytes_setting(make_client, gpt2_runtime, monkeypatch):
    from attnscope.service.config import Settings
    from attnscope.service.serving.core import memory
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="trim_free_bytes"):
        Settings(model="bundled", trim_free_bytes=-1)
    monkeypatch.setenv("ATTNSCOPE_TRIM_FREE_BYTES", "-5")
    with pytest.raises(ValidationError, match="trim_free_bytes"):
        Settings(model="bundled")
    monkeypatch.delenv("ATTNSCOPE_TRIM_FREE_BYTES")
    saved = memory.TRIM_FREE_BYTES
    try:
        make_client(gpt2_runtime, trim_free_bytes=0)
        assert memory.TRIM_FREE_BYTES == 0
        calls = []
        real = memory._libc()
        monkeypatch.setattr(memory, "_libc", lambda: NS(
            malloc_trim=lambda n: calls.append(n) or 1, mallinfo2=real.mallinfo2))
        assert memory.release_memory() is True and calls == [0]  # 0 = always
        memory.set_trim_free_bytes(1 << 62)
        assert memory.release_memory() is False and calls == [0]  # huge: never
        assert memory.release_memory(0) is True and calls == [0, 0]
        free = memory.free_heap_bytes()
        assert free is None or free >= 0
    finally:
        memory.set_trim_free_bytes(saved)


@pytest.mark.regression
def test_negative_trim_env_is_a_startup_error(tmp_path):
    from conftest import start_server

    s = start_server(tmp_path, env={"ATTNSCOPE_TRIM_FREE_BYTES": "-1"}, wait_ready=False)
    try:
        rc = s.proc.wait(timeout=60)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert rc != 0
    assert "trim_free_bytes" in s.log.read_text().lower()


@pytest.mark.regression
def test_libc_is_published_only_with_mallinfo2_restype(monkeypatch):
    """Bug: _libc() published the CDLL in the global before setting mallinfo2's restype; a
    thread interleaving there called mallinfo2 as returning int (glibc then writes the struct
    through a garbage return-slot pointer: memory corruption). Simulated by running the other
    thread's call re-entrantly at the moment the restype is being set."""
    from attnscope.service.serving.core import memory

    seen = []

    class Fn:
        restype = None

        def __call__(self):
            seen.append(self.restype)
            return memory._MallInfo2(fordblks=123)

    class FakeLib:
        interleaved = False

        def __init__(self, name):
            self.fn = Fn()

        @property
        def mallinfo2(self):
            if not FakeLib.interleaved:  # the first access: from _libc(), setting restype
                FakeLib.interleaved = True
                memory.free_heap_bytes()  # "another thread" interleaves here
            return self.fn

        def malloc_trim(self, n):
            return 0

    monkeypatch.setattr(memory, "_LIBC", None)
    monkeypatch.setattr(memory.ctypes, "CDLL", FakeLib)
    assert memory.free_heap_bytes() == 123
    assert seen and all(r is memory._MallInfo2 for r in seen), seen


@pytest.mark.regression
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_keep_freed_memory_serves_big_blocks_from_the_heap():
    """With keep_freed_memory a 24 MiB block comes from glibc's heap, not from a fresh mmap
    (glibc's default for big blocks, which unmaps it on free so the next request faults all
    its pages in again): mmapped bytes (mallinfo2 hblkhd) do not grow while it is alive.

    In a fresh interpreter: in this process earlier tests may leave a free chunk of 40 MiB in
    the heap, which glibc then reuses for the block over the threshold instead of mapping it
    (the suite failed that way once in a fresh clone)."""
    code = """if True:
        import sys
        import numpy as np
        from attnscope.service.serving.core import memory as M

        assert M.keep_freed_memory(M.TRIM_FREE_BYTES) is True
        try:
            mapped = lambda: M._libc().mallinfo2().hblkhd
            before = mapped()
        except AttributeError:
            sys.exit(77)
        a = np.ones(24 << 20, dtype=np.uint8)  # 24 MiB, below the 32 MiB threshold
        assert mapped() - before < 1 << 20, mapped() - before
        del a
        b = np.ones(40 << 20, dtype=np.uint8)  # over the threshold: mapped, as before
        assert mapped() - before >= 40 << 20, mapped() - before
        del b
        M.release_memory(0)  # 0: trim now; must not raise
    """
    import subprocess

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if r.returncode == 77:
        pytest.skip("mallinfo2 needs glibc >= 2.33")
    assert r.returncode == 0, r.stderr[-2000:]
