"""Process-wide memory settings applied at start-up: numpy's huge-page advice
(Settings.numpy_hugepages) and the garbage collector's freeze of start-up objects."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from attnscope.service.runtime import memory


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
