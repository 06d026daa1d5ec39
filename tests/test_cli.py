"""The command line (``attnscope ...``) against a real uvicorn on 127.0.0.1 (the session's
``live_server``): one variable for the server address, ``-o`` = ``--output`` everywhere,
every usage error a clean message with exit 2, the verify verdict, and ``serve`` as an exec
of the service's own command line (the client never imports the service)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from attnscope.client import cli as cli_mod
from conftest import SENTENCE, free_port

pytestmark = pytest.mark.e2e


@pytest.fixture
def run(capsys, monkeypatch, live_server):
    """``run(*args, env={...})``: the command line in-process -> (exit code, stdout, stderr).
    The server address comes from ATTNSCOPE_BASE_URL unless ``env`` says otherwise."""

    def go(*args, env=None, stdin=None):
        for k in ("ATTNSCOPE_BASE_URL", "ATTNSCOPE_URL"):
            monkeypatch.delenv(k, raising=False)
        for k, v in ({"ATTNSCOPE_BASE_URL": live_server.url} if env is None else env).items():
            monkeypatch.setenv(k, v)
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        capsys.readouterr()
        rc = cli_mod.main(list(args))
        out = capsys.readouterr()
        assert "Traceback" not in out.err, out.err
        return rc, out.out, out.err

    return go


# -- the server address -------------------------------------------------------------------

def test_one_variable_for_the_server_address(run, live_server):
    dead = f"http://127.0.0.1:{free_port()}"
    rc, out, err = run("model")
    assert rc == 0 and "n_layers" in out and err == ""
    # the deprecated alias still works, with a warning
    rc, out, err = run("model", env={"ATTNSCOPE_URL": live_server.url})
    assert rc == 0 and "n_layers" in out
    assert "ATTNSCOPE_URL is deprecated" in err and "ATTNSCOPE_BASE_URL" in err
    # both set: ATTNSCOPE_BASE_URL wins (the client's variable), the alias is named as ignored
    rc, out, err = run("model", "--max-retries", "0",
                       env={"ATTNSCOPE_BASE_URL": live_server.url, "ATTNSCOPE_URL": dead})
    assert rc == 0 and f"ATTNSCOPE_URL={dead} is ignored" in err
    rc, out, err = run("model", "--max-retries", "0",
                       env={"ATTNSCOPE_BASE_URL": dead, "ATTNSCOPE_URL": live_server.url})
    assert rc == 3 and dead in err and "ATTNSCOPE_BASE_URL" in err
    # --url beats both, silently; before the command as after it (the command's own wins)
    rc, out, err = run("model", "--url", live_server.url, env={"ATTNSCOPE_BASE_URL": dead})
    assert rc == 0 and err == ""
    rc, out, err = run("--url", live_server.url, "model", env={"ATTNSCOPE_BASE_URL": dead})
    assert rc == 0 and err == "" and "n_layers" in out
    rc, out, err = run("--url", dead, "model", "--url", live_server.url, env={})
    assert rc == 0 and "n_layers" in out


def test_the_python_client_reads_the_same_variable(monkeypatch, live_server):
    from attnscope.client import Client

    monkeypatch.delenv("ATTNSCOPE_BASE_URL", raising=False)
    monkeypatch.setenv("ATTNSCOPE_URL", live_server.url)
    with pytest.warns(DeprecationWarning, match="ATTNSCOPE_BASE_URL"):
        c = Client()
    assert c.base_url == live_server.url and c.model().n_layers == 2
    c.close()
    monkeypatch.setenv("ATTNSCOPE_BASE_URL", live_server.url + "/")
    with Client() as c:  # same address in both: no warning
        assert c.base_url == live_server.url


# -- -o is --output -----------------------------------------------------------------------

@pytest.mark.parametrize("cmd", [["model"], ["tokenize", "a b"], ["links", SENTENCE],
                                 ["attention", "a b c", "--layers", "0"],
                                 ["verify", "a b c"]])
def test_dash_o_writes_the_response_json(run, tmp_path, cmd):
    rc, printed, _ = run(*cmd, "--json")
    assert rc == 0
    for flag in ("-o", "--output"):
        f = tmp_path / f"{cmd[0]}{flag}.json"
        rc, out, err = run(*cmd, flag, str(f))
        assert rc == 0 and f"response saved to {f}" in err
        assert json.loads(f.read_text()) == json.loads(printed)
        assert out.strip() and not out.lstrip().startswith("{")  # the table, as without -o


def test_request_options_are_dash_dash_option(run):
    rc, out, err = run("attention", "a b c", "--option", "layers=[1]", "--json")
    assert rc == 0 and json.loads(out)["attention"]["layers"] == [1]
    rc, out, err = run("attention", "a b c", "-o", "layers=[1]")  # the old meaning of -o
    assert rc == 2 and "--option 'layers=[1]'" in err and not Path("layers=[1]").exists()
    rc, out, err = run("attention", "a b c", "--option", "layerz=[1]")
    assert rc == 2 and "layerz" in err and "Extra inputs" in err
    rc, out, err = run("attention", "a b c", "--option", "nokey")
    assert rc == 2 and "KEY=JSON" in err


# -- every error a clean message and its exit code ----------------------------------------

@pytest.mark.parametrize("args, code, words", [
    (["attention", "x", "--layer", "1", "--layers", "0", "--plot", "f.png"], 2,
     ["--layer 1 is not among --layers 0"]),
    (["attention", "x", "--head", "3", "--heads", "0,1", "--plot", "f.png"], 2,
     ["--head 3 is not among --heads 0,1"]),
    (["attention", "x", "--head-mean", "--kind", "heads", "--plot", "f.png"], 2,
     ["--head-mean", "without --head-mean"]),
    (["attention", "x", "--layer", "1"], 2, ["need", "--plot"]),
    (["attention", "x", "--layer", "5", "--plot", "f.png"], 2,
     ["--layer 5", "layers 0, 1"]),                     # found in the answer (all layers)
    (["attention", "x", "--head", "9", "--plot", "f.png"], 2, ["--head 9", "heads 0, 1, 2, 3"]),
    (["trajectories", "x y z", "--kind", "distances"], 2, ["--plot"]),
    (["attention", "   "], 2, ["text", "non-whitespace"]),  # refused before sending
    (["attention", "x", "--layers", "7"], 1, ["server error 422 out_of_range", "layers"]),
    (["links", "x y", "--layer", "9"], 1, ["out_of_range"]),
    (["heads", "x", "--option", "thresholds={\"sink\": 3}"], 2, ["thresholds.sink"]),
    (["attention", "x", "--layers", "a"], 2, ["comma-separated integers"]),
    (["attention", "x", "--layers", "0", "--plot", "no/such/dir/f.png"], 2,
     ["--plot no/such/dir/f.png: the folder", "does not exist"]),     # refused before sending
    (["heads", "x", "--plot", "no/such/dir/f.png"], 2, ["--plot no/such/dir/f.png: the folder"]),
    (["attention", "x", "--option", "layers=[0"], 2, ["--option layers=[0: not valid JSON"]),
    (["ablate", "x y"], 2, ["give --heads L:H", "--scan"]),
    (["ablate", "x y", "--heads", "0:0", "--plot", "g.png"], 2, ["add --scan"]),
    (["patch", "a b", "c d"], 2, ["needs --target and --distractor", "--metric loss"]),
    (["ablate", "x y", "--option", "heads=[[0,1]]"], 2, ["--option heads: give it as --heads"]),
    (["attention", "x", "--option", 'text="y"'], 2, ["--option text: give it as the TEXT argument"]),
    (["patch", "a b", "c d", "--metric", "loss", "--option", 'clean_text="A"'], 2,
     ["--option clean_text: give it as the CLEAN_TEXT argument"]),
    (["predict", "x", "--output", "-"], 2, ["use --json"]),
    (["links", "x y", "-o", "no/such/dir/out.json"], 2, ["--output no/such/dir/out.json: the folder"]),
    (["batch", "no-such-input.jsonl", "-o", "out.jsonl"], 2, ["cannot read no-such-input"]),
])
def test_usage_and_server_errors_are_clean(run, tmp_path, monkeypatch, args, code, words):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(*args)
    assert rc == code, err
    for w in words:
        assert w in err, (w, err)
    assert not list(tmp_path.glob("*.png"))  # nothing drawn on an error


def test_connection_failure_is_exit_3(run):
    rc, out, err = run("links", "x y", "--max-retries", "0",
                       env={"ATTNSCOPE_BASE_URL": f"http://127.0.0.1:{free_port()}"})
    assert rc == 3 and "connection failure" in err and "ATTNSCOPE_BASE_URL" in err


def test_verify_says_its_verdict_once(run):
    rc, out, err = run("verify", "a b c")
    assert rc == 0, err
    last = out.strip().splitlines()[-1]
    assert last.startswith("PASSED: ") and "tolerance" in last
    assert "passed" not in last.lower().removeprefix("passed: ")  # no "PASSED: passed"


def test_the_verdict_of_a_failure_keeps_the_servers_message():
    v = SimpleNamespace(passed=False, max_abs_diff=0.25, tolerance=1e-5,
                        message="failed: layer 1 head 2: max |diff| 0.25 > tolerance 1e-05")
    assert cli_mod._verdict(v) == "FAILED: layer 1 head 2: max |diff| 0.25 > tolerance 1e-05"
    v = SimpleNamespace(passed=True, max_abs_diff=0.0, tolerance=1e-5, message="passed")
    assert cli_mod._verdict(v) == "PASSED: max |diff| 0 <= tolerance 1e-05"
    v = SimpleNamespace(passed=False, max_abs_diff=None, tolerance=1e-5, message="")
    assert cli_mod._verdict(v) == "FAILED: max |diff| NaN > tolerance 1e-05"


# -- serve: the service's own command line, exec'd ----------------------------------------

def test_serve_execs_the_service_cli(tmp_path):
    """``attnscope serve`` becomes the server process (same pid: exec, not a child), serves,
    and shuts down gracefully on SIGTERM sent to that pid. The client module never imported the service."""
    script = Path(sys.executable).parent / "attnscope"
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "ATTNSCOPE_LOG_FORMAT": "text"}
    proc = subprocess.Popen([str(script), "serve", "--model", "bundled", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, env=env)
    try:
        while True:  # wait for the event (ready), bounded only by the process staying alive
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert b"attnscope.service.cli" in cmdline and b"serve" in cmdline, cmdline
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught (exit -15)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        assert "Finished server process" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    code = ("import sys; from attnscope.client import cli; "
            "print(any(m.startswith('attnscope.service') for m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr


def test_patch_metric_given_through_option_is_read(run):
    rc, out, err = run("patch", "The cat sat", "The dog sat", "--option", "metric=loss", "--json")
    assert rc == 0, err
    assert json.loads(out)["metric"] == "loss"


def test_run_caches_by_hook_name_and_saves_safetensors(run, tmp_path):
    """``attnscope run``: prompts as ids or texts, --cache patterns, a --request file for the
    interventions and metrics, --save writes the activations by TransformerLens name."""
    import json

    import numpy as np
    from safetensors.numpy import load_file

    req = tmp_path / "req.json"
    req.write_text(json.dumps({
        "interventions": [{"kind": "zero", "hook": "blocks.0.attn.hook_z", "heads": [1]}],
        "metrics": {"lp": {"kind": "logprob", "terms": [{"position": -1, "target": 7}]}}}))
    save = tmp_path / "acts.safetensors"
    rc, out, err = run("run", "--tokens", "0,5,6,7", "--cache", "blocks.*.hook_resid_post",
                       "--request", str(req), "--save", str(save))
    assert rc == 0, err
    assert "blocks.1.hook_resid_post  [1, 4, " in out and "metric lp = " in out
    arrays = load_file(str(save))
    assert sorted(arrays) == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    assert arrays["blocks.0.hook_resid_post"].shape[:2] == (1, 4)
    assert np.isfinite(arrays["blocks.1.hook_resid_post"]).all()
    rc, out, err = run("run", "--hooks")
    assert rc == 0 and "blocks.0.attn.hook_z" in out and "[batch, pos, head, d_head]" in out
    rc, out, err = run("run")
    assert rc == 2 and "--tokens" in err
    rc, out, err = run("run", "--tokens", "0,5", "--cache", "blocks.0.hook_resid_psot")
    assert rc != 0 and "blocks.0.hook_resid_post" in err


def test_tokens_instead_of_text_and_the_bos_flags(run, live_server):
    """--tokens ID,ID gives ids as they are; the BOS convention (GPT-2: on) is one flag away
    (--no-add-bos) (issue 25 items 1, 2)."""
    rc, out, _ = run("tokenize", SENTENCE, "--json")
    on = json.loads(out)
    assert rc == 0 and on["add_bos"] is True and on["tokens"]["tokens"][0]["id"] == 0
    rc, out, _ = run("tokenize", SENTENCE, "--no-add-bos", "--json")
    off = json.loads(out)
    assert rc == 0 and off["add_bos"] is False
    assert [t["id"] for t in off["tokens"]["tokens"]] == [t["id"] for t in on["tokens"]["tokens"]][1:]
    ids = ",".join(str(t["id"]) for t in on["tokens"]["tokens"])
    rc, out, _ = run("tokenize", "--tokens", ids, "--json")
    got = json.loads(out)
    assert rc == 0 and got["add_bos"] is False
    assert [t["id"] for t in got["tokens"]["tokens"]] == [t["id"] for t in on["tokens"]["tokens"]]
    rc, out, _ = run("attention", "--tokens", "0,5,99999", "--json")
    assert rc != 0


# -- logit-lens, logit-attribution, circuits, path-patch (issue 26) --------------------------

LENS_TEXT = "The cat sat on the mat and the cat sat on the"
PAIR = ([0, 211, 1030, 77, 1499, 211, 1030, 77], [0, 1210, 45, 1600, 1499, 211, 1030, 77])


def _served(live_server, path, body) -> dict:
    """The endpoint's own answer to ``body`` (what the command must have asked for)."""
    r = httpx.post(live_server.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_logit_lens_command(run, live_server):
    """``attnscope logit-lens``: the request the flags spell (``--positions -2,-1`` as
    typed: a negative list argparse alone refuses), the table of top tokens and of the next
    token's rank, per residual state and position."""
    rc, out, err = run("logit-lens", LENS_TEXT, "--positions", "-2,-1", "--top-k", "2",
                       "--ln", "final", "--json")
    assert rc == 0, err
    got = json.loads(out)
    assert got == _served(live_server, "/v1/logit-lens", {
        "text": LENS_TEXT, "positions": [-2, -1], "top_k": 2, "ln": "final"})
    rc, out, err = run("logit-lens", LENS_TEXT, "--positions", "-2,-1", "--top-k", "2",
                       "--ln", "final")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("model attnscope-tiny-gpt2  ln final  add_bos True")
    (pr,) = got["prompts"]
    T = pr["n_tokens"]
    for s in pr["states"]:
        rows = [ln for ln in lines if ln.startswith(s["label"] + " ")]
        assert len(rows) == 2, (s["label"], out)  # the top-token table and the rank table
        top = s["positions"][-1]["top"][0]
        assert f"{top['label']!r} {top['prob']:.2f}" in rows[0]
        rank = s["positions"][0]["target"]  # position T-2: the next token is the last one
        assert f"{rank['rank']} ({rank['prob']:.2f})" in rows[1]
        assert s["positions"][1]["target"] is None  # the last position has no next token
        assert rows[1].rstrip().endswith(f"{rank['rank']} ({rank['prob']:.2f})")
    assert f"{T - 2}:' on'" in out and f"{T - 1}:' the'" in out
    rc, out, err = run("logit-lens", LENS_TEXT, "--target", " sat", "--target-id", "5")
    assert rc == 2 and "--target or --target-id" in err
    rc, out, err = run("logit-lens", LENS_TEXT, "--target", " mat")  # two tokens here
    assert rc == 1 and "param target" in err and "not one" in err


def test_logit_attribution_command(run, live_server):
    rc, out, err = run("logit-attribution", LENS_TEXT, "--target", " m", "--distractor",
                       " sat", "--json")
    assert rc == 0, err
    got = json.loads(out)
    assert got == _served(live_server, "/v1/logit-attribution", {
        "text": LENS_TEXT, "target": " m", "distractor": " sat"})
    rc, out, err = run("logit-attribution", LENS_TEXT, "--target", " m", "--distractor",
                       " sat", "--top", "3")
    assert rc == 0, err
    (d,) = got["prompts"][0]["positions"]
    assert f"logit[' m'] - logit[' sat'] = {d['logit_diff']:.3g}" in out
    for layer, row in enumerate(d["heads"]):  # the [layer, head] table with b_O and MLP
        cells = [f"{v:+.3f}" for v in row] + [f"{d['attn_bias'][layer]:+.3f}",
                                              f"{d['mlp'][layer]:+.3f}"]
        assert any(ln.split() == [str(layer), *cells] for ln in out.splitlines()), out
    parts = {"embed": d["embed"], "pos_embed": d["pos_embed"],
             **{f"L{la}H{h}": v for la, r in enumerate(d["heads"]) for h, v in enumerate(r)},
             **{f"MLP{la}": v for la, v in enumerate(d["mlp"])},
             **{f"b_O{la}": v for la, v in enumerate(d["attn_bias"])}}
    top = sorted(parts.items(), key=lambda x: -abs(x[1]))[:3]
    assert "largest parts: " + ", ".join(f"{n} {v:+.3f}" for n, v in top) in out
    rc, out, err = run("logit-attribution", LENS_TEXT)
    assert rc == 2 and "--target" in err
    rc, out, err = run("logit-attribution", LENS_TEXT, "--target-id", "1254", "--json")
    assert rc == 0 and json.loads(out)["prompts"][0]["positions"][0]["target"] == 1254


def test_circuits_command(run, live_server):
    rc, out, err = run("circuits", "--json")
    assert rc == 0, err
    got = json.loads(out)
    assert got == _served(live_server, "/v1/circuits", {})
    rc, out, err = run("circuits", "--top", "2")
    assert rc == 0, err
    L, H = got["n_layers"], got["n_heads"]
    rows = [ln.split() for ln in out.splitlines()]
    for h in got["heads"]:
        assert [str(h["layer"]), str(h["head"]), f"{h['copying_score']:+.3f}",
                f"{h['positive_eigenvalue_share']:.3f}"] in [r[:4] for r in rows]
    for kind in ("q", "k", "v"):  # the strongest pair of each kind, computed here
        g = got["composition"][kind]
        best = max((g[la][ha][lb][hb], la, ha, lb, hb) for la in range(L) for ha in range(H)
                   for lb in range(la + 1, L) for hb in range(H))
        s, la, ha, lb, hb = best
        i = out.index(f"{kind.upper()}-composition")
        assert [f"L{la}H{ha}", f"L{lb}H{hb}", f"{s:.3f}"] == out[i:].splitlines()[3].split()
    rc, out, err = run("circuits", "--no-composition", "--top-k", "2", "--json")
    got = json.loads(out)
    assert rc == 0 and got["composition"] is None
    assert all(len(h["ov_singular_values"]) == 2 for h in got["heads"])
    rc, out, err = run("circuits", "--top-k", "0")
    assert rc == 2 and "top_k" in err


def test_path_patch_command(run, live_server, tmp_path):
    clean, corrupted = (",".join(map(str, t)) for t in PAIR)
    args = ("path-patch", "--clean-tokens", clean, "--corrupted-tokens", corrupted,
            "--senders", "0:1", "--receivers", "1:k", "--positions", "-4,-3,-2")
    rc, out, err = run(*args, "--json")
    assert rc == 0, err
    got = json.loads(out)
    assert got == _served(live_server, "/v1/path-patch", {
        "pairs": [{"clean_tokens": PAIR[0], "corrupted_tokens": PAIR[1]}],
        "senders": [{"kind": "head", "layer": 0, "head": 1}],
        "receivers": [{"kind": "head", "layer": 1, "input": "k"}],
        "metric": {"kind": "loss", "terms": [{"position": q} for q in (-4, -3, -2)]}})
    rc, out, err = run(*args)
    assert rc == 0, err
    assert f"path-patched       {got['patched']['mean']:.3g}" in out
    assert f"= {got['normalized']:+.3g}" in out and "L0H1 -> receivers L1H0/1/2/3.k" in out
    # the same pair as texts, a logit-difference metric, MLP senders, the logits as receiver
    rc, out, err = run("path-patch", "The cat sat on the", "The dog sat on the", "--senders",
                       "0:1,mlp0", "--receivers", "logits", "--target", " m", "--distractor",
                       " sat", "--json")
    assert rc == 0, err
    assert json.loads(out) == _served(live_server, "/v1/path-patch", {
        "pairs": [{"clean_text": "The cat sat on the", "corrupted_text": "The dog sat on the"}],
        "senders": [{"kind": "head", "layer": 0, "head": 1}, {"kind": "mlp", "layer": 0}],
        "receivers": [{"kind": "logits"}],
        "metric": {"kind": "logit_diff", "terms": [
            {"position": -1, "target": " m", "distractor": " sat"}]}})
    # the grid: the strongest cells of each input, by |normalised|
    rc, out, err = run("path-patch", "--clean-tokens", clean, "--corrupted-tokens", corrupted,
                       "--grid", "--top", "1", "--json")
    g = json.loads(out)["grid"]
    rc, out, err = run("path-patch", "--clean-tokens", clean, "--corrupted-tokens", corrupted,
                       "--grid", "--top", "1")
    assert rc == 0, err
    for k, inp in enumerate(g["inputs"]):
        cells = [(abs(v[k]), v[k], ls, hs, lr, hr) for ls, a in enumerate(g["normalized"])
                 for hs, b in enumerate(a) for lr, c in enumerate(b) for hr, v in enumerate(c)
                 if v[k] is not None]
        _, v, ls, hs, lr, hr = max(cells)
        i = out.index(f"receiver input {inp}:")
        assert out[i:].splitlines()[3].split()[:3] == [f"L{ls}H{hs}", f"L{lr}H{hr}.{inp}",
                                                      f"{v:+.3g}"]
    # a dataset of pairs from --request
    req = tmp_path / "pairs.json"
    req.write_text(json.dumps({"pairs": [{"clean_tokens": PAIR[0], "corrupted_tokens": PAIR[1]},
                                         {"clean_tokens": PAIR[1], "corrupted_tokens": PAIR[0]}],
                               "per_pair": True}))
    rc, out, err = run("path-patch", "--request", str(req), "--senders", "0:1",
                       "--receivers", "1:3:k,mlp1", "--json")
    assert rc == 0, err
    got = json.loads(out)
    assert got["base"]["n"] == 2 and len(got["patched"]["values"]) == 2
    assert got["receivers"][0]["heads"] == [3]


@pytest.mark.parametrize("args, words", [
    (["path-patch", "a b", "c d"], ["--senders", "--grid"]),
    (["path-patch", "a b"], ["give both prompts"]),
    (["path-patch", "--senders", "0:1", "--receivers", "1:k"], ["give the prompts"]),
    (["path-patch", "a b", "c d", "--senders", "0:x", "--receivers", "1:k"],
     ["'0:x': expected LAYER:HEAD"]),
    (["path-patch", "a b", "c d", "--senders", "0:1", "--receivers", "1:k", "--metric",
      "logit_diff", "--target", " m"], ["--metric logit_diff needs --distractor"]),
    (["path-patch", "a b", "c d", "--senders", "0:1", "--receivers", "1:k", "--metric",
      "loss", "--target", " m"], ["--target is not used by --metric loss"]),
    (["path-patch", "a b", "c d", "--option", "senders=[]"], ["--option senders: give it as --senders"]),
])
def test_path_patch_usage_errors(run, args, words):
    rc, out, err = run(*args)
    assert rc == 2, err
    for w in words:
        assert w in err, (w, err)


def test_path_patch_server_errors_name_the_field(run):
    rc, out, err = run("path-patch", "a b", "c d e f", "--senders", "0:1", "--receivers",
                       "1:k", "--no-add-bos")
    assert rc == 1 and "server error 422" in err and "pairs" in err
    rc, out, err = run("path-patch", "a b", "c d", "--senders", "1:0", "--receivers", "0:k")
    assert rc == 1 and "server error 422" in err
