"""N ``attnscope serve`` replicas on 127.0.0.1 behind a real haproxy, without Docker.

The same haproxy configuration as docker-compose.yml (``deploy/haproxy/haproxy.cfg``), with its
DNS ``server-template`` line replaced by one ``server`` line per loopback replica. Used by
tests/test_scaleout.py and scripts/scaleout_bench.py; runnable by hand:

    .venv/bin/python deploy/loopback_cluster.py --replicas 3 --port 8000   # Ctrl-C stops all

Every process (replicas, haproxy) runs in its own process group and is killed by group on
``close()`` (also on an exception in ``with LoopbackCluster(...)``). Ports are picked at random
in 20000-60000 and checked free on 127.0.0.1 first. Needs ``haproxy`` on PATH (Debian's
``haproxy`` package; ``scripts/test`` installs it).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
HAPROXY_CFG = HERE / "haproxy" / "haproxy.cfg"
BACKEND = "attnscope"


def free_port(rng: random.Random | None = None) -> int:
    """A random port in 20000-60000 that nothing listens on at 127.0.0.1 right now."""
    rng = rng or random.SystemRandom()
    for _ in range(200):
        port = rng.randint(20000, 60000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port found in 20000-60000")


def render_haproxy_config(servers: list[tuple[str, int]], template: Path = HAPROXY_CFG) -> str:
    """``template`` with the lines between ``# BEGIN servers`` and ``# END servers`` replaced
    by ``server NAME 127.0.0.1:PORT`` for each ``(name, port)``; everything else (balance,
    checks, retries, timeouts) is the shipped configuration, unchanged."""
    out, inside, seen = [], False, False
    for line in template.read_text().splitlines():
        s = line.strip()
        if s.startswith("# BEGIN servers"):
            inside = seen = True
            out.append(line)
            out.extend(f"    server {name} 127.0.0.1:{port}" for name, port in servers)
            continue
        if s.startswith("# END servers"):
            inside = False
        if not inside:
            out.append(line)
    if not seen or inside:
        raise ValueError(f"{template}: no '# BEGIN servers' ... '# END servers' block")
    return "\n".join(out) + "\n"


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session=True: the group id is the pid
    except ProcessLookupError:
        pass


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def attnscope_command() -> list[str]:
    """The ``attnscope`` console script next to this interpreter (else ``python -c``)."""
    exe = Path(sys.executable).parent / "attnscope"
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-c", "import sys; from attnscope.client.cli import main; sys.exit(main())"]


class Replica:
    """One ``attnscope serve --model bundled`` process on 127.0.0.1:``port``."""

    def __init__(self, name: str, port: int, workdir: Path, serve_args: list[str],
                 env: dict[str, str]):
        self.name, self.port, self.workdir = name, port, workdir
        self.serve_args, self.env = serve_args, env
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.log = workdir / f"{name}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.starts += 1
        with open(self.log, "ab") as log:
            log.write(f"--- start {self.starts} ---\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [*attnscope_command(), "serve", "--host", "127.0.0.1", "--port", str(self.port),
                 *self.serve_args],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Poll ``/readyz`` until 200; raises with the log tail if the process exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc and self.proc.returncode}):\n"
                                   + _tail(self.log))
            try:
                if httpx.get(self.url + "/readyz", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout} s:\n" + _tail(self.log))

    def send(self, sig: int) -> None:
        if self.proc is not None:
            _kill_group(self.proc, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Send ``sig`` to the process group and wait; SIGKILL if it outlives ``timeout``."""
        if self.proc is None:
            return None
        self.send(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill_group(self.proc, signal.SIGKILL)
            self.proc.wait(10)
        return self.proc.returncode


class Haproxy:
    """haproxy with the shipped configuration and ``servers`` (name, port) on 127.0.0.1,
    listening on ``port``; its admin socket and log live in ``workdir``."""

    def __init__(self, servers: list[tuple[str, int]], workdir: Path, port: int,
                 stats_port: int | None = None):
        if shutil.which("haproxy") is None:
            raise RuntimeError("haproxy is not installed (Debian: apt-get install -y haproxy)")
        self.servers, self.workdir, self.port = servers, Path(workdir), port
        self.stats_port = stats_port or free_port()
        self.admin_socket = self.workdir / f"haproxy-{port}.sock"
        self.log = self.workdir / f"haproxy-{port}.log"
        self.cfg = self.workdir / f"haproxy-{port}.cfg"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Haproxy:
        self.cfg.write_text(render_haproxy_config(self.servers))
        env = {**os.environ, "ATTNSCOPE_LB_BIND": f"127.0.0.1:{self.port}",
               "HAPROXY_STATS_BIND": f"127.0.0.1:{self.stats_port}",
               "HAPROXY_ADMIN_SOCKET": str(self.admin_socket)}
        check = subprocess.run(["haproxy", "-c", "-q", "-f", str(self.cfg)], env=env,
                               capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy -c failed:\n{check.stdout}{check.stderr}")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(["haproxy", "-db", "-f", str(self.cfg)], env=env,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("haproxy exited:\n" + _tail(self.log))
            try:
                self.admin("show info")
                return self
            except OSError:
                time.sleep(0.1)
        self.close()
        raise TimeoutError("haproxy admin socket did not come up:\n" + _tail(self.log))

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _kill_group(self.proc, signal.SIGKILL)
            self.proc.wait(10)

    def __enter__(self) -> Haproxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def admin(self, command: str) -> str:
        """One command on haproxy's admin socket (runtime API); returns its answer."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(self.admin_socket))
            s.sendall(command.encode() + b"\n")
            chunks = []
            while True:
                b = s.recv(65536)
                if not b:
                    break
                chunks.append(b)
        return b"".join(chunks).decode()

    def stats(self) -> dict[str, dict[str, str]]:
        """haproxy's ``show stat`` rows for the attnscope proxies, by server name, with
        ``FRONTEND`` and ``BACKEND`` rows: status, check_status, scur, stot, hrsp_5xx, wretr
        (connection retries), wredis (redispatches), eresp, ..."""
        text = self.admin("show stat").lstrip("# ")
        rows = {}
        for row in csv.DictReader(io.StringIO(text)):
            if row["pxname"] == BACKEND:
                rows[row["svname"]] = row
        return rows


class LoopbackCluster:
    """``n`` replicas and one haproxy; ``url`` is haproxy's address.

    ``serve_args`` go to every ``attnscope serve`` (default ``--model bundled``). The haproxy
    runtime API (``admin``) drains, readies and reports servers: ``stats()`` gives haproxy's
    own counters per server (status, current/total sessions, 5xx answers)."""

    def __init__(self, n: int, serve_args: list[str] | None = None, lb_port: int | None = None,
                 workdir: str | Path | None = None, replica_env: dict[str, str] | None = None):
        if shutil.which("haproxy") is None:
            raise RuntimeError("haproxy is not installed (Debian: apt-get install -y haproxy)")
        self.n = n
        self.serve_args = serve_args if serve_args is not None else [
            "--model", "bundled", "--log-format", "text"]
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="attnscope-cluster-")
            workdir = self._tmp.name
        self.workdir = Path(workdir)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSCOPE_")}
        env.update({"HF_HUB_OFFLINE": "1", **(replica_env or {})})
        ports: set[int] = set()
        while len(ports) < n + 2 - (lb_port is not None):
            ports.add(free_port())
        ports_l = sorted(ports, key=lambda _: random.random())
        self.lb_port = lb_port if lb_port is not None else ports_l.pop()
        self.stats_port = ports_l.pop()
        self.replicas = [Replica(f"r{i + 1}", ports_l[i], self.workdir, self.serve_args, env)
                         for i in range(n)]
        self.lb: Haproxy | None = None
        self.haproxy: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.lb_port}"

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, timeout: float = 240.0) -> LoopbackCluster:
        try:
            for r in self.replicas:
                r.start()
            self.start_haproxy()
            for r in self.replicas:
                r.wait_ready(timeout)
            for r in self.replicas:
                self.wait_status(r.name, "UP", timeout=30)
        except BaseException:
            self.close()
            raise
        return self

    def start_haproxy(self) -> None:
        self.lb = Haproxy([(r.name, r.port) for r in self.replicas], self.workdir,
                          self.lb_port, self.stats_port)
        self.lb.start()
        self.haproxy = self.lb.proc

    def close(self) -> None:
        """Kill every process this cluster started (SIGKILL to each process group)."""
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                r.stop(signal.SIGKILL, timeout=10)
        if self.lb is not None:
            self.lb.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LoopbackCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- haproxy runtime API --------------------------------------------------------------
    def admin(self, command: str) -> str:
        """One command on haproxy's admin socket; returns its answer."""
        return self.lb.admin(command)

    def stats(self) -> dict[str, dict[str, str]]:
        """haproxy's counters per server (see :meth:`Haproxy.stats`)."""
        return self.lb.stats()

    def wait_status(self, server: str, status: str, timeout: float = 30.0) -> None:
        """Wait until haproxy reports ``server``'s status starting with ``status`` (UP, DOWN,
        MAINT, DRAIN)."""
        deadline = time.monotonic() + timeout
        got = None
        while time.monotonic() < deadline:
            got = self.stats().get(server, {}).get("status", "")
            if got.startswith(status):
                return
            time.sleep(0.1)
        raise TimeoutError(f"haproxy: {server} is {got!r}, not {status} after {timeout} s")

    def set_state(self, server: str, state: str) -> None:
        """``set server attnscope/NAME state ready|drain|maint``."""
        answer = self.admin(f"set server {BACKEND}/{server} state {state}").strip()
        if answer:
            raise RuntimeError(f"haproxy: set server {server} state {state}: {answer}")

    # -- replica operations ---------------------------------------------------------------
    def kill(self, i: int) -> None:
        """SIGKILL replica ``i`` (no drain, no goodbye: a crash, an OOM kill)."""
        r = self.replicas[i]
        r.send(signal.SIGKILL)
        r.proc.wait(30)

    def restart(self, i: int, timeout: float = 180.0) -> None:
        """Start replica ``i`` again on its port and wait until haproxy has it UP."""
        r = self.replicas[i]
        r.start()
        r.wait_ready(timeout)
        self.wait_status(r.name, "UP", timeout=30)

    def replace(self, i: int, timeout: float = 180.0) -> None:
        """Rolling-restart step for replica ``i``: drain it in haproxy (no new requests),
        wait for its requests in flight to finish, put it in maintenance, SIGTERM it (uvicorn
        finishes what it holds), start a new process on the same port, wait for ``/readyz``,
        make it ready in haproxy and wait for UP."""
        r = self.replicas[i]
        self.set_state(r.name, "drain")
        deadline = time.monotonic() + 60
        while int(self.stats()[r.name]["scur"] or 0) > 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{r.name} still has requests after 60 s of drain")
            time.sleep(0.05)
        self.set_state(r.name, "maint")
        r.stop(signal.SIGTERM)
        r.start()
        r.wait_ready(timeout)
        self.set_state(r.name, "ready")
        self.wait_status(r.name, "UP", timeout=30)


# -- corpus and `attnscope batch` helpers (tests/test_scaleout.py, scripts/scaleout_bench.py) --
WORDS = ("the a model attention head layer token text cat sat on mat when then we I tried to "
         "see what it does and why one more time over every word of this small corpus").split()


def corpus_texts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct texts of 4-30 words (seeded), 5-60 tokens of the bundled model."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out = []
    while len(out) < n:
        t = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 30)))
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


def write_jsonl(path: str | Path, items: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for obj in items:
            f.write(json.dumps(obj) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    """Every line of a JSONL file (none if it does not exist)."""
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def count_lines(path: str | Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def start_batch(url: str, corpus: str | Path, output: str | Path, concurrency: int,
                *extra: str, log: str | Path | None = None) -> subprocess.Popen:
    """``attnscope batch CORPUS -o OUTPUT --url URL -c N --no-progress --json EXTRA...`` as a
    child process (stdout: the JSON summary; stderr: the summary line)."""
    cmd = [*attnscope_command(), "batch", str(corpus), "-o", str(output), "--url", url,
           "-c", str(concurrency), "--no-progress", "--json", *extra]
    err = open(log, "ab") if log else subprocess.PIPE
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def finish_batch(proc: subprocess.Popen, timeout: float = 900.0) -> tuple[int, dict]:
    """Wait for a :func:`start_batch` process; returns (exit code, JSON summary)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc, signal.SIGKILL)
        proc.wait(10)
        raise
    lines = [ln for ln in out.decode().splitlines() if ln.strip()]
    return proc.returncode, (json.loads(lines[-1]) if lines else {})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--port", type=int, default=None, help="haproxy's port (random if unset)")
    ap.add_argument("serve_args", nargs="*", help="after --: arguments for attnscope serve")
    args = ap.parse_args(argv)
    cluster = LoopbackCluster(args.replicas, args.serve_args or None, lb_port=args.port)
    with cluster:
        print(f"haproxy on {cluster.url} (stats http://127.0.0.1:{cluster.stats_port}/stats), "
              f"replicas " + ", ".join(f"{r.name}={r.url}" for r in cluster.replicas), flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
