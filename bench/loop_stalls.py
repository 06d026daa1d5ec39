"""Event-loop stalls of the big legal requests (issue 29 item 8), measured as loop lag.

The real app in-process (``TestClient``) on a random GPT-2-small-shaped model
(``GPT2Config()``: 12 layers, d_model 768, vocabulary 50,257, n_positions 1024), its start-up
objects frozen for the garbage collector as the server's lifespan does
(``freeze_startup_objects``), with the probe of tests/loop_lag.py on its event loop (a 10 ms
sleep again and again; a wake late by ``x`` means the loop was held ``x``). For each request:
an idle baseline, then the worst lag while the request runs. Modes alternate in one run
(``--runs`` rounds):

* ``after``: the service as it is (the scratch PCA cache cleared first: a fresh fit each time);
* ``before``: as before commit 0bd2933: the scratch projection fitted by scikit-learn's
  randomized PCA (``scipy.linalg.lu`` power iterations, holding the GIL), and ``/v1/links``
  making one gc-tracked ``Link`` object per link (a million for links-4096: full garbage
  collections on the device thread). (The response's size walk, on the loop until bf7b6e4,
  stays off it in both modes.)

Requests: links on 2 x 1,000 tokens with ``top_k`` 4,096 (the breaker's), links on 8 x 238
tokens with ``top_k`` 256 (tests/test_abuse.py's), scratch-attention with ``text`` and
``project: 768`` (a fresh PCA fit of the 50,257 x 768 embedding each time).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/loop_stalls.py --runs 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

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
    from attnscope.service.analysis import scratch
    from attnscope.service.runtime import Runtime
    from attnscope.service.serving import links as links_api
    from attnscope.service.serving.core.memory import freeze_startup_objects
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
    modes = _Modes(scratch, links_api)
    rows = []
    print(f"load before {os.getloadavg()}")
    with TestClient(create_app(settings, runtime=rt)) as client, InProcessLag(client) as lag:
        for name in args.cases:  # warm: forwards cached, imports done
            path, body = cases[name]()
            r = client.post(path, json=body)
            assert r.status_code == 200, (name, r.text[:300])
        print(f"{freeze_startup_objects()} start-up objects frozen (as the server's lifespan)")
        for run in range(args.runs):
            for name in args.cases:
                for mode in (("before", "after") if run % 2 == 0 else ("after", "before")):
                    modes.set(mode)
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
    modes.set("after")
    print("\nmedian worst loop lag (ms):")
    for name in args.cases:
        for mode in ("before", "after"):
            xs = sorted(b for n, m, _, b, _, _ in rows if n == name and m == mode)
            print(f"  {name:12s} {mode:6s} {1e3 * xs[len(xs) // 2]:8.1f}  (all: "
                  f"{', '.join(f'{1e3 * x:.0f}' for x in xs)})")


class _Modes:
    """Switches the service between ``after`` (as it is) and ``before`` (the old scratch fit
    and the old links objects, rebuilt here)."""

    def __init__(self, scratch, links_api):
        from dataclasses import dataclass

        from attnscope.service.analysis.links import Link

        self.scratch, self.links_api = scratch, links_api
        self.fit, self.strongest = scratch.embedding_pca, links_api.strongest_links

        @dataclass(frozen=True)
        class OldQueryLinks:  # keys/weights for the new _targets, plus the old Link objects
            query_pos: int
            keys: list
            weights: list
            links: tuple

        def old_strongest(*a, **k):
            return [OldQueryLinks(ql.query_pos, ql.keys, ql.weights,
                                  tuple(Link(kp, w) for kp, w in zip(ql.keys, ql.weights)))
                    for ql in self.strongest(*a, **k)]

        def old_fit(emb, n_components):
            from sklearn.decomposition import PCA

            pca = PCA(n_components=n_components, whiten=True, svd_solver="randomized",
                      random_state=0).fit(emb.detach().to("cpu", torch.float64).numpy())
            return scratch.EmbeddingPCA(torch.from_numpy(pca.mean_),
                                        torch.from_numpy(pca.components_),
                                        torch.from_numpy(pca.explained_variance_))

        self.old_fit, self.old_strongest = old_fit, old_strongest

    def set(self, mode: str) -> None:
        self.scratch.clear_pca_cache()
        self.scratch.embedding_pca = self.old_fit if mode == "before" else self.fit
        self.links_api.strongest_links = (self.old_strongest if mode == "before"
                                          else self.strongest)


if __name__ == "__main__":
    main()
