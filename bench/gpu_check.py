"""The service on an accelerator against itself on the CPU, per dtype: endpoint numbers, verify's
drift against its tolerances, verify on planted faults, and a few timings.

    .venv/bin/python bench/gpu_check.py --device cuda [--out DIR]
    .venv/bin/python bench/gpu_check.py --device cpu --small      # the same checks, CPU only

For each model (``bundled``: the bundled GPT-2; ``gpt2-small``: a seeded random ``GPT2Config()``
model, 12 layers x 12 heads, d_model 768, vocab 50257, n_ctx 1024, with the bundled tokenizer)
the real app is built in-process (``create_app(Settings(model, device, dtype), runtime)``,
driven through Starlette's TestClient) once on the CPU in float32 (the reference) and once per
dtype (float32, float16, bfloat16) on ``--device``. The same requests go to both:
/v1/attention, /v1/heads, /v1/verify (from_scratch and recorded_qkv), /v1/run (every
``hook_resid_post`` and the full logits), /v1/patch (the exact head grid), /v1/path-patch (one
path; the bundled model also the full grid), /v1/predictions, /v1/logit-lens. Every numeric
leaf of each response is compared with the reference's (base64 tensors decoded): max absolute
difference per endpoint, and relative to max(1, max |reference|) of that field.

Then, per dtype on ``--device``, /v1/verify (both modes) on honest runs and on the planted
faults of ``bench/precision_faults.py`` and tests/test_verify.py: ``attn_hf`` (the attention
function transformers calls, scores x1.10), ``attn_hooked`` (the hooked forward's per-block
scaling x1.10: the served logits), ``logits`` (the hooked forward's unembedding x1.05); and
/v1/predictions under each fault against the reference (the comparison above can fail).

Timings (median of ``--repeat`` after one warm-up, synchronised): the bare Hugging Face forward
of GPT-2 small at T = 1024 and the recorded forward (``Runtime.forward_many``, cache cleared)
per dtype; /v1/run caching every ``hook_resid_post`` at T = 128 (base64); /v1/patch's full
head x position grid (hook z, by position) at T = 64.

Prints tables; writes ``gpu_check.json`` under ``--out`` (default ``$OUT``, else bench/results)
after every model, so a run stopped early still leaves what it measured. Needs only the
service's own dependencies (no TransformerLens, no pytest); where ``attnscope`` is not
installed it is imported from this checkout through a temporary directory of symlinks.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # seed_sentences only


def _import_attnscope() -> None:
    """``import attnscope`` from this checkout when it is not installed (pyproject's
    package-dir map: attnscope.service = service/, .schemas = schemas/, .client =
    clients/python/attnscope/client/), via symlinks in a temporary directory."""
    try:
        import attnscope.service  # noqa: F401
        if Path(attnscope.service.__file__).resolve().is_relative_to(ROOT):
            return
        for name in [n for n in sys.modules if n == "attnscope" or n.startswith("attnscope.")]:
            del sys.modules[name]
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    except ImportError:
        pass
    d = Path(tempfile.mkdtemp(prefix="attnscope-import-"))
    (d / "attnscope").mkdir()
    for name, target in (("service", ROOT / "service"), ("schemas", ROOT / "schemas"),
                         ("client", ROOT / "clients/python/attnscope/client")):
        (d / "attnscope" / name).symlink_to(target, target_is_directory=True)
    sys.path.insert(0, str(d))
    import attnscope.service  # noqa: F401


_import_attnscope()

import numpy as np  # noqa: E402
import torch  # noqa: E402

DTYPES = ("float32", "float16", "bfloat16")
#: response fields that are not model numbers (settings, echoes, texts)
IGNORED_KEYS = {"model", "message", "dtype", "compute_dtype", "device", "revision", "timing",
                "elapsed_ms", "tolerance", "state_tolerance", "request_id"}
SEG = [211, 1030, 77, 1499, 603, 1877, 342, 958]
CLEAN = [0] + SEG + SEG
CORRUPT = [0] + [1210, 45, 1600, 388, 1777, 90, 1402, 633] + SEG


# ------------------------------------------------------------------ models and apps
def gpt2_small_dir(path: Path) -> str:
    """A seeded random GPT-2-small (``GPT2Config()``: vocab 50257, n_ctx 1024) with the
    bundled tokenizer (its 2048 ids are a subset of the vocabulary)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from attnscope.service.config import BUNDLED_MODEL_DIR

    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(bos_token_id=0, eos_token_id=0, attn_pdrop=0.0,
                                   embd_pdrop=0.0, resid_pdrop=0.0)).eval()
    m.save_pretrained(path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL_DIR / f, path / f)
    del m
    return str(path)


def settings(model: str, device: str, dtype: str):
    from attnscope.service.config import Settings

    # no per-request work, memory or time limits: the timed grids exceed the CPU defaults
    return Settings(model=model, device=device, dtype=dtype, max_request_flops=0,
                    max_request_bytes=0, memory_budget_bytes=-1, request_timeout_s=0,
                    max_body_bytes=1 << 28, log_level="warning", log_format="text")


@contextlib.contextmanager
def served(model: str, device: str, dtype: str):
    """(runtime, TestClient) of the real app on ``model`` in ``dtype`` on ``device``."""
    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app
    from attnscope.service.runtime import Runtime

    s = settings(model, device, dtype)
    rt = Runtime.load(s)
    with TestClient(create_app(s, runtime=rt), raise_server_exceptions=True) as c:
        yield rt, c
    del rt
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------ requests
def make_ids(rt, T: int) -> list[int]:
    """BOS + the seed sentences' ids, cut to ``T`` tokens (repeated when short)."""
    from seed_sentences import ALL_SENTENCES

    ids = rt.tokenizer(" ".join(ALL_SENTENCES), add_special_tokens=False)["input_ids"]
    while len(ids) < T:
        ids = ids + ids
    return [0] + ids[: T - 1]


def requests(ids: list[int], n_layers: int, full_grid: bool) -> dict[str, tuple[str, dict]]:
    """name -> (path, body): the compared requests (token ids, BOS included)."""
    T = len(CLEAN)
    # the induction target (the repeat's last token) against the corrupted segment's last
    ld = {"kind": "logit_diff", "terms": [{"position": T - 2, "target": CLEAN[-1],
                                           "distractor": CORRUPT[len(SEG)]}]}
    loss = {"kind": "loss", "terms": [{"position": p} for p in range(len(SEG) + 1, T - 1)]}
    pair = [{"clean_tokens": CLEAN, "corrupted_tokens": CORRUPT}]
    out = {
        "attention": ("/v1/attention", {"tokens": ids, "encoding": "base64"}),
        "heads": ("/v1/heads", {"tokens": ids}),
        "verify": ("/v1/verify", {"tokens": ids}),
        "verify_recorded_qkv": ("/v1/verify", {"tokens": ids, "mode": "recorded_qkv",
                                               "projections": True}),
        "run": ("/v1/run", {"token_lists": [ids], "cache": ["blocks.*.hook_resid_post"],
                            "logits": {"full": True, "top_k": 5}, "loss": True,
                            "encoding": "base64"}),
        "patch": ("/v1/patch", {"clean_tokens": CLEAN, "corrupted_tokens": CORRUPT,
                                "metric": ld}),
        "path_patch": ("/v1/path-patch", {
            "pairs": pair, "senders": [{"kind": "head", "layer": 0, "head": 1}],
            "receivers": [{"kind": "head", "layer": 1, "input": "k"},
                          {"kind": "mlp", "layer": n_layers - 1}], "metric": loss}),
        "predictions": ("/v1/predictions", {"tokens": ids, "top_k": 5}),
        "logit_lens": ("/v1/logit-lens", {"token_lists": [ids], "top_k": 3}),
        "norms": ("/v1/attention-norms", {"tokens": ids, "encoding": "base64"}),
        "links": ("/v1/links", {"tokens": ids, "layer": 0}),
        "rollout": ("/v1/rollout", {"tokens": ids, "encoding": "base64"}),
        "trajectories": ("/v1/trajectories", {"tokens": ids, "include_final": True}),
        "ablate": ("/v1/ablate", {"tokens": ids, "heads": [[0, 1]]}),
    }
    if full_grid:
        out["path_patch_grid"] = ("/v1/path-patch", {"pairs": pair, "grid": True,
                                                     "metric": loss})
    return out


def post(c, path: str, body: dict) -> dict:
    r = c.post(path, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text[:600]}")
    return r.json()


# ------------------------------------------------------------------ comparing responses
def _decode(t: dict) -> np.ndarray:
    dt = {"float16": np.float16, "float32": np.float32, "bfloat16": None}[t["dtype"]]
    raw = base64.b64decode(t["data"])
    if dt is None:  # bfloat16: the top 16 bits of a float32
        u = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
        return u.view(np.float32).reshape(t["shape"]).astype(np.float64)
    return np.frombuffer(raw, dtype=dt).reshape(t["shape"]).astype(np.float64)


def _is_b64(x) -> bool:
    return isinstance(x, dict) and x.get("encoding") == "base64" and "data" in x


def compare(ref, got, path: str = "", acc: dict | None = None) -> dict:
    """Walk two responses together. ``acc[field]`` (list indices folded to ``[]``) =
    {max_abs, ref_max, n, mismatch}: the largest |got - ref| over the field's numbers, the
    largest |ref|, how many numbers, and how many leaves differ in kind or text (a top-k list
    in another order, a length, a null against a number)."""
    acc = {} if acc is None else acc
    key = path or "."
    e = acc.setdefault(key, {"max_abs": 0.0, "ref_max": 0.0, "n": 0, "mismatch": 0})
    if _is_b64(ref) and _is_b64(got):
        a, b = _decode(ref), _decode(got)
        if a.shape != b.shape:
            e["mismatch"] += 1
            return acc
        fin = np.isfinite(a) & np.isfinite(b)
        e["mismatch"] += int(np.sum(~fin & ~((a == b) | (np.isnan(a) & np.isnan(b)))))
        if fin.any():
            e["max_abs"] = max(e["max_abs"], float(np.max(np.abs(a[fin] - b[fin]))))
            e["ref_max"] = max(e["ref_max"], float(np.max(np.abs(a[fin]))))
        e["n"] += int(a.size)
        return acc
    if isinstance(ref, dict) and isinstance(got, dict):
        for k in ref.keys() | got.keys():
            if k in IGNORED_KEYS:
                continue
            if k not in ref or k not in got:
                acc.setdefault(f"{path}.{k}", {"max_abs": 0.0, "ref_max": 0.0, "n": 0,
                                               "mismatch": 0})["mismatch"] += 1
                continue
            compare(ref[k], got[k], f"{path}.{k}", acc)
        if not e["n"] and not e["mismatch"]:
            acc.pop(key, None)
        return acc
    if isinstance(ref, list) and isinstance(got, list):
        if len(ref) != len(got):
            e["mismatch"] += 1
        for a, b in zip(ref, got):
            compare(a, b, f"{path}[]", acc)
        if not e["n"] and not e["mismatch"]:
            acc.pop(key, None)
        return acc
    if type(ref) is int and type(got) is int:  # ids, positions, ranks, counts: labels
        if ref != got:
            e["mismatch"] += 1
        elif not e["n"] and not e["mismatch"]:
            acc.pop(key, None)
        return acc
    num = (int, float)
    if isinstance(ref, num) and isinstance(got, num) and not isinstance(ref, bool) \
            and not isinstance(got, bool):
        if math.isfinite(ref) and math.isfinite(got):
            e["max_abs"] = max(e["max_abs"], abs(float(got) - float(ref)))
            e["ref_max"] = max(e["ref_max"], abs(float(ref)))
            e["n"] += 1
        elif not (ref == got or (math.isnan(ref) and math.isnan(got))):
            e["mismatch"] += 1
        return acc
    if ref != got:
        e["mismatch"] += 1
    elif not e["n"] and not e["mismatch"]:
        acc.pop(key, None)
    return acc


def summary(acc: dict) -> dict:
    """max_abs and max_rel (|diff| / max(1, max |ref|) of each field) over an endpoint's
    fields, the worst fields by each, numbers compared and leaves mismatched."""
    rows = [(k, v) for k, v in acc.items() if v["n"] or v["mismatch"]]
    rel = lambda v: v["max_abs"] / max(1.0, v["ref_max"])  # noqa: E731
    worst_abs = max(rows, key=lambda kv: kv[1]["max_abs"], default=(None, None))
    worst_rel = max(rows, key=lambda kv: rel(kv[1]), default=(None, None))
    return {
        "max_abs": max((v["max_abs"] for _, v in rows), default=0.0),
        "max_rel": max((rel(v) for _, v in rows), default=0.0),
        "worst_abs_field": worst_abs[0], "worst_rel_field": worst_rel[0],
        "numbers": sum(v["n"] for _, v in rows),
        "mismatched_leaves": sum(v["mismatch"] for _, v in rows),
        "mismatched_fields": sorted(k for k, v in rows if v["mismatch"])[:8],
    }


# ------------------------------------------------------------------ verify and faults
@contextlib.contextmanager
def fault(rt, kind: str | None):
    """Plant ``kind`` (None: honest) as bench/precision_faults.py and tests/test_verify.py do:
    ``attn_hf`` transformers' registered attention function with scores x1.10 (the recorded
    forward); ``attn_hooked`` the hooked forward's per-block scaling x1.10 and ``logits`` its
    unembedding x1.05 (a copy in its parts; the weights verify reads unchanged)."""
    from transformers import AttentionInterface

    from attnscope.service.runtime import interventions as I

    name = rt.model.config._attn_implementation
    orig = AttentionInterface._global_mapping.get(name)
    parts = I.lm_parts(rt)
    try:
        if kind == "attn_hf":
            def faulty(module, q, k, v, mask, scaling=None, **kw):
                return orig(module, q, k, v, mask, scaling=scaling * 1.1, **kw)
            AttentionInterface._global_mapping[name] = faulty
        elif kind == "attn_hooked":
            rt.memo["hooked_parts"] = dataclasses.replace(parts, blocks=tuple(
                dataclasses.replace(b, scaling=b.scaling * 1.1) for b in parts.blocks))
        elif kind == "logits":
            rt.memo["hooked_parts"] = dataclasses.replace(parts, unembed=parts.unembed * 1.05)
        rt.cache.clear()
        yield
    finally:
        if orig is not None:
            AttentionInterface._global_mapping[name] = orig
        rt.memo["hooked_parts"] = parts
        rt.cache.clear()


def verify_row(v: dict) -> dict:
    """The figures of one /v1/verify report."""
    lg = v.get("logits") or None
    out = {"passed": v["passed"], "pattern_abs": v.get("max_abs_diff"),
           "state_rel": v.get("max_rel_diff"), "failing_layer": v.get("failing_layer"),
           "tolerance": v.get("tolerance"), "state_tolerance": v.get("state_tolerance"),
           "message": (v.get("message") or "")[:200]}
    if lg:
        out.update(logits_rel=lg["max_abs_diff"] / max(1.0, lg["scale"]),
                   logits_tolerance=lg["tolerance"], logits_passed=lg["passed"])
    return out


def verify_cases(rt, c, ids: list[int], ref_pred: dict) -> dict:
    """Per case (honest, each fault): /v1/verify from_scratch and recorded_qkv, and how far
    /v1/predictions moved from the CPU float32 reference."""
    out = {}
    for kind in (None, "attn_hf", "attn_hooked", "logits"):
        with fault(rt, kind):
            fs = post(c, "/v1/verify", {"tokens": ids})["verification"]
            rq = post(c, "/v1/verify", {"tokens": ids, "mode": "recorded_qkv"})["verification"]
            pred = post(c, "/v1/predictions", {"tokens": ids, "top_k": 5})
        out[kind or "honest"] = {"from_scratch": verify_row(fs), "recorded_qkv": verify_row(rq),
                                 "predictions_vs_ref": summary(compare(ref_pred, pred))}
    return out


# ------------------------------------------------------------------ timings
def timed(fn, device: str, repeat: int) -> dict:
    fn()
    sync(device)
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t0)
    return {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts), "n": repeat}


def timings(rt, c, device: str, dtype: str, args) -> dict:
    """Forward at T = args.t_forward (bare and recorded), /v1/run every resid_post at
    args.t_run, /v1/patch head x position (z) at args.t_patch."""
    out = {}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 2048, (args.t_forward,), generator=g).tolist()
    ids[0] = 0
    x = torch.tensor([ids], device=rt.device)
    with torch.inference_mode():
        out[f"hf_forward_T{args.t_forward}"] = timed(lambda: rt.model(input_ids=x), device,
                                                     args.repeat)
    tt = rt.tokenized_from_ids(ids)

    def recorded():
        rt.cache.clear()
        rt.forward_many([tt])
    out[f"recorded_forward_T{args.t_forward}"] = timed(recorded, device, args.repeat)
    run_ids = ids[: args.t_run]
    body = {"token_lists": [run_ids], "cache": ["blocks.*.hook_resid_post"],
            "logits": {"positions": [-1], "top_k": 5}, "encoding": "base64"}
    out[f"run_resid_post_T{args.t_run}"] = timed(lambda: post(c, "/v1/run", body), device,
                                                 args.repeat)
    T = args.t_patch
    clean = ids[:T]
    corrupt = [clean[0]] + torch.randint(1, 2048, (T - 1,), generator=g).tolist()
    other = corrupt[-1] if corrupt[-1] != clean[-1] else clean[-1] % 2047 + 1
    pbody = {"clean_tokens": clean, "corrupted_tokens": corrupt, "hook": "z",
             "by_position": True, "metric": {"kind": "logit_diff", "terms": [
                 {"position": T - 2, "target": clean[-1], "distractor": other}]}}
    if args.patch_layers is not None:
        pbody["patch_layers"] = list(range(args.patch_layers))
    n_layers = args.patch_layers or rt.adapter.n_layers
    post(c, "/v1/patch", {**pbody, "patch_layers": [0]})  # warm-up: one layer's cells
    t = timed(lambda: post(c, "/v1/patch", pbody), device, 2)
    t["warmup"] = "one layer's cells, then the full grid once untimed"
    t["cells"] = n_layers * rt.adapter.n_heads * T
    t["cells_per_s"] = t["cells"] / (t["median_ms"] / 1e3)
    out[f"patch_z_by_position_T{T}"] = t
    return out


# ------------------------------------------------------------------ main
def environment(device: str) -> dict:
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "device": device,
           "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
           "float32_matmul_precision": torch.get_float32_matmul_precision()}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def _e(x) -> str:
    return f"{x:9.2e}" if isinstance(x, (int, float)) else f"{x!s:>9}"


def print_tables(res: dict) -> None:
    for mname, m in res["models"].items():
        print(f"\n== {mname}: endpoint numbers vs CPU float32 (max abs / max rel; "
              "mismatched leaves)", flush=True)
        dts = [d for d in DTYPES if d in m.get("endpoints", {})]
        print(f"{'endpoint':<20}" + "".join(f"{d:>28}" for d in dts))
        names = sorted({n for d in dts for n in m["endpoints"][d]})
        for n in names:
            cells = []
            for d in dts:
                s = m["endpoints"][d].get(n)
                cells.append("error" if s is None or "error" in s else
                             f"{s['max_abs']:.2e} / {s['max_rel']:.2e}; {s['mismatched_leaves']}")
            print(f"{n:<20}" + "".join(f"{x:>28}" for x in cells))
        print(f"\n== {mname}: /v1/verify on {res['env']['device']} "
              "(pattern abs | state rel | logits rel ; PASS/FAIL)")
        for d in dts:
            for case, v in m.get("verify", {}).get(d, {}).items():
                fs, rq = v["from_scratch"], v["recorded_qkv"]
                print(f"  {d:<9} {case:<12} from_scratch {_e(fs['pattern_abs'])} | "
                      f"{_e(fs['state_rel'])} | {_e(fs.get('logits_rel'))} "
                      f"{'PASS' if fs['passed'] else 'FAIL'} (layer {fs['failing_layer']}); "
                      f"recorded_qkv {_e(rq['pattern_abs'])} "
                      f"{'PASS' if rq['passed'] else 'FAIL'}; predictions vs ref "
                      f"{_e(v['predictions_vs_ref']['max_abs'])}")
            if m.get("verify", {}).get(d):
                fs = m["verify"][d]["honest"]["from_scratch"]
                print(f"  {d:<9} {'tolerances':<12} from_scratch {_e(fs['tolerance'])} | "
                      f"{_e(fs['state_tolerance'])} | {_e(fs.get('logits_tolerance'))}")
        for d, t in m.get("timings", {}).items():
            print(f"\n== {mname} {d}: timings on {res['env']['device']}")
            for k, v in t.items():
                extra = f"  ({v['cells']} cells, {v['cells_per_s']:.0f}/s)" if "cells" in v else ""
                print(f"  {k:<30} median {v['median_ms']:9.2f} ms  min {v['min_ms']:9.2f} ms"
                      f"{extra}")
    if res["errors"]:
        print("\n== errors")
        for e in res["errors"]:
            print("  " + e.splitlines()[0][:300])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", nargs="+", default=["bundled", "gpt2-small"])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    ap.add_argument("--tokens", type=int, default=64, help="T of the compared requests")
    ap.add_argument("--t-forward", type=int, default=1024)
    ap.add_argument("--t-run", type=int, default=128)
    ap.add_argument("--t-patch", type=int, default=64)
    ap.add_argument("--patch-layers", type=int, default=None,
                    help="timed patch grid: only the first N layers (CPU runs)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--timing-dtypes", nargs="+", default=list(DTYPES))
    ap.add_argument("--deadline-s", type=float, default=1e9,
                    help="skip the timings (then the remaining dtypes) past this many seconds")
    ap.add_argument("--small", action="store_true",
                    help="CPU development: T 24, timings at T 128/32/16 on 1 layer, repeat 2")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench/results"))
    args = ap.parse_args()
    if args.small:
        args.tokens, args.t_forward, args.t_run, args.t_patch = 24, 128, 32, 16
        args.patch_layers, args.repeat = 1, 2
    out_path = Path(args.out) / "gpu_check.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    res = {"env": environment(args.device), "args": vars(args), "models": {}, "errors": []}
    print(json.dumps(res["env"]), flush=True)
    t_start = time.perf_counter()

    def save():
        res["wall_s"] = time.perf_counter() - t_start
        out_path.write_text(json.dumps(res, indent=1, default=str))

    from attnscope.service.config import BUNDLED_MODEL_DIR

    with tempfile.TemporaryDirectory() as tmp:
        for mname in args.models:
            path = str(BUNDLED_MODEL_DIR) if mname == "bundled" else \
                gpt2_small_dir(Path(tmp) / "gpt2-small")
            m = res["models"].setdefault(mname, {"endpoints": {}, "verify": {}, "timings": {}})
            t0 = time.perf_counter()
            with served(path, "cpu", "float32") as (rt, c):
                ids = make_ids(rt, args.tokens)
                reqs = requests(ids, rt.adapter.n_layers, full_grid=rt.adapter.n_layers <= 2)
                ref = {}
                for name, (url, body) in reqs.items():
                    try:
                        ref[name] = post(c, url, body)
                    except Exception:
                        res["errors"].append(f"{mname} cpu float32 {name}: "
                                             + traceback.format_exc(limit=3))
                m["reference_s"] = time.perf_counter() - t0
                m["T"] = len(ids)
            print(f"{mname}: CPU float32 reference in {m['reference_s']:.1f} s", flush=True)
            for dtype in args.dtypes:
                if time.perf_counter() - t_start > args.deadline_s:
                    res["errors"].append(f"{mname} {dtype}: skipped (past --deadline-s)")
                    continue
                t0 = time.perf_counter()
                try:
                    with served(path, args.device, dtype) as (rt, c):
                        eps = m["endpoints"][dtype] = {}
                        for name, (url, body) in reqs.items():
                            if name not in ref:
                                continue
                            try:
                                eps[name] = summary(compare(ref[name], post(c, url, body)))
                            except Exception:
                                eps[name] = {"error": traceback.format_exc(limit=3)}
                                res["errors"].append(f"{mname} {args.device} {dtype} {name}: "
                                                     + eps[name]["error"])
                        if "predictions" in ref:
                            m["verify"][dtype] = verify_cases(rt, c, ids, ref["predictions"])
                        late = time.perf_counter() - t_start > args.deadline_s
                        if late:
                            res["errors"].append(f"{mname} {dtype}: timings skipped (past "
                                                 "--deadline-s)")
                        if mname == "gpt2-small" and dtype in args.timing_dtypes and not late:
                            m["timings"][dtype] = timings(rt, c, args.device, dtype, args)
                except Exception:
                    res["errors"].append(f"{mname} {args.device} {dtype}: "
                                         + traceback.format_exc(limit=4))
                print(f"{mname}: {args.device} {dtype} in {time.perf_counter() - t0:.1f} s",
                      flush=True)
                save()
    if args.device.startswith("cuda"):
        res["env"]["max_memory_allocated_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    save()
    print_tables(res)
    print(f"\nwrote {out_path} ({res['wall_s']:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
