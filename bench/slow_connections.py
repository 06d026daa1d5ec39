"""Slow-loris against ``attnscope serve``'s server (issue 29 item 7): N connections trickle
their headers one byte per second (each one closed by the server is reopened at once) while a normal client asks ``/v1/model`` and a probe asks
``/healthz`` (each on a fresh connection); prints the share of each answered 200.

Defaults: max_connections 1024 and 1,030 slow connections (the breaker's figures), the
bundled model, the server in a thread of this process. ``--old``: no slow-sender eviction and
no per-client limit (the behaviour before issue 29: only idle connections were evicted).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/slow_connections.py [--slow 1030] [--old]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import threading
import time

import httpx


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slow", type=int, default=1030)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--old", action="store_true")
    args = ap.parse_args()

    from attnscope.service.app import create_app
    from attnscope.service.config import Settings
    from attnscope.service.server import DrainingServer, serve_async, uvicorn_config

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    extra = {"slow_sender_s": 1e9, "max_client_connections": 0} if args.old else {}
    settings = Settings(model="bundled", port=port, max_connections=1024, log_level="error",
                        log_format="text", **extra)
    app = create_app(settings)
    server = DrainingServer(uvicorn_config(app, settings), app)
    th = threading.Thread(target=lambda: asyncio.run(serve_async(server, app, settings)),
                          daemon=True)
    th.start()
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)

    socks: list[socket.socket] = []
    reopened = [0]
    stop = threading.Event()
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4096

    def trickle():
        for _ in range(args.slow):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.setblocking(False)
            socks.append(s)
        i = 0
        while not stop.is_set():
            for n, s in enumerate(socks):
                try:
                    gone = s.recv(65536) is not None  # answered (408/503) or closed
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:  # a persistent attacker: the slot is taken again at once
                    s.close()
                    try:
                        s = socks[n] = socket.create_connection(("127.0.0.1", port), timeout=30)
                        s.setblocking(False)
                        reopened[0] += 1
                    except OSError:
                        continue
                try:
                    s.send(head[i % len(head):i % len(head) + 1])
                except (BlockingIOError, OSError):
                    pass
            i += 1
            stop.wait(1.0)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    while len(socks) < args.slow:
        time.sleep(0.1)
    time.sleep(2.0)  # every slow connection has sent bytes: none is idle

    def share(path: str) -> tuple[float, dict]:
        codes: dict = {}
        for _ in range(args.requests):
            try:
                code = httpx.get(url + path, timeout=10).status_code
            except httpx.HTTPError as exc:
                code = type(exc).__name__
            codes[code] = codes.get(code, 0) + 1
        return codes.get(200, 0) / args.requests, codes

    client, client_codes = share("/v1/model")
    probe, probe_codes = share("/healthz")
    stop.set()
    for s in socks:
        s.close()
    mode = "old (idle eviction only)" if args.old else "new (slow senders evicted, per-client limit)"
    print(f"{args.slow} slow connections (1 byte/s headers), max_connections 1024, {mode}: "
          f"normal client /v1/model {client:.1%} answered 200 {client_codes}; /healthz "
          f"{probe:.1%} {probe_codes}; the attacker reopened {reopened[0]} connections")
    server.should_exit = True
    th.join(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
