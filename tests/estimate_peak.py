"""Each endpoint's memory estimate against what its request really allocates (issue 29 item 8,
"estimates that cover what the job allocates, checked by a test per endpoint").

Run as a script in a FRESH process (tests/test_estimates_peak.py and bench/estimates.py do):

    python tests/estimate_peak.py MODEL CASE [CASE ...]      # one JSON line per case

``MODEL``: ``bundled`` or a checkpoint directory. For each case it posts one warm-up request
of the same endpoint (imports, lazy state), then, once the heap is trimmed (glibc
``malloc_trim``) and the peak-RSS mark reset (``/proc/self/clear_refs`` = 5, Linux >= 4.0),
the case's request through the real app (raw ASGI: the response body is counted as it is
sent and dropped, as a socket would, so no client copy is measured), and reads the kernel's
high-water mark ``VmHWM``. ``peak`` = VmHWM - RSS before: everything the request made resident
at its worst moment (forwards, the job, the encoded body, Python objects, allocator
fragmentation, worker-thread arenas). ``estimate``: the bytes the engine asked the global
memory budget for (:class:`RecordingBudget`), i.e. exactly what admission counts. The forward
cache is off (``cache_bytes`` 0), so no eviction during a request frees memory and hides
its cost.

:data:`CASES` has one entry per POST endpoint (tests/test_estimates_peak.py fails when the
endpoint table has one without an entry): heavy but legal requests on the bundled model,
and ``small:`` cases on a random GPT-2-small-shaped model (slow tier).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

LONG = " ".join(f"w{i % 97} and" for i in range(62))  # 238 tokens of the bundled tokenizer
MID = " ".join(f"w{i % 89} x" for i in range(30))  # ~ 120 tokens
A = "The cat sat on the mat and the cat slept."
B = "The dog sat on the rug and the dog slept."
WARM = " ".join(f"v{i % 13} y" for i in range(40))  # a warm-up text of ~ 80 tokens
#: 8 texts of 16 tokens (flow_max_tokens), bundled tokenizer
FLOW_TEXTS = [f"the cat {i} sat on a mat and it slept" for i in range(8)]
SMALL_LONG = " ".join(f"w{i % 89} x" for i in range(205))  # ~1,000 tokens (GPT-2 small)


def _mat(n: int, d: int, seed: int) -> list:
    import numpy as np

    return np.random.default_rng(seed).standard_normal((n, d)).round(6).tolist()


def cases() -> dict[str, list[tuple[str, str, dict]]]:
    """path -> [(case name, model: 'bundled' | 'small', body)]: at least one bundled case per
    POST endpoint of the endpoint table."""
    return {
        "/v1/tokenize": [("tokenize", "bundled", {"texts": [LONG] * 32})],
        "/v1/attention": [
            ("attention-json", "bundled", {"texts": [LONG] * 4, "include_scores": True}),
            ("attention-round", "bundled", {"texts": [LONG] * 4, "round": 4}),
            ("attention-b64", "bundled", {"texts": [LONG] * 8, "encoding": "base64"}),
            ("small:attention", "small", {"text": SMALL_LONG, "encoding": "base64"}),
        ],
        "/v1/heads": [("heads", "bundled", {"texts": [LONG] * 8})],
        "/v1/links": [
            ("links-256", "bundled", {"texts": [f"links {i} " + LONG for i in range(8)],
                                      "layer": 1, "top_k": 256}),
            ("links-norm", "bundled", {"texts": [LONG] * 4, "layer": 1, "top_k": 256,
                                       "by": "norm"}),
            ("small:links-4096", "small", {"texts": [SMALL_LONG, SMALL_LONG + " y"],
                                           "layer": 0, "top_k": 4096}),
        ],
        "/v1/trajectories": [("trajectories", "bundled", {"texts": [LONG] * 4,
                                                          "n_components": 128})],
        "/v1/verify": [("verify", "bundled", {"texts": [LONG] * 4, "mode": "recorded_qkv",
                                              "projections": True})],
        "/v1/scratch-attention": [
            ("scratch-matrices", "bundled", {"q": _mat(512, 64, 1), "k": _mat(512, 64, 2),
                                             "v": _mat(512, 64, 3), "n_heads": 16}),
            ("scratch-text", "bundled", {"text": LONG, "n_heads": 4}),
            ("scratch-project", "bundled", {"text": LONG, "project": 128, "seed": 3}),
            ("small:scratch-project", "small", {"text": LONG, "project": 768, "seed": 3}),
        ],
        "/v1/predictions": [
            ("predictions", "bundled", {"texts": [LONG] * 8, "top_k": 100}),
            ("small:predictions", "small", {"texts": [SMALL_LONG] * 2, "top_k": 100}),
        ],
        "/v1/ablate": [
            ("ablate-scan", "bundled", {"text": LONG, "scan": True}),
            ("ablate-mean", "bundled", {"texts": [LONG] * 4, "heads": [[1, 1], [0, 2]],
                                        "method": "mean"}),
        ],
        "/v1/patch": [
            ("patch-exact", "bundled", {"clean_text": LONG, "corrupted_text": LONG.replace(
                "w3 ", "w4 "), "metric": "loss"}),
            ("patch-per-position-residual", "bundled", {
                "clean_text": MID, "corrupted_text": MID.replace("w3 ", "w4 "),
                "metric": "loss", "per_position": True, "residual": True}),
            ("small:patch-per-position-residual", "small", {
                "clean_text": A, "corrupted_text": B, "metric": "loss", "per_position": True,
                "residual": True}),
            ("patch-attribution", "bundled", {"clean_text": LONG, "corrupted_text": LONG.replace(
                "w3 ", "w4 "), "metric": "loss", "method": "attribution"}),
        ],
        "/v1/attention-norms": [("norms", "bundled", {"texts": [LONG] * 4, "value_norms": True})],
        "/v1/rollout": [
            ("rollout", "bundled", {"texts": [LONG] * 4}),
            ("rollout-flow", "bundled", {"texts": FLOW_TEXTS * 2, "flow": True}),
            ("small:rollout-flow", "small", {"texts": FLOW_TEXTS, "flow": True}),
        ],
        "/v1/run": [
            ("run-cache", "bundled", {"texts": [LONG] * 4, "cache": [
                "blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern",
                "blocks.0.hook_resid_post", "blocks.1.mlp.hook_post"]}),
            ("run-logits", "bundled", {"texts": [LONG] * 4, "logits": {"top_k": 50}}),
        ],
        "/v1/path-patch": [("path-patch", "bundled", {
            "pairs": [{"clean_text": MID, "corrupted_text": MID.replace("w3 ", "w4 ")}] * 4,
            "senders": [{"kind": "head", "layer": 0, "head": h} for h in range(4)],
            "receivers": [{"kind": "head", "layer": 1, "input": "k"}],
            "metric": {"kind": "loss", "terms": [{"position": 3}]}})],
        "/v1/circuits": [("circuits", "bundled", {})],
        "/v1/logit-lens": [
            ("logit-lens", "bundled", {"texts": [LONG] * 4, "top_k": 20, "incl_mid": True}),
            ("small:logit-lens", "small", {"text": SMALL_LONG, "top_k": 5}),
        ],
        "/v1/logit-attribution": [
            ("logit-attribution", "bundled", {"texts": [LONG] * 4, "target": " the"}),
            ("small:logit-attribution", "small", {"text": SMALL_LONG, "target": " the",
                                                  "positions": list(range(0, 1000, 10))}),
        ],
    }


def case_table() -> dict[str, tuple[str, str, dict]]:
    """case name -> (path, model, body)."""
    return {name: (path, model, body) for path, cs in cases().items()
            for name, model, body in cs}


# ---------------------------------------------------------------------------- measuring
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class DrainClient:
    """One POST through ``app(scope, receive, send)``; the body is counted and dropped."""

    def __init__(self, path: str, body: bytes):
        self.path, self.body = path, body
        self.status, self.nbytes, self.head = None, 0, b""
        self._first = True
        self._never = asyncio.Event()

    async def receive(self) -> dict:
        if self._first:
            self._first = False
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self._never.wait()
        return {"type": "http.disconnect"}

    async def send(self, msg: dict) -> None:
        if msg["type"] == "http.response.start":
            self.status = msg["status"]
        elif msg["type"] == "http.response.body":
            chunk = msg.get("body", b"")
            if len(self.head) < 400:
                self.head += bytes(chunk[:400])
            self.nbytes += len(chunk)

    async def run(self, app) -> None:
        hdrs = [(b"content-type", b"application/json"),
                (b"content-length", str(len(self.body)).encode())]
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": self.path,
                 "raw_path": self.path.encode(), "query_string": b"", "root_path": "",
                 "headers": hdrs, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        await app(scope, self.receive, self.send)


def halve(target: str) -> None:
    """The planted fault: ``module:function`` (an estimator of service/serving/...) made to
    return half its estimate, for tests/test_estimates_peak.py's check to catch."""
    import importlib

    mod, fn = target.split(":")
    m = importlib.import_module(mod)
    real = getattr(m, fn)
    setattr(m, fn, lambda *a, **k: real(*a, **k) // 2)


def measure(model: str, names: list[str], out=sys.stdout) -> list[dict]:
    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app
    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime
    from attnscope.service.serving.core.budget import MemoryBudget
    from attnscope.service.serving.core.memory import release_memory

    class RecordingBudget(MemoryBudget):
        """The real budget (unlimited in practice), remembering each request's bytes."""
        asked: list[int] = []

        async def acquire(self, nbytes: int):
            self.asked.append(int(nbytes))
            return await super().acquire(nbytes)

    table = case_table()
    if model == "small":
        model = str(small_model_dir())
    settings = Settings(model=model, cache_bytes=0, cache_entries=0, max_request_bytes=0,
                        memory_budget_bytes=-1, max_request_flops=0, request_timeout_s=3600)
    rt = Runtime.load(settings)
    app = create_app(settings, runtime=rt)
    rows = []
    with TestClient(app) as client:
        budget = RecordingBudget(1 << 50, 3600)
        app.state.budget = budget
        for name in names:
            path, _, body = table[name]
            raw = json.dumps(body).encode()
            warm = client.post(path, json=_warm_body(path, body))
            if warm.status_code != 200:
                raise RuntimeError(f"{name}: warm-up {warm.status_code} {warm.text[:300]}")
            del warm
            c = DrainClient(path, raw)
            budget.asked.clear()
            for _ in range(2):
                gc.collect()
            release_memory(0)
            before = _status_kb("VmRSS")
            reset_peak()
            client.portal.call(c.run, app)
            peak = _status_kb("VmHWM") - before
            row = {"case": name, "path": path, "status": c.status, "estimate": sum(budget.asked),
                   "peak": peak, "body_bytes": c.nbytes, "rss_before": before}
            if c.status != 200:
                row["error"] = c.head.decode("utf-8", "replace")
            rows.append(row)
            print(json.dumps(row), file=out, flush=True)
            del c
    return rows


def small_model_dir() -> Path:
    """The random GPT-2-small-shaped checkpoint (vocabulary 50,257, n_positions 1,024) of
    tests/interventions_reference.py, saved once under the temp dir."""
    import tempfile

    from interventions_reference import gpt2_small_dir

    d = Path(tempfile.gettempdir()) / f"attnscope-estimate-peak-gpt2small-{os.getuid()}"
    if not (d / "model.safetensors").exists():
        gpt2_small_dir(d, n_positions=1024)
    return d


def _warm_body(path: str, body: dict) -> dict:
    """A small request of the same endpoint and options (first-call imports and caches)."""
    small = dict(body)
    for k in ("text", "clean_text", "corrupted_text"):
        if k in small:
            small[k] = WARM if k != "corrupted_text" else WARM.replace("v3 ", "v4 ")
    if "texts" in small:
        small["texts"] = [WARM]
    if "pairs" in small:
        small["pairs"] = [{"clean_text": WARM, "corrupted_text": WARM.replace("v3 ", "v4 ")}]
    small.pop("positions", None)
    if small.get("per_position"):
        small.update(clean_text=A, corrupted_text=B)
    if "q" in small:
        small.update(q=[[1.0, 0.0]] * 2, k=[[1.0, 0.0]] * 2, v=[[1.0, 2.0]] * 2, n_heads=2)
    if path == "/v1/scratch-attention" and "seed" in small:
        small["seed"] = small["seed"] + 1000  # its own PCA fit: the measured one is not cached
    if path == "/v1/rollout" and small.get("flow"):
        small["texts"] = ["a b c"]
    return small


#: the check: peak <= RATIO x estimate + SLACK (SLACK: page granularity and the interpreter's
#: own heap noise, which a request of a few kB cannot be asked to estimate)
RATIO = 1.1
SLACK = 2 << 20


def within(row: dict) -> bool:
    return row["status"] == 200 and row["peak"] <= RATIO * row["estimate"] + SLACK


def run_fresh(model: str, names: list[str], halve_fn: str | None = None,
              timeout: float | None = None, env: dict | None = None) -> list[dict]:
    """:func:`measure` in a fresh interpreter (nothing left from other tests in its heap:
    memory freed by earlier requests but still resident, e.g. pymalloc pools, would be
    reused without a page fault and hide part of a request's cost). ``halve_fn``: plant
    :func:`halve`'s fault first; ``env``: extra environment variables."""
    import subprocess

    here = Path(__file__).resolve()
    env = {**os.environ, **(env or {}), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(here.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    extra = ["--halve", halve_fn] if halve_fn else []
    p = subprocess.run([sys.executable, str(here), *extra, model, *names], capture_output=True,
                       text=True, env=env, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"estimate_peak failed ({p.returncode}): {p.stderr[-3000:]}")
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    args = sys.argv[1:]
    if args[:1] == ["--halve"]:
        halve(args[1])
        args = args[2:]
    measure(args[0], args[1:])
