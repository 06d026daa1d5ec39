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


PAIRS = [(CLEAN, CORRUPTED), ("the cat sat on the mat and the dog sat",
                              "the cat sat on the rug and the dog sat")]


def test_patch_dataset_jsonl(run, live_server, tmp_path):
    """``attnscope patch --dataset FILE.jsonl``: the pairs reach /v1/patch as ``pairs`` (the
    saved JSON equals the client's answer for the same pairs) and the printout says it is a
    dataset's mean; a JSON list of [clean, corrupted] gives the same answer."""
    f = tmp_path / "pairs.jsonl"
    f.write_text("\n".join(json.dumps({"id": i, "clean_text": c, "corrupted_text": k})
                           for i, (c, k) in enumerate(PAIRS)) + "\n\n")
    out = tmp_path / "p.json"
    rc, text, err = run("patch", "--dataset", str(f), "--metric", "loss", "--hook", "resid_pre",
                        "--output", str(out))
    assert rc == 0, err
    assert "dataset: 2 pairs" in text and "get_act_patch_resid_pre" in text
    body = json.loads(out.read_text())
    with Client(live_server.url) as c:
        ref = c.patch(pairs=[{"clean_text": a, "corrupted_text": b} for a, b in PAIRS],
                      metric="loss", hook="resid_pre")
    assert body["dataset"]["n_pairs"] == 2 and body["grid"]["raw"] == ref.grid.raw
    g = tmp_path / "pairs.json"
    g.write_text(json.dumps([list(p) for p in PAIRS]))
    out2 = tmp_path / "p2.json"
    rc, _, err = run("patch", "--dataset", str(g), "--metric", "loss", "--hook", "resid_pre",
                     "--output", str(out2))
    assert rc == 0, err
    assert json.loads(out2.read_text())["grid"]["raw"] == ref.grid.raw


def test_ablate_dataset_jsonl(run, live_server, tmp_path):
    """``attnscope ablate --dataset`` with the batch pipeline's {"id", "text"} lines: the texts
    reach /v1/ablate as ``texts`` (method mean over the dataset), equal to the client's."""
    texts = [CLEAN, CORRUPTED, "the cat sat on the mat"]
    f = tmp_path / "texts.jsonl"
    f.write_text("\n".join(json.dumps({"id": f"t{i}", "text": t}) for i, t in enumerate(texts)))
    out = tmp_path / "a.json"
    rc, text, err = run("ablate", "--dataset", str(f), "--mlp", "0", "--method", "mean",
                        "--output", str(out))
    assert rc == 0, err
    assert "over 3 texts" in text and "mean_kl" in text
    body = json.loads(out.read_text())
    with Client(live_server.url) as c:
        ref = c.ablate(texts=texts, components=[{"kind": "mlp", "layer": 0}], method="mean")
    assert body["mean_kl"] == ref.mean_kl and body["dataset"]["mean_over"] == "dataset"


def test_dataset_bad_input(run, tmp_path):
    """A broken dataset file is exit 2 naming the line and what is wrong, before any request."""
    f = tmp_path / "bad.jsonl"
    f.write_text('{"clean_text": "a b", "corrupted_text": "a c"}\n{"clean_text": "a b",\n')
    rc, _, err = run("patch", "--dataset", str(f), "--metric", "loss")
    assert rc == 2 and "line 2 is not valid JSON" in err
    f.write_text('{"clean_text": "a b", "corupted_text": "a c"}\n')
    rc, _, err = run("patch", "--dataset", str(f), "--metric", "loss")
    assert rc == 2 and "line 1" in err and "'corupted_text'" in err
    rc, _, err = run("patch", CLEAN, CORRUPTED, "--dataset", str(f), "--metric", "loss")
    assert rc == 2 and "given twice" in err
    g = tmp_path / "mixed.json"
    g.write_text(json.dumps({"texts": ["a b", [1, 2]]}))
    rc, _, err = run("ablate", "--dataset", str(g), "--mlp", "0")
    assert rc == 2 and "mixed" in err
    rc, _, err = run("ablate", "--dataset", str(tmp_path / "missing.jsonl"), "--mlp", "0")
    assert rc == 2 and "cannot read" in err
