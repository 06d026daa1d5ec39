"""``scripts/install`` (what ``scripts/serve`` and ``scripts/test`` run first): pip runs only
when the environment is not already installed for this pyproject.toml, serve installs no
test extras, and a test install also satisfies serve. Checked on a copy of the script and
pyproject.toml with a ``.venv/bin/python`` that records its pip calls (and passes every other
call to the real interpreter), so nothing is installed. The real timings (fresh clone, venv
size, restart) are printed by ``bench/quickstart.sh``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def _env(tmp_path: Path) -> tuple[Path, Path]:
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_ = tmp_path / ".venv" / "bin"
    bin_.mkdir(parents=True)
    log = tmp_path / "pip-calls.log"
    (bin_ / "python").write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1 $2" = "-m pip" ]; then echo "$*" >> {log}; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n')
    (bin_ / "python").chmod(0o755)
    (bin_ / "attnscope").write_text("#!/bin/sh\n")
    (bin_ / "attnscope").chmod(0o755)
    return log, tmp_path


def _install(root: Path, mode: str, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    r = subprocess.run(["bash", str(root / "scripts" / "install"), mode], cwd=root,
                       capture_output=True, text=True, timeout=120,
                       env={**base, "PYTHON": sys.executable, **env})
    assert r.returncode == 0, r.stderr
    return r


def _calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_serve_installs_without_test_extras_once(tmp_path):
    log, root = _env(tmp_path)
    _install(root, "serve")
    assert _calls(log) == ["-m pip install -q --no-compile --disable-pip-version-check -e ."]  # the serving dependencies only
    _install(root, "serve")
    _install(root, "serve")
    assert len(_calls(log)) == 1  # up to date: no pip at all
    _install(root, "test")  # the test extras are not there yet
    assert _calls(log)[1:] == ["-m pip install -q --no-compile --disable-pip-version-check -e .[test]"]
    _install(root, "test")
    _install(root, "serve")  # a test install satisfies serve
    assert len(_calls(log)) == 2


def test_pip_compiles_only_where_python_keeps_no_bytecode(tmp_path):
    """pip byte-compiling all of torch costs ~40 s, which Python does lazily and keeps; where
    PYTHONDONTWRITEBYTECODE is set it keeps nothing, so pip compiles once."""
    log, root = _env(tmp_path)
    _install(root, "serve", PYTHONDONTWRITEBYTECODE="1")
    assert _calls(log) == ["-m pip install -q --compile --disable-pip-version-check -e ."]


def test_a_changed_pyproject_or_a_forced_reinstall_runs_pip(tmp_path):
    log, root = _env(tmp_path)
    _install(root, "test")
    _install(root, "test")
    assert len(_calls(log)) == 1
    with open(root / "pyproject.toml", "a") as f:
        f.write("\n# a new dependency would be here\n")
    _install(root, "test")
    assert len(_calls(log)) == 2
    _install(root, "test", ATTNSCOPE_REINSTALL="1")
    assert len(_calls(log)) == 3
    os.remove(root / ".venv" / "bin" / "attnscope")  # a broken venv is not "up to date"
    _install(root, "test")
    assert len(_calls(log)) == 4


def test_scripts_serve_and_test_name_their_mode():
    assert "./scripts/install serve" in (ROOT / "scripts" / "serve").read_text()
    assert "./scripts/install test" in (ROOT / "scripts" / "test").read_text()
    r = subprocess.run(["bash", str(ROOT / "scripts" / "install"), "nonsense"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage" in r.stderr
