"""docker-compose.yml's replicas behind haproxy, checked statically (no Docker engine here):
the compose wiring, and deploy/haproxy/haproxy.cfg -- the file the proxy container mounts --
accepted by haproxy's own parser (``haproxy -c``) in its compose form (DNS server-template)
and in the loopback form the scale-out test runs. A planted error makes the parser fail."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CFG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
_spec = importlib.util.spec_from_file_location("loopback_cluster", ROOT / "deploy" / "loopback_cluster.py")
lc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lc)


def _default(v: str) -> str:
    """compose's ${VAR:-default} with VAR unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v))


def _haproxy_check(cfg_text: str, tmp_path: Path, env: dict[str, str]):
    if shutil.which("haproxy") is None:
        pytest.fail("haproxy is not installed: apt-get install -y haproxy (./scripts/test does it)")
    p = tmp_path / "haproxy.cfg"
    p.write_text(cfg_text)
    return subprocess.run(["haproxy", "-c", "-f", str(p)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)


def test_compose_replicas_behind_the_proxy():
    c = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    app, proxy = c["services"]["attnscope"], c["services"]["proxy"]
    assert "ports" not in app, "replicas must not bind host ports (the proxy does)"
    assert int(_default(app["deploy"]["replicas"])) >= 2
    assert app["expose"] == [app["environment"]["ATTNSCOPE_PORT"]]
    assert _default(app["environment"]["OMP_NUM_THREADS"]) == "1"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in proxy["volumes"]}
    assert mounts["/usr/local/etc/haproxy/haproxy.cfg"] == "./deploy/haproxy/haproxy.cfg"
    assert (ROOT / "deploy" / "haproxy" / "haproxy.cfg").is_file()
    assert proxy["depends_on"]["attnscope"]["condition"] == "service_healthy"
    assert "8000:8000" in proxy["ports"]
    assert proxy["environment"]["ATTNSCOPE_LB_BIND"] == ":8000"
    # the proxy finds the replicas by the service's DNS name and port, with enough slots
    text = CFG.read_text()
    m = re.search(r"^\s*server-template (\S+) (\d+) (\S+):(\d+) ", text, re.M)
    assert m, "no server-template line"
    assert m.group(3) == "attnscope" and m.group(4) == app["environment"]["ATTNSCOPE_PORT"]
    assert int(m.group(2)) >= int(_default(app["deploy"]["replicas"]))


def test_haproxy_config_parses_in_both_forms(tmp_path):
    env = {"ATTNSCOPE_LB_BIND": f"127.0.0.1:{lc.free_port()}",
           "HAPROXY_STATS_BIND": f"127.0.0.1:{lc.free_port()}",
           "HAPROXY_ADMIN_SOCKET": str(tmp_path / "admin.sock")}
    compose_form = _haproxy_check(CFG.read_text(), tmp_path, env)
    assert compose_form.returncode == 0, compose_form.stdout + compose_form.stderr
    loopback = lc.render_haproxy_config([("r1", 20001), ("r2", 20002)])
    assert "server-template" not in loopback and "server r2 127.0.0.1:20002" in loopback
    # outside the servers block, the file the test runs is the shipped file, line for line
    strip = lambda t: [ln for ln in t.splitlines() if not ln.strip().startswith(("server ", "server-template", "#"))]
    assert strip(loopback) == strip(CFG.read_text())
    res = _haproxy_check(loopback, tmp_path, env)
    assert res.returncode == 0, res.stdout + res.stderr


def test_planted_haproxy_error_fails_the_parser(tmp_path):
    broken = CFG.read_text().replace("balance leastconn", "balance leastconnections")
    res = _haproxy_check(broken, tmp_path, {"HAPROXY_ADMIN_SOCKET": str(tmp_path / "a.sock")})
    assert res.returncode != 0 and "ALERT" in res.stdout + res.stderr
