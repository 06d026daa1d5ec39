"""Every snippet of README.md's client / command line / pipeline section runs against a real
uvicorn: ```python blocks with exec, ```bash blocks with bash -e, in a scratch directory."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.e2e

BEGIN, END = "<!-- readme-snippets: begin -->", "<!-- readme-snippets: end -->"


def snippets() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    section = text.split(BEGIN)[1].split(END)[0]
    return re.findall(r"```(python|bash)\n(.*?)```", section, flags=re.S)


def test_the_section_has_client_cli_and_pipeline_snippets():
    blocks = snippets()
    langs = [lang for lang, _ in blocks]
    assert langs.count("python") >= 2 and langs.count("bash") >= 2
    assert any("attnscope batch" in code for _, code in blocks)


@pytest.mark.parametrize("index", range(len(snippets())))
def test_readme_snippet_runs(index, live_server, tmp_path, monkeypatch):
    lang, code = snippets()[index]
    monkeypatch.chdir(tmp_path)
    if lang == "python":
        monkeypatch.setenv("ATTNSCOPE_BASE_URL", live_server.url)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"README.md snippet {index}", "exec"), {"__name__": "__readme__"})
        assert out.getvalue() or list(tmp_path.iterdir())
        for name in re.findall(r'savefig\("([^"]+)"\)', code):
            assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    else:
        env = {**os.environ, "ATTNSCOPE_BASE_URL": live_server.url,
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, f"snippet {index} failed:\n{code}\n{r.stdout}\n{r.stderr}"
        if "attnscope batch" in code:
            lines = (tmp_path / "results.jsonl").read_text().splitlines()
            assert len(lines) == 2 and "skipped 2" in r.stderr
