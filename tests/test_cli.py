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
