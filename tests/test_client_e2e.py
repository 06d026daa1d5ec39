"""The client, the command line and the corpus pipeline against a real uvicorn on 127.0.0.1;
the client installed alone (no torch) in a fresh virtual environment."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

import attnscope.client as ac
from attnscope.client import AsyncClient, Client
from conftest import ROOT, SENTENCE, free_port

pytestmark = pytest.mark.e2e

CLI = [sys.executable, "-m", "attnscope.client.cli"]


def cli(*args, url=None, input=None, timeout=120, env=None):
    full = {**os.environ, **(env or {})}
    if url:
        full["ATTNSCOPE_BASE_URL"] = url
    return subprocess.run([*CLI, *args], capture_output=True, text=True, input=input,
                          timeout=timeout, env=full)


# -- the client over real HTTP ------------------------------------------------------------

def test_client_against_real_uvicorn(live_server):
    with Client(live_server.url) as c:
        assert c.wait_until_ready(timeout=10)["status"] == "ready"
        info = c.model()
        res = c.attention(SENTENCE, layers=[1], encoding="base64")
        p = res.attention.pattern.numpy()
        assert p.shape == (1, info.n_heads, len(res.attention.tokens), len(res.attention.tokens))
        np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)
        with pytest.raises(ac.ContextLengthExceededError):
            c.attention("word " * 400)

    async def go():
        async with AsyncClient(live_server.url) as c:
            return await asyncio.gather(*(c.attention(f"text {i}", layers=[0], head_mean=True)
                                          for i in range(8)))

    for r in asyncio.run(go()):
        assert r.attention.pattern.numpy().ndim == 3


# -- the command line ---------------------------------------------------------------------

def run(capsys, monkeypatch, url, *args, stdin=None):
    """The command line in-process (no interpreter start-up): (exit code, stdout, stderr)."""
    import io

    from attnscope.client.cli import main

    monkeypatch.setenv("ATTNSCOPE_BASE_URL", url)
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    capsys.readouterr()
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_readable_output_json_and_plot(live_server, tmp_path, capsys, monkeypatch):
    url = live_server.url
    # the text's own tokens (--no-add-bos): 'Then' first
    rc, out, err = run(capsys, monkeypatch, url, "links", "Then I tried to find some way",
                       "--no-add-bos")
    assert rc == 0, err
    lines = [l for l in out.splitlines() if " --> " in l]
    assert len(lines) == 7  # every token but the first has an earlier key
    q, _, rest = lines[0].partition(" --> ")
    assert q.strip() == "1:' I'" and rest.split()[0] == "0:'Then'"
    assert 0 <= float(rest.split()[-1]) <= 1

    rc, out, err = run(capsys, monkeypatch, url, "heads", SENTENCE, "--json")
    assert rc == 0, err
    assert len(json.loads(out)["heads"]) == 8
    rc, out, err = run(capsys, monkeypatch, url, "heads", SENTENCE, "--plot",
                       str(tmp_path / "h.png"))
    assert rc == 0 and (tmp_path / "h.png").stat().st_size > 5000
    table = out.splitlines()
    assert table[1].split()[:3] == ["layer", "head", "label"] and len(table) == 3 + 8

    rc, out, err = run(capsys, monkeypatch, url, "attention", "-", "--layers", "0",
                       "--head-mean", "--plot", str(tmp_path / "a.png"), stdin="Then I tried")
    assert rc == 0 and "layer 0, mean of heads" in out
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    for cmd in (["model"], ["tokenize", "a b"], ["trajectories", SENTENCE], ["verify", "a b c"]):
        rc, out, err = run(capsys, monkeypatch, url, *cmd)
        assert rc == 0, (cmd, err)
    assert "PASSED" in out and "q/k/v" not in out
    rc, out, err = run(capsys, monkeypatch, url, "verify", "a b c", "--projections")
    assert rc == 0 and "q/k/v max|diff|" in out and "PASSED" in out, err


def test_cli_exit_codes(live_server, capsys, monkeypatch):
    url = live_server.url
    rc, _, err = run(capsys, monkeypatch, url, "attention", "x", "--layers", "7")
    assert rc == 1 and "out_of_range" in err
    rc, _, err = run(capsys, monkeypatch, url, "attention", "   ")  # refused before sending
    assert rc == 2 and "text" in err
    rc, _, err = run(capsys, monkeypatch, url, "attention", "x", "--option", "nonsense_option=1")
    assert rc == 2
    rc, _, err = run(capsys, monkeypatch, url, "links")  # missing TEXT
    assert rc == 2
    rc, _, err = run(capsys, monkeypatch, f"http://127.0.0.1:{free_port()}", "model",
                     "--max-retries", "0")
    assert rc == 3 and "connection failure" in err
    # the same through a real process
    r = cli("attention", "x", "--layers", "7", url=url)
    assert r.returncode == 1 and "out_of_range" in r.stderr


def test_serve_still_works_through_the_console_script():
    script = Path(sys.executable).parent / "attnscope"
    r = subprocess.run([str(script), "serve", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "--model" in r.stdout and "--port" in r.stdout
    r = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "serve" in r.stdout and "batch" in r.stdout


# -- the corpus pipeline ------------------------------------------------------------------

def _ids(path: Path, torn_ok: bool = False) -> list:
    """Ids of a JSONL file; ``torn_ok``: a run was killed, its last line may be half written."""
    if not path.exists():
        return []
    lines = [l for l in path.read_text().splitlines() if l.strip()]
    if torn_ok and lines:
        try:
            json.loads(lines[-1])
        except ValueError:
            lines = lines[:-1]
    return [json.loads(l)["id"] for l in lines]


def test_batch_killed_and_resumed_every_id_exactly_once(live_server, tmp_path):
    n = 300
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    fails = tmp_path / "out.jsonl.failures.jsonl"
    bad = {f"doc-{i}" for i in (17, 130, 244)}  # too long for the context
    with src.open("w") as f:
        for i in range(n):
            text = "word " * 300 if f"doc-{i}" in bad else f"Line {i}: let there be light."
            f.write(json.dumps({"id": f"doc-{i}", "text": text}) + "\n")
        f.write(json.dumps({"id": "blank", "text": "   "}) + "\n")
        f.write("{not json\n")
    args = [*CLI, "batch", str(src), "-o", str(out), "-a", "attention",
            "--params", '{"attention": {"layers": [0], "head_mean": true, "round": 3}}',
            "-c", "4", "--url", live_server.url]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while len(_ids(out, torn_ok=True)) < 60:  # wait for the event: 60 items written
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    first = len(_ids(out, torn_ok=True))
    assert 60 <= first < n
    with out.open("ab") as f:  # as if killed in the middle of a write
        f.write(b'{"id": "doc-torn", "res')

    r = subprocess.run(args, capture_output=True, text=True, timeout=180)
    assert r.returncode == 4, r.stderr  # finished, with failed items
    summary = r.stderr.strip().splitlines()[-1]
    assert "done" in summary and "failed" in summary and "items/s" in summary
    skipped = int(summary.split("skipped ")[1].split(",")[0])
    assert skipped >= first
    assert "\r" in r.stderr or "batch" in r.stderr  # progress on stderr

    done, failed = _ids(out), _ids(fails)
    expected = {f"doc-{i}" for i in range(n)} | {"blank", "line:302"}
    assert len(done) == len(set(done)) and len(failed) == len(set(failed))
    assert not set(done) & set(failed)
    assert set(done) | set(failed) == expected
    assert set(failed) == bad | {"blank", "line:302"}
    recs = {json.loads(l)["id"]: json.loads(l) for l in fails.read_text().splitlines()}
    assert recs["doc-17"]["error"]["type"] == "context_length_exceeded"
    assert recs["blank"]["error"]["type"] == "validation_error"
    assert recs["line:302"]["error"]["type"] == "invalid_input"
    row = json.loads(out.read_text().splitlines()[0])
    att = row["results"]["attention"]["attention"]
    assert att["layers"] == [0] and np.asarray(att["pattern"]).ndim == 3

    # a third run does nothing; --retry-failed retries only the failures (they fail again)
    r = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=60)
    s = json.loads(r.stdout)
    assert (s["done"], s["failed"], s["skipped"]) == (0, 0, n + 2)
    r = subprocess.run([*args, "--json", "--retry-failed"], capture_output=True, text=True,
                       timeout=60)
    s = json.loads(r.stdout)
    assert (s["done"], s["failed"]) == (0, len(bad) + 2)
    assert sorted(_ids(fails)) == sorted(failed) and sorted(_ids(out)) == sorted(done)


def test_batch_stops_with_exit_3_when_service_unreachable(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": "x"}) + "\n" for i in range(5)))
    r = cli("batch", str(src), "-o", str(tmp_path / "o.jsonl"), "--max-retries", "0",
            url=f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 3 and "STOPPED: connection failure" in r.stderr
    assert _ids(tmp_path / "o.jsonl") == [] and _ids(tmp_path / "o.jsonl.failures.jsonl") == []


# -- the client alone, in a fresh virtual environment -------------------------------------

def test_client_installs_alone_without_torch(live_server, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py, pip = venv / "bin" / "python", [str(venv / "bin" / "python"), "-m", "pip"]
    wheels = tmp_path / "wheels"
    r = subprocess.run([*pip, "wheel", "--no-deps", "-w", str(wheels),
                        str(ROOT / "clients" / "python")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (whl,) = wheels.glob("attnscope_client-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    for f in ("attnscope/client/_client.py", "attnscope/client/plots.py",
              "attnscope/schemas/__init__.py", "attnscope/schemas/attention.py"):
        assert f in names
    assert not any(n.startswith("attnscope/service") for n in names)
    r = subprocess.run([*pip, "install", str(whl)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    code = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('torch') is None, 'torch must not be installed'\n"
        "from attnscope.client import Client\n"
        "import attnscope.schemas\n"
        f"c = Client({live_server.url!r})\n"
        "r = c.attention('Then I tried', layers=[0], encoding='base64')\n"
        "a = r.attention.pattern.numpy()\n"
        "print(a.shape, a.dtype, 'torch' in sys.modules)\n"
    )
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    with Client(live_server.url) as c:
        n = c.tokenize("Then I tried").tokens.n_tokens
    assert r.stdout.split() == ["(1,", "4,", f"{n},", f"{n})", "float32", "False"]
    exe = venv / "bin" / "attnscope"
    r = subprocess.run([str(exe), "links", "Then I tried", "--url", live_server.url],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and " --> " in r.stdout
    r = subprocess.run([str(exe), "serve", "--model", "bundled"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "service is not installed" in r.stderr
