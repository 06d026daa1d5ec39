"""Event-loop stalls of the big legal requests (issue 29 item 8), measured as loop lag.

The real app in-process (``TestClient``) on a random GPT-2-small-shaped model
(``GPT2Config()``: 12 layers, d_model 768, vocabulary 50,257, n_positions 1024), with the
probe of tests/loop_lag.py on its event loop (a 10 ms sleep again and again; a wake late by
``x`` means the loop was held ``x``). For each request: an idle baseline, then the worst lag
while the request runs. Modes alternate in one run (``--runs`` rounds):

* ``after``: the service as it is;
* ``before``: ``encoding.responses.SIZE_ON_LOOP = True``, the response's size walk
  (``_array_bytes`` over every object of the body) back on the event loop, as it was.

Requests: links on 2 x 1,000 tokens with ``top_k`` 4,096 (the breaker's), links on 8 x 238
tokens with ``top_k`` 256 (tests/test_abuse.py's), scratch-attention with ``text`` and
``project: 768`` (a fresh PCA fit of the 50,257 x 768 embedding each time: a new ``seed``).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/loop_stalls.py --runs 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(ROOT / "tests"))

LONG = " ".join(f"w{i % 97} and" for i in range(62))  # 238 tokens of the bundled tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--cases", nargs="+", default=["links-4096", "links-256", "scratch-pca"])
    args = ap.parse_args()
    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app
    from attnscope.service.config import Settings
    from attnscope.service.encoding import responses
    from attnscope.service.runtime import Runtime
    from interventions_reference import gpt2_small_dir
    from loop_lag import InProcessLag

    d = gpt2_small_dir(Path(tempfile.mkdtemp()) / "gpt2small", n_positions=1024)
    settings = Settings(model=str(d), max_request_bytes=16 << 30, request_timeout_s=3600,
                        memory_budget_bytes=-1, max_request_flops=0)
    rt = Runtime.load(settings)
    long_text = " ".join(f"w{i % 89} x" for i in range(205))  # ~1,000 tokens
    seeds = iter(range(1, 1000))
    cases = {
        "links-4096": lambda: ("/v1/links", {"texts": [long_text, long_text + " y"],
                                             "layer": 0, "top_k": 4096}),
        "links-256": lambda: ("/v1/links", {"texts": [f"links {i} " + LONG for i in range(8)],
                                            "layer": 1, "top_k": 256}),
        "scratch-pca": lambda: ("/v1/scratch-attention", {"text": LONG, "project": 768,
                                                          "seed": next(seeds)}),
    }
    rows = []
    print(f"load before {os.getloadavg()}")
    with TestClient(create_app(settings, runtime=rt)) as client, InProcessLag(client) as lag:
        for name in args.cases:  # warm: forwards cached, imports done
            path, body = cases[name]()
            r = client.post(path, json=body)
            assert r.status_code == 200, (name, r.text[:300])
        for run in range(args.runs):
            for name in args.cases:
                for mode in (("before", "after") if run % 2 == 0 else ("after", "before")):
                    responses.SIZE_ON_LOOP = mode == "before"
                    path, body = cases[name]()
                    idle = lag.idle(50)
                    t0 = time.perf_counter()
                    with lag.window() as busy:
                        r = client.post(path, json=body)
                    wall = time.perf_counter() - t0
                    assert r.status_code == 200, r.text[:300]
                    rows.append((name, mode, max(idle), max(busy), wall, len(r.content)))
                    print(f"{name:12s} {mode:6s} idle worst {max(idle) * 1e3:7.1f} ms  busy "
                          f"worst {max(busy) * 1e3:7.1f} ms  wall {wall:6.2f} s  "
                          f"{len(r.content) >> 20} MiB  load {os.getloadavg()[0]:.1f}",
                          flush=True)
    responses.SIZE_ON_LOOP = False
    print("\nmedian worst loop lag (ms):")
    for name in args.cases:
        for mode in ("before", "after"):
            xs = sorted(b for n, m, _, b, _, _ in rows if n == name and m == mode)
            print(f"  {name:12s} {mode:6s} {1e3 * xs[len(xs) // 2]:8.1f}  (all: "
                  f"{', '.join(f'{1e3 * x:.0f}' for x in xs)})")


if __name__ == "__main__":
    main()
