#!/usr/bin/env python
"""Invalid request bodies that are cheap to send and were dear to refuse (issue 17, "Bounded
cost"): millions of invalid list elements or hundreds of thousands of unknown keys in one
body under max_body_bytes. Per body and server: the seconds to the 422, the slowest
``/healthz`` while it is refused (a probe process asks every 50 ms on a fresh connection),
the server's peak resident memory above where it was (``VmHWM`` reset through
``/proc/<pid>/clear_refs``) and its resident memory after, and how long a valid padded body (past the 64 KiB at which
bodies are parsed in the one-at-a-time worker thread) sent 0.2 s after the attack waits.

Several servers in one run (``--server NAME=PYTHON``, each python runs ``attnscope serve``
from its own checkout), attacks alternating between them:

    .venv/bin/python bench/bad_bodies.py --server before=/work/main/.venv/bin/python \\
        --server after=.venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import string
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import long_context  # noqa: E402  (its Server: one checkout's `attnscope serve`)


def _keys(n: int) -> list[str]:
    """``n`` (at most 2,383,280) distinct 4-character keys, none a field of any request (each
    starts with a digit)."""
    a = string.ascii_letters + string.digits
    return [string.digits[i // 238_328] + a[i // 3844 % 62] + a[i // 62 % 62] + a[i % 62]
            for i in range(n)]


def _obj(keys: list[str]) -> bytes:
    return b"{" + b",".join(b'"%s":0' % k.encode() for k in keys) + b"}"


ATTACKS = {
    "texts_1.9M_ints": ("/v1/attention", b'{"texts":[' + b",".join([b"5"] * 1_900_000) + b"]}"),
    "scratch_row_1.3M_strings": ("/v1/scratch-attention",
                                 b'{"q":[[' + b",".join([b'""'] * 1_300_000) + b']],'
                                 b'"k":[[1]],"v":[[1]]}'),
    "top_level_400k_keys": ("/v1/attention", b'{"text":"x",' + _obj(_keys(400_000))[1:]),
    "thresholds_400k_keys": ("/v1/heads", b'{"text":"x","thresholds":' + _obj(_keys(400_000))
                             + b"}"),
}
PADDED_OK = b" " * 70_000 + b'{"text": "a valid padded body"}'

_PROBE = r"""
import sys, time, httpx
url = sys.argv[1]
while True:
    t0 = time.perf_counter()
    try:
        ok = httpx.get(url + "/healthz", timeout=30).status_code == 200
    except httpx.HTTPError:
        ok = False
    print(time.perf_counter() - t0 if ok else "inf", flush=True)
    time.sleep(0.05)
"""


class Server(long_context.Server):
    """One checkout's server on the bundled model (bench/long_context.py), warmed: its first
    forward and its first big-body parse done."""

    def __init__(self, name: str, python: str, log: Path):
        super().__init__(python, "bundled", log, extra=())
        self.name = name
        for _ in range(2):
            httpx.post(self.url + "/v1/attention", content=PADDED_OK,
                       headers={"content-type": "application/json"}, timeout=120)

    def status(self) -> dict[str, int]:
        out = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
        return out


def attack(server: Server, path: str, body: bytes) -> dict:
    Path(f"/proc/{server.proc.pid}/clear_refs").write_text("5")
    before = server.status()["VmRSS"]
    probe = subprocess.Popen([sys.executable, "-c", _PROBE, server.url], stdout=subprocess.PIPE,
                             text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(probe.stdout), daemon=True)
    reader.start()
    while not lines:
        time.sleep(0.02)
    padded: dict = {}

    def valid():
        time.sleep(0.2)
        t0 = time.perf_counter()
        r = httpx.post(server.url + "/v1/attention", content=PADDED_OK,
                       headers={"content-type": "application/json"}, timeout=600)
        padded.update(status=r.status_code, s=time.perf_counter() - t0)

    th = threading.Thread(target=valid)
    t0 = time.perf_counter()
    th.start()
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"},
                   timeout=600)
    seconds = time.perf_counter() - t0
    th.join()
    time.sleep(0.2)
    probe.terminate()
    probe.wait(10)
    reader.join(10)
    lat = [float(x) for x in lines if x.strip()]
    err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith(
        "application/json") else {}
    return {"status": r.status_code, "seconds": round(seconds, 3),
            "healthz_worst_s": round(max(lat), 3), "healthz_probes": len(lat),
            "rss_peak_mib": round((server.status()["VmHWM"] - before) / 2**20),
            "rss_after_mib": round((server.status()["VmRSS"] - before) / 2**20),
            "padded_valid_status": padded.get("status"), "padded_valid_s": round(padded["s"], 3),
            "param": err.get("param"), "message": (err.get("message") or "")[:160]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", action="append", required=True, help="NAME=PYTHON")
    p.add_argument("--attack", action="append", choices=list(ATTACKS), help="default: all")
    args = p.parse_args()
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="bad-bodies-"))
    servers = [Server(n, py, tmp / f"{n}.log") for n, py in (s.split("=", 1) for s in args.server)]
    results: dict = {}
    try:
        for name in args.attack or list(ATTACKS):
            path, body = ATTACKS[name]
            for s in servers:
                res = attack(s, path, body)
                results.setdefault(name, {})[s.name] = res
                print(f"{name:26s} {s.name:8s} {len(body) / 1e6:4.1f} MB -> {res['status']} in "
                      f"{res['seconds']:7.3f} s; /healthz worst {res['healthz_worst_s']:6.3f} s "
                      f"({res['healthz_probes']} probes); RSS peak +{res['rss_peak_mib']} MiB, "
                      f"after {res['rss_after_mib']:+d} MiB; "
                      f"padded valid {res['padded_valid_status']} in {res['padded_valid_s']:.3f} s"
                      f"; param {res['param']!r}", flush=True)
    finally:
        for s in servers:
            s.stop()
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
