"""The engine: one engine call and one device turn per request (docs/architecture.md, "Layers")."""

from __future__ import annotations

import pytest

from conftest import SENTENCE

ENDPOINTS = [
    ("/v1/attention", {"encoding": "base64", "dtype": "float16"}),
    ("/v1/heads", {}),
    ("/v1/links", {"layer": 1}),
    ("/v1/trajectories", {}),
    ("/v1/verify", {}),
]


@pytest.fixture
def counted(client, monkeypatch):
    """Count the device slot's turns and the runtime's forward calls while a request runs."""
    slot, rt = client.app.state.slot, client.app.state.runtime
    turns, forwards = [], []
    run, fwd = slot.run, rt.forward_many

    async def counting_run(fn, *args, **kw):
        turns.append(fn)
        return await run(fn, *args, **kw)

    def counting_forward(items):
        forwards.append(len(items))
        return fwd(items)

    monkeypatch.setattr(slot, "run", counting_run)
    monkeypatch.setattr(rt, "forward_many", counting_forward)
    return turns, forwards


@pytest.mark.parametrize("path,extra", ENDPOINTS)
def test_one_device_turn_for_a_new_and_for_a_cached_text(client, counted, path, extra):
    turns, forwards = counted
    text = f"{SENTENCE} ({path}, a text no other test sends)"
    r = client.post(path, json={"text": text, **extra})
    assert r.status_code == 200, r.text
    assert len(turns) == 1, f"{path}: {len(turns)} device turns for one new text"
    assert len(forwards) == 1  # the forward ran inside that one turn
    turns.clear(), forwards.clear()
    r2 = client.post(path, json={"text": text, **extra})
    assert r2.status_code == 200 and r2.content == r.content
    assert len(turns) == 1 and forwards == [], f"{path}: cached text: {len(turns)} turns, {forwards}"


def test_heads_forwards_text_and_probe_in_one_turn(client, counted):
    turns, forwards = counted
    r = client.post("/v1/heads", json={"texts": ["One text here.", "And another one."],
                                       "probe": {"seed": 12345}})
    assert r.status_code == 200, r.text
    assert len(turns) == 1 and forwards == [3]  # two texts + the induction probe, one call


def test_tokenize_never_takes_the_device(client, counted):
    turns, forwards = counted
    assert client.post("/v1/tokenize", json={"text": "Tokens only."}).status_code == 200
    assert turns == [] and forwards == []


def test_checks_before_any_tokenizing_or_forward(client, counted, monkeypatch):
    """A request that fails a token-independent check (layer out of range) never reaches the
    tokenizer or the device."""
    turns, forwards = counted
    rt = client.app.state.runtime
    calls = []
    orig = rt.tokenize
    monkeypatch.setattr(rt, "tokenize", lambda *a, **k: calls.append(a) or orig(*a, **k))
    r = client.post("/v1/attention", json={"text": "x " * 10, "layers": [7]})
    assert r.status_code == 422 and r.json()["error"]["param"] == "layers.0"
    assert calls == [] and turns == [] and forwards == []


def test_scratch_matrices_take_the_device_slot(client, counted):
    turns, forwards = counted
    r = client.post("/v1/scratch-attention", json={"q": [[1.0, 0.0]], "k": [[1.0, 0.0]],
                                                   "v": [[2.0, 3.0]]})
    assert r.status_code == 200, r.text
    assert len(turns) == 1 and forwards == []
