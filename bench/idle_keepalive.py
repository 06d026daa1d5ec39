#!/usr/bin/env python
"""Event-loop lag under many idle keep-alive connections (issue 29 item 8: the breaker saw
1.35 s with 3,000). A real ``attnscope serve`` (bundled model, ``tests/lag_serve.py``: the
loop-lag probe of tests/loop_lag.py on its loop, one lag a line) and, in this process,
``--conns`` connections opened ``--burst`` at a time, each sending one ``GET /healthz`` with
keep-alive, reading its 200, then staying open and silent. Prints the probe's idle worst
lag, the worst lag while the connections were opened (beyond max_connections the oldest idle
ones are evicted) and while they were held, the 200s / 503s / closes seen, and the load.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/idle_keepalive.py [--conns 3000] [--burst 500]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _lags(path: Path, start: int) -> list[float]:
    return [float(x) for x in path.read_text().split()[start:]]


async def _one(port: int, got: dict, keep: list) -> None:
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        await w.drain()
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 120)
        code = head.split(b" ", 2)[1].decode()
        got[code] = got.get(code, 0) + 1
        keep.append(w)
    except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
        got[type(exc).__name__] = got.get(type(exc).__name__, 0) + 1


async def _flood(port: int, n: int, burst: int) -> tuple[dict, list]:
    got: dict = {}
    keep: list = []
    for i in range(0, n, burst):
        await asyncio.gather(*(_one(port, got, keep) for _ in range(min(burst, n - i))))
    return got, keep


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conns", type=int, default=3000)
    ap.add_argument("--burst", type=int, default=500)
    ap.add_argument("--hold-s", type=float, default=5.0)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    from conftest import start_server, stop_server

    with tempfile.TemporaryDirectory() as tmp:
        lag = Path(tmp) / "lag.log"
        srv = start_server(Path(tmp), "--model", "bundled", "--log-level", "warning",
                           lag_log=lag)
        try:
            port = int(srv.url.rsplit(":", 1)[1])
            time.sleep(2.0)
            n0 = len(_lags(lag, 0))
            time.sleep(2.0)
            idle = _lags(lag, n0)
            load0 = os.getloadavg()
            n1 = len(_lags(lag, 0))
            t = time.perf_counter()
            got, keep = asyncio.run(_hold(port, args, lag))
            opened_s = time.perf_counter() - t
            flood = _lags(lag, n1)
            print(f"connections {args.conns} (bursts of {args.burst}): answers {got}, "
                  f"{len(keep)} held open, opening took {opened_s:.2f} s")
            print(f"loop lag: idle worst {max(idle) * 1e3:.1f} ms ({len(idle)} wakes); "
                  f"during the flood and the hold worst {max(flood) * 1e3:.1f} ms, "
                  f"p99 {sorted(flood)[int(len(flood) * 0.99)] * 1e3:.1f} ms "
                  f"({len(flood)} wakes)")
            print(f"load {load0} -> {os.getloadavg()}")
        finally:
            stop_server(srv)
    return 0


async def _hold(port: int, args, lag: Path):
    got, keep = await _flood(port, args.conns, args.burst)
    await asyncio.sleep(args.hold_s)
    for w in keep:
        w.close()
    return got, keep


if __name__ == "__main__":
    sys.exit(main())
