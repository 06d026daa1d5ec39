"""App lifecycle: an app created, served, shut down and created again in one process, one app object
entered twice, the gc freeze of start-up objects.
"""

from __future__ import annotations

import gc
import threading
import time
import uuid

import numpy as np
import pytest

from attnscope.service.config import Settings

from test_api import decode
from recorded_reference import hf_reference


# --------------------------------------------------------------- app lifecycle
def _ready(c, timeout=300):  # a safety net against a hang, not a figure
    deadline = time.time() + timeout
    while time.time() < deadline:
        if c.get("/readyz").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError("not ready")


@pytest.mark.regression
def test_app_loaded_shut_down_and_created_again_in_one_process(gpt2_runtime):
    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app

    text = f"Lifecycle {uuid.uuid4().hex[:6]} the cat sat."
    # the reference on the tokens the response reports (add_bos null: BOS first for GPT-2)
    ids = list(gpt2_runtime.tokenize(text, add_bos=True).input_ids)
    hf = hf_reference(gpt2_runtime, ids)
    before = gc.get_freeze_count()
    threads = []
    for round_ in range(2):
        app = create_app(Settings(model="bundled"))
        with TestClient(app, raise_server_exceptions=False) as c:
            _ready(c)
            assert gc.get_freeze_count() > before  # the start-up objects were frozen
            r = c.post("/v1/attention", json={"text": text, "encoding": "base64"})
            assert r.status_code == 200, r.text
            assert [t["id"] for t in r.json()["attention"]["tokens"]] == ids
            assert np.array_equal(decode(r.json()["attention"]["pattern"]), hf["pattern"].numpy())
            slot_thread = c.portal.call(app.state.slot.run, threading.current_thread)
            assert slot_thread.name.startswith("attnscope-device")
            threads.append(slot_thread)
        assert gc.get_freeze_count() == 0  # unfrozen at shutdown
        slot_thread.join(timeout=10)
        assert not slot_thread.is_alive()  # the slot's thread ended
    assert threads[0] is not threads[1]


@pytest.mark.regression
def test_one_app_object_entered_twice_gets_a_fresh_slot_thread(gpt2_runtime):
    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app

    app = create_app(Settings(model="bundled", max_queue=0), runtime=gpt2_runtime)
    text = f"Twice {uuid.uuid4().hex[:6]} a b c"
    # the reference on the tokens the response reports (add_bos null: BOS first for GPT-2)
    ids = list(gpt2_runtime.tokenize(text, add_bos=True).input_ids)
    hf = hf_reference(gpt2_runtime, ids)
    frozen = gc.get_freeze_count()
    seen = []
    for _ in range(2):
        with TestClient(app, raise_server_exceptions=False) as c:
            for p in ("/v1/attention", "/v1/heads", "/v1/verify"):
                r = c.post(p, json={"text": text, **({"encoding": "base64"} if p == "/v1/attention" else {})})
                assert r.status_code == 200, (p, r.text[:300])
                if p == "/v1/attention":
                    assert [t["id"] for t in r.json()["attention"]["tokens"]] == ids
                    assert np.array_equal(decode(r.json()["attention"]["pattern"]), hf["pattern"].numpy())
            seen.append(c.portal.call(app.state.slot.run, threading.current_thread))
            assert app.state.slot.depth == 0
        seen[-1].join(timeout=10)
        assert not seen[-1].is_alive()
    assert seen[0] is not seen[1]
    assert gc.get_freeze_count() == frozen  # an app given its runtime freezes nothing


@pytest.mark.regression
def test_one_apps_shutdown_keeps_another_running_apps_objects_frozen():
    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app

    with TestClient(create_app(Settings(model="bundled")), raise_server_exceptions=False) as a:
        _ready(a)
        frozen_a = gc.get_freeze_count()
        assert frozen_a > 0
        with TestClient(create_app(Settings(model="bundled")), raise_server_exceptions=False) as b:
            _ready(b)
        assert gc.get_freeze_count() >= frozen_a  # a still serves: its objects stay frozen
