"""Activation patching benchmark (issue 13): the full [12, 12] head-patching grid through HTTP
vs TransformerLens 4.x ``get_act_patch_attn_head_out_all_pos`` in-process, same weights.

    .venv/bin/python bench/patching.py                  # GPT-2 small shapes, T = 16 and 64
    .venv/bin/python bench/patching.py --lengths 16 --runs 1 --no-tl   # ours only, quick

The model is a randomly initialised ``GPT2Config()`` (GPT-2 small: 12 layers, 12 heads,
d_model 768, vocab 50257) with the bundled tokenizer, served by a real uvicorn (``attnscope
serve``) on 127.0.0.1, as in bench/run.py. For each T a clean text of T random word tokens and a
corrupted one (the first half replaced by other words, same token count), metric the logit
difference at the last position between the clean text's last token and another word,
normalised ``(patched - corrupted) / (clean - corrupted)``.

Measured (median of ``--runs``; every HTTP request uses fresh texts, so it includes the two
recorded forwards):

* ``exact_http_s``: ``POST /v1/patch`` end to end (one batch of 12 variants per layer, each
  started from the corrupted run's cached residual stream entering its layer);
* ``tl_s``: TransformerLens' ``get_act_patch_attn_head_out_all_pos`` on a TransformerBridge of
  the same directory (144 full forwards; its clean ``run_with_cache`` not counted), and the
  max abs difference of the two grids;
* ``attribution_http_s``: ``method: "attribution"``, and its ratio to ``forward_s``, one
  in-process Hugging Face ``GPT2LMHeadModel`` forward at T (the target: <= 5 forwards);
  ``attribution_pearson``: its correlation with the exact grid.

Prints a table and writes JSON to bench/results/patching-<time>.json (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import Server, Texts, build_model  # noqa: E402  (bench/run.py: model, texts, server)

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def median(xs):
    return float(statistics.median(xs))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc/<pid>/stat): the server's
    own work, less disturbed than wall time on a shared machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pair(texts: Texts, T: int):
    """(clean, corrupted, target, distractor): equal token counts, the target the clean
    text's last word token, the distractor another word."""
    tok = texts.tok
    for _ in range(100):
        clean = texts.make(T)
        ids = tok(clean, add_special_tokens=False)["input_ids"]
        half = T // 2
        repl = texts.rng.choice(texts.words, size=half).tolist()
        corrupted = tok.decode(repl + ids[half:])
        if texts.n_tokens(corrupted) != T:
            continue
        tgt = tok.decode([ids[-1]])
        dis = tok.decode([int(texts.rng.choice(texts.words))])
        if tgt != dis and texts.n_tokens(tgt) == 1 and texts.n_tokens(dis) == 1:
            return clean, corrupted, tgt, dis
    raise RuntimeError("no pair")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-tl", action="store_true", help="skip TransformerLens")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (seconds; for tests)")
    args = ap.parse_args()

    import torch
    from transformers import GPT2LMHeadModel

    tmp = Path(tempfile.mkdtemp(prefix="attnscope-bench-patch-"))
    model_dir = build_model(args.tiny, tmp / "model")
    texts = Texts(model_dir, seed=1)
    server = Server(model_dir, tmp / "server.log", [])
    hf = GPT2LMHeadModel.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    bridge = None
    if not args.no_tl:
        from transformer_lens import patching
        from transformer_lens.model_bridge import TransformerBridge

        bridge = TransformerBridge.boot_transformers(str(model_dir), device="cpu")
    results = {"model": "random GPT2Config() (GPT-2 small shapes)" if not args.tiny else "tiny",
               "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
               "lengths": {}}
    try:
        with httpx.Client(base_url=server.url, timeout=1800) as http:
            for T in args.lengths:
                row: dict = {"T": T}
                ex, at, fw, tl, diffs, corrs = [], [], [], [], [], []
                cex, cat, cfw, ctl, raw_diffs = [], [], [], [], []
                for run in range(args.runs + 1):  # run 0: warm-up, not counted
                    def request(method):
                        clean, corrupted, tgt, dis = pair(texts, T)  # fresh: cold forwards
                        return {"clean_text": clean, "corrupted_text": corrupted, "method": method,
                                "logit_diff": {"target": tgt, "distractor": dis}}
                    body = request("exact")
                    t0, c0 = time.perf_counter(), cpu_seconds(server.proc.pid)
                    r = http.post("/v1/patch", json=body)
                    t_ex = time.perf_counter() - t0
                    cpu_ex = cpu_seconds(server.proc.pid) - c0
                    r.raise_for_status()
                    exact = r.json()
                    body_a = request("attribution")
                    t0, c0 = time.perf_counter(), cpu_seconds(server.proc.pid)
                    http.post("/v1/patch", json=body_a).raise_for_status()
                    t_at = time.perf_counter() - t0
                    cpu_at = cpu_seconds(server.proc.pid) - c0
                    # attribution on the same inputs as exact, for the correlation
                    ra = http.post("/v1/patch", json={**body, "method": "attribution"})
                    ra.raise_for_status()
                    ids = torch.tensor([[t["id"] for t in exact["clean_tokens"]]])
                    with torch.inference_mode():
                        ts, cs = [], []
                        for _ in range(3):
                            t0, c0 = time.perf_counter(), time.process_time()
                            hf(input_ids=ids)
                            ts.append(time.perf_counter() - t0)
                            cs.append(time.process_time() - c0)
                    a_grid = np.array(ra.json()["heads"], dtype=float)
                    e_grid = np.array(exact["heads"], dtype=float)
                    if run == 0:
                        continue
                    ex.append(t_ex)
                    at.append(t_at)
                    fw.append(min(ts))
                    cex.append(cpu_ex)
                    cat.append(cpu_at)
                    cfw.append(min(cs))
                    corrs.append(float(np.corrcoef(a_grid.ravel(), e_grid.ravel())[0, 1]))
                    if bridge is not None and run == 1:  # TransformerLens once per length (slow)
                        c_ids = torch.tensor([[t["id"] for t in exact["clean_tokens"]]])
                        k_ids = torch.tensor([[t["id"] for t in exact["corrupted_tokens"]]])
                        t_id = exact["logit_diff"]["target"]["id"]
                        d_id = exact["logit_diff"]["distractor"]["id"]
                        _, cache = bridge.run_with_cache(c_ids)
                        c, k = exact["clean_value"], exact["corrupted_value"]

                        def metric(lg):
                            return (lg[0, -1, t_id] - lg[0, -1, d_id] - k) / (c - k)
                        t0, c0 = time.perf_counter(), time.process_time()
                        ref = patching.get_act_patch_attn_head_out_all_pos(bridge, k_ids, cache, metric)
                        tl.append(time.perf_counter() - t0)
                        ctl.append(time.process_time() - c0)
                        diffs.append(float(np.abs(ref.numpy() - e_grid).max()))
                        raw_diffs.append(float(np.abs(ref.numpy() - e_grid).max() * abs(c - k)))
                row.update(exact_http_s=median(ex), attribution_http_s=median(at),
                           forward_s=median(fw),
                           attribution_forwards=median(at) / median(fw),
                           attribution_pearson=median(corrs),
                           exact_cpu_s=median(cex), attribution_cpu_s=median(cat),
                           forward_cpu_s=median(cfw),
                           attribution_forwards_cpu=median(cat) / median(cfw))
                if tl:
                    row.update(tl_s=tl[0], exact_vs_tl=median(ex) / tl[0], tl_cpu_s=ctl[0],
                               exact_vs_tl_cpu=median(cex) / ctl[0],
                               max_abs_diff_vs_tl=max(diffs),
                               max_abs_diff_vs_tl_raw_logit_diff=max(raw_diffs),
                               clean_minus_corrupted=exact["clean_value"] - exact["corrupted_value"])
                results["lengths"][str(T)] = row
                print(json.dumps(row), flush=True)
    finally:
        server.stop()
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"patching-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"\n{'T':>4} {'exact HTTP s':>12} {'TL s':>8} {'ratio':>6} {'max|diff|':>10} "
          f"{'attr s':>8} {'fwd s':>7} {'attr/fwd':>8} {'pearson':>8}")
    for T, r in results["lengths"].items():
        print(f"{T:>4} {r['exact_http_s']:12.3f} {r.get('tl_s', float('nan')):8.2f} "
              f"{r.get('exact_vs_tl', float('nan')):6.3f} {r.get('max_abs_diff_vs_tl', float('nan')):10.2e} "
              f"{r['attribution_http_s']:8.3f} {r['forward_s']:7.3f} {r['attribution_forwards']:8.2f} "
              f"{r['attribution_pearson']:8.3f}")
    print("CPU seconds (server process / this process), less disturbed by a shared machine:")
    for T, r in results["lengths"].items():
        print(f"{T:>4} exact {r['exact_cpu_s']:.3f}  TL {r.get('tl_cpu_s', float('nan')):.2f}  "
              f"ratio {r.get('exact_vs_tl_cpu', float('nan')):.3f}  attribution "
              f"{r['attribution_cpu_s']:.3f} = {r['attribution_forwards_cpu']:.2f} forwards")
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
