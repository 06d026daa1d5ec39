"""Device time after a 504 (issue 29 item 6): how long the device stays busy once a request's
deadline has passed, with the jobs' cancel tokens (default) and without (``--no-cancel``: the
old behaviour, the abandoned job runs to its end).

A random GPT-2-small-shaped model (12 layers, 12 heads, d_model 768, vocab 2048, the bundled
tokenizer), served by ``attnscope serve``'s server (DrainingServer) in a thread on 127.0.0.1;
the breaker's request: ``/v1/patch`` with ``per_position`` and ``residual`` at T = 16 (a
~300-byte body). Prints the 504's time, the time the device slot was free again, the gap,
and the device-work estimates of the breaker's other long requests (a path-patch grid of 256
pairs, a logit lens over 32 x 256 tokens) against ``max_request_flops``.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/cancel.py [--timeout-s 2] [--no-cancel]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def model_dir() -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from attnscope.service.config import BUNDLED_MODEL_DIR

    d = Path(tempfile.mkdtemp(prefix="gpt2-small-random-"))
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=2048, bos_token_id=0, eos_token_id=0)).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL_DIR / f, d / f)
    return d


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout-s", type=float, default=2.0)
    ap.add_argument("--no-cancel", action="store_true")
    ap.add_argument("--wait-s", type=float, default=300.0, help="most seconds to wait for the "
                    "device after the 504 (then reported as '>')")
    args = ap.parse_args()

    from attnscope.service.app import create_app
    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime
    from attnscope.service.serving.core import cancel
    from attnscope.service.server import DrainingServer, serve_async, uvicorn_config

    if args.no_cancel:
        cancel.running = lambda token: contextlib.nullcontext()  # the old behaviour
    d = model_dir()
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    settings = Settings(model=str(d), port=port, request_timeout_s=args.timeout_s,
                        log_level="warning", log_format="text")
    rt = Runtime.load(settings)
    app = create_app(settings, runtime=rt)
    server = DrainingServer(uvicorn_config(app, settings), app)
    th = threading.Thread(target=lambda: asyncio.run(serve_async(server, app, settings)),
                          daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    toks = list(range(10, 26))
    body = {"clean_tokens": toks, "corrupted_tokens": toks[:8] + toks[8:][::-1],
            "metric": "loss", "per_position": True, "residual": True}
    raw = json.dumps(body)
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/patch", content=raw,
                   headers={"content-type": "application/json"}, timeout=600)
    t504 = time.perf_counter() - t0
    free = None
    while time.perf_counter() - t0 < t504 + args.wait_s:
        if app.state.slot.depth == 0:
            free = time.perf_counter() - t0
            break
        time.sleep(0.01)
    mode = "without cancellation" if args.no_cancel else "with cancellation"
    gap = f"{free - t504:.3f} s" if free is not None else f"> {args.wait_s:g} s"
    print(f"/v1/patch per_position+residual T=16 ({len(raw)}-byte body), request_timeout_s="
          f"{args.timeout_s:g}, {mode}: status {r.status_code} at {t504:.3f} s; device free at "
          f"{'%.3f s' % free if free is not None else 'never (waited)'}; device busy after the "
          f"504: {gap}")
    # the estimates of the breaker's other long requests
    with httpx.Client(base_url=url, timeout=600) as c:
        app.state.settings.max_request_flops = 1.0  # every request over: the message names it
        pp = c.post("/v1/path-patch", json={"pairs": [{"clean_tokens": toks, "corrupted_tokens":
                    toks[::-1]}] * 256, "grid": True, "metric": {"kind": "loss", "terms": [
                        {"position": 10}]}}).json()["error"]["message"]
        ll = c.post("/v1/logit-lens", json={"token_lists": [list(range(1, 257))] * 32}
                    ).json()["error"]["message"]
    for name, msg in (("path-patch grid, 256 pairs of 16 tokens", pp),
                      ("logit lens, 32 x 256 tokens", ll)):
        m = re.search(r"estimated (\S+ \S+)", msg)
        print(f"device-work estimate, {name}: {m.group(1) if m else msg[:200]} "
              f"(default limit max_request_flops = 1e13)")
    server.should_exit = True
    th.join(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
