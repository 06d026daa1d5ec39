"""First-request latency of ``POST /v1/circuits`` on a GPT-2-small-shaped random model (issue
26): ``transformers.GPT2Config()`` (12 layers x 12 heads, d_model 768, vocab 50257), random
init (seed 0), saved locally with the bundled tokenizer, served in-process (the real app,
through HTTP). The feature as it is at a git revision (``--old-ref``, default the one before the
speed-up: its ``service/serving/circuits.py`` and ``service/analysis/circuits.py``, served
as the endpoint of a second app on the same runtime) against the working tree's, in one run,
alternating (old, new, old, new, ...): each
run drops the kept circuits first, so every run is a first request; then a second request
(served from what the first kept). Last, the service as started (the lifespan loads the model
and computes the circuits before /readyz says ready): the time to ready and its first request.

    .venv/bin/python bench/circuits_latency.py                   # 3 runs each
    .venv/bin/python bench/circuits_latency.py --runs 5 --old-ref 75c80c3

Prints per variant the first request's wall seconds (median, min) and the process CPU
seconds, the second request's, where the new first request's time goes (weights, QR and
singular values, the copying scores, the composition scores, the response), the largest
difference between the two variants' answers, and the load average before and after; writes
JSON to bench/results/circuits_latency-<time>.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
DEFAULT_OLD = "75c80c3"  # service/analysis/circuits.py before the composition speed-up


def model_dir(path: Path) -> Path:
    """``GPT2Config()`` random init (seed 0) in ``path`` (made once), bundled tokenizer."""
    if (path / "model.safetensors").exists():
        return path
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(bos_token_id=0, eos_token_id=0)).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "service" / "bundled_model" / f, path / f)
    return path


def _module_at(ref: str, rel: str, name: str, package: str):
    """The file ``rel`` as it is at git revision ``ref``, imported as ``name`` in ``package``
    (so its relative imports resolve to the working tree's modules)."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{rel}"],
                         check=True, capture_output=True, text=True).stdout
    path = Path("/tmp") / f"attnscope_{name.rsplit('.', 1)[-1]}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = package
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def old_endpoint(ref: str):
    """The /v1/circuits feature module and its analysis as they are at ``ref``: the serving
    module is imported with the old analysis in place of the working tree's."""
    import attnscope.service.analysis as analysis

    old_c = _module_at(ref, "service/analysis/circuits.py",
                       f"attnscope.service.analysis.circuits_{ref}", "attnscope.service.analysis")
    new_c = analysis.circuits
    analysis.circuits = old_c  # `from ..analysis import circuits as C` picks the old one
    try:
        return _module_at(ref, "service/serving/circuits.py",
                          f"attnscope.service.serving.circuits_{ref}", "attnscope.service.serving")
    finally:
        analysis.circuits = new_c


def drop_kept(rt) -> None:
    for k in [k for k in rt.memo if isinstance(k, tuple) and k[0] == "circuits"]:
        del rt.memo[k]


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def breakdown(S, C, rt) -> dict:
    """Where the new first request's time goes (wall seconds, each part once)."""
    from attnscope.service.serving.run import parts

    out = {}
    with torch.inference_mode():
        w, out["weights"], _ = timed(lambda: S.weights(parts(rt)))
        _, t_all, _ = timed(lambda: C.circuits(w, composition=False))
        _, out["copying"], _ = timed(lambda: C.copying_scores(
            w.W_E, w.W_V.double(), w.W_O.double(), w.W_U))
        out["qr_svd_norms"] = max(0.0, t_all - out["copying"])
        _, t_comp, _ = timed(lambda: C.circuits(w, composition=True))
        out["composition"] = max(0.0, t_comp - t_all)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--old-ref", default=DEFAULT_OLD)
    ap.add_argument("--dir", default="/tmp/attnscope_bench_gpt2_small")
    args = ap.parse_args()

    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app
    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime
    from attnscope.service.serving import circuits as S

    from attnscope.service.serving.core.table import default_table

    path = model_dir(Path(args.dir))
    rt = Runtime.load(Settings(model=str(path)))
    old = old_endpoint(args.old_ref)
    table = default_table()
    tables = {"new": table, "old": [ep for ep in table if ep.path != "/v1/circuits"]
              + list(old.ENDPOINTS)}
    load_before = os.getloadavg()
    res: dict = {"old": {"first": [], "first_cpu": [], "second": []},
                 "new": {"first": [], "first_cpu": [], "second": []}}
    bodies = {}
    with TestClient(create_app(Settings(model=str(path)), runtime=rt,
                               endpoints=tables["old"])) as c_old, \
            TestClient(create_app(Settings(model=str(path)), runtime=rt,
                                  endpoints=tables["new"])) as c_new:
        for _ in range(args.runs):
            for name, client in (("old", c_old), ("new", c_new)):
                def post():
                    r = client.post("/v1/circuits", json={})
                    assert r.status_code == 200, r.text
                    return r

                drop_kept(rt)  # (both keep under the same memo key)
                r, wall, cpu = timed(post)
                res[name]["first"].append(wall)
                res[name]["first_cpu"].append(cpu)
                _, wall2, _ = timed(post)
                res[name]["second"].append(wall2)
                bodies[name] = r.json()
        drop_kept(rt)
        parts_new = breakdown(S, S.C, rt)
        _, t_resp, _ = timed(lambda: (drop_kept(rt), S._kept(rt)))
        drop_kept(rt)
    # the service as started: the lifespan loads the model and precomputes the circuits
    # before /readyz says ready; then the first request
    t0 = time.perf_counter()
    with TestClient(create_app(Settings(model=str(path)))) as c:
        while c.get("/readyz").status_code != 200:
            assert c.app.state.load_error is None, c.app.state.load_error
            time.sleep(0.02)
        t_ready = time.perf_counter() - t0
        _, t_first_started, _ = timed(lambda: c.post("/v1/circuits"))
    load_after = os.getloadavg()
    diff = max(float(np.abs(np.array(bodies["old"]["composition"][m])
                            - np.array(bodies["new"]["composition"][m])).max())
               for m in ("q", "k", "v"))
    print(f"model: GPT2Config() random, {path}; torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs; old = {args.old_ref}")
    for name in ("old", "new"):
        f, c, s2 = res[name]["first"], res[name]["first_cpu"], res[name]["second"]
        print(f"{name}: first request median {statistics.median(f):.2f} s (min {min(f):.2f}, "
              f"CPU {statistics.median(c):.2f} s); second {statistics.median(s2) * 1e3:.0f} ms")
    print("new first request, by part (s): " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                        parts_new.items())
          + f"; computed and kept with the response's numbers {t_resp:.2f}")
    print(f"started service (model load + circuits at start-up): ready after {t_ready:.2f} s; "
          f"first /v1/circuits request then {t_first_started * 1e3:.0f} ms (empty body)")
    print(f"max |old - new| composition score: {diff:.2e}")
    print(f"load average before {load_before}, after {load_after}")
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    f = out / f"circuits_latency-{time.strftime('%Y%m%d-%H%M%S')}.json"
    f.write_text(json.dumps({"runs": res, "parts_new": parts_new, "kept_total": t_resp,
                             "started_ready_s": t_ready, "started_first_request_s": t_first_started,
                             "max_abs_diff": diff, "old_ref": args.old_ref,
                             "loadavg_before": load_before, "loadavg_after": load_after,
                             "cpus": os.cpu_count(), "threads": torch.get_num_threads()},
                            indent=1))
    print(f"written {f}")


if __name__ == "__main__":
    main()
