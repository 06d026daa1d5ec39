"""``attnscope patch --hook ...`` and ``attnscope ablate --mlp/--attn/--neurons`` against a
real uvicorn (the session's ``live_server``): the flags reach the request, the printed grid
names TransformerLens' function, and the saved JSON equals the Python client's answer."""

from __future__ import annotations

import json
import sys

import pytest

from attnscope.client import Client
from attnscope.client import cli as cli_mod

pytestmark = pytest.mark.e2e

CLEAN = "the cat sat on the mat and the cat sat"
CORRUPTED = "the dog sat on the mat and the cat sat"


@pytest.fixture
def run(capsys, monkeypatch, live_server):
    def go(*args):
        monkeypatch.setenv("ATTNSCOPE_BASE_URL", live_server.url)
        capsys.readouterr()
        rc = cli_mod.main(list(args))
        out = capsys.readouterr()
        assert "Traceback" not in out.err, out.err
        return rc, out.out, out.err
    return go


def test_patch_hook_flags(run, live_server, tmp_path):
    f = tmp_path / "p.json"
    rc, out, err = run("patch", CLEAN, CORRUPTED, "--metric", "loss", "--hook", "q",
                       "--by-position", "--patch-layers", "1", "--patch-heads", "0,2",
                       "--output", str(f))
    assert rc == 0, err
    assert "get_act_patch_attn_head_q_by_pos" in out and "layer 1 [pos, head]" in out
    body = json.loads(f.read_text())
    with Client(live_server.url) as c:
        ref = c.patch(CLEAN, CORRUPTED, metric="loss", hook="q", by_position=True,
                      patch_layers=[1], patch_heads=[0, 2])
    assert body["grid"]["raw"] == ref.grid.raw
    assert body["grid"]["axes"] == ["layer", "pos", "head"]
    rc, out, err = run("patch", CLEAN, CORRUPTED, "--metric", "loss", "--hook", "mlp_out",
                       "--plot", str(tmp_path / "g.png"))
    assert rc == 0, err
    assert "get_act_patch_mlp_out" in out and (tmp_path / "g.png").stat().st_size > 0


def test_ablate_component_flags(run, live_server, tmp_path):
    f = tmp_path / "a.json"
    rc, out, err = run("ablate", CLEAN, "--mlp", "0", "--neurons", "1:3,1:5", "--attn", "1",
                       "--output", str(f))
    assert rc == 0, err
    assert "MLP0" in out and "ATTN1" in out and "L1N3,5" in out
    body = json.loads(f.read_text())
    with Client(live_server.url) as c:
        ref = c.ablate(CLEAN, components=[{"kind": "mlp", "layer": 0},
                                          {"kind": "attn", "layer": 1},
                                          {"kind": "neuron", "layer": 1, "neurons": [3, 5]}])
    assert body["mean_kl"] == ref.mean_kl and body["mean_kl"] > 0
    rc, out, err = run("ablate", CLEAN)
    assert rc == 2 and "--mlp" in err
