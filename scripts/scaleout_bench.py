"""Scale-out figures on this machine: `attnscope batch` through haproxy in front of 1, 2, 3
`attnscope serve --model bundled` replicas (deploy/loopback_cluster.py), and the full-size
chaos run (3,000 texts: a replica SIGKILLed and restarted, then a rolling restart).

    .venv/bin/python scripts/scaleout_bench.py throughput --n 1000 --replicas 1,2,3
    .venv/bin/python scripts/scaleout_bench.py chaos --n 3000

`throughput` prints one row per (replicas, torch threads per replica, concurrency): items/s
of the batch run (each item = /v1/attention head_mean layer 1 + /v1/links, the test's mix,
cache off so every item is a forward), the replicas' CPU seconds per item, and the load
average. `chaos` prints what tests/test_scaleout.py checks, at full size, with figures.
Figures go to docs/scaling.md by hand; re-run on the target machine before sizing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("loopback_cluster", ROOT / "deploy" / "loopback_cluster.py")
lc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lc)

PARAMS = ["-a", "attention", "-a", "links",
          "--params", json.dumps({"attention": {"layers": [1], "head_mean": True}})]
SERVE = ["--model", "bundled", "--log-format", "text", "--cache-entries", "0"]


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its threads, seconds (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def _run(url: str, corpus: Path, out: Path, concurrency: int) -> dict:
    for p in (out, Path(str(out) + ".failures.jsonl")):
        p.unlink(missing_ok=True)
    rc, summary = lc.finish_batch(lc.start_batch(url, corpus, out, concurrency, *PARAMS))
    summary["rc"] = rc
    return summary


def throughput(args) -> None:
    d = Path(tempfile.mkdtemp(prefix="scaleout-bench-"))
    texts = lc.corpus_texts(args.n, seed=7)
    lc.write_jsonl(d / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(texts)])
    print(f"# {args.n} texts, {os.cpu_count()} CPUs; items = attention(head_mean, layer 1) + "
          f"links, cache off", flush=True)
    print("| replicas | torch threads each | concurrency | items/s | CPU ms/item: replicas + "
          "batch client + haproxy | 2-core ceiling, items/s | failed | load avg (1 min) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for n in [int(x) for x in args.replicas.split(",")]:
        for threads in args.threads.split(","):
            if threads == "default" and n not in [int(x) for x in args.default_threads_for.split(",")]:
                continue
            env = {} if threads == "default" else {"OMP_NUM_THREADS": threads}
            with lc.LoopbackCluster(n, serve_args=SERVE, replica_env=env) as c:
                for conc in [n * int(f) for f in args.concurrency_per_replica.split(",")]:
                    load0 = os.getloadavg()[0]
                    cpu0 = sum(_cpu_seconds(r.proc.pid) for r in c.replicas)
                    lb0 = _cpu_seconds(c.haproxy.pid)
                    ch0 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the batch client, once waited
                    s = _run(c.url, d / "in.jsonl", d / "out.jsonl", conc)
                    ch1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                    k = 1000 / max(s["done"], 1)
                    rep = (sum(_cpu_seconds(r.proc.pid) for r in c.replicas) - cpu0) * k
                    cli = (ch1.ru_utime + ch1.ru_stime - ch0.ru_utime - ch0.ru_stime) * k
                    lb = (_cpu_seconds(c.haproxy.pid) - lb0) * k
                    ceiling = (os.cpu_count() or 1) * 1000 / (rep + cli + lb)
                    print(f"| {n} | {threads} | {conc} | {s['items_per_second']:.1f} | "
                          f"{rep:.1f} + {cli:.1f} + {lb:.2f} | {ceiling:.0f} | {s['failed']} | "
                          f"{load0:.1f} -> {os.getloadavg()[0]:.1f} |", flush=True)


def chaos(args) -> None:
    d = Path(tempfile.mkdtemp(prefix="scaleout-chaos-"))
    texts = lc.corpus_texts(args.n, seed=3000)
    with lc.LoopbackCluster(3, serve_args=SERVE, replica_env={"OMP_NUM_THREADS": "1"}) as c:
        # single-server answers: straight to replica 1, one at a time
        lc.write_jsonl(d / "ref.jsonl", [{"id": i, "text": t} for i, t in enumerate(texts)])
        t0 = time.monotonic()
        s = _run(c.replicas[0].url, d / "ref.jsonl", d / "ref.out.jsonl", 1)
        ref = {texts[o["id"]]: o["results"] for o in lc.read_jsonl(d / "ref.out.jsonl")}
        print(f"reference (one server, concurrency 1): {s['done']} in "
              f"{time.monotonic() - t0:.1f} s ({s['items_per_second']:.1f} items/s)", flush=True)

        def verify(items, out) -> str:
            done = [o["id"] for o in lc.read_jsonl(out)]
            failed = [f["id"] for f in lc.read_jsonl(str(out) + ".failures.jsonl")]
            ids = {it["id"] for it in items}
            text = {it["id"]: it["text"] for it in items}
            wrong = sum(o["results"] != ref[text[o["id"]]] for o in lc.read_jsonl(out))
            return (f"output {len(done)} ({len(done) - len(set(done))} duplicated), failures "
                    f"{len(failed)}, lost {len(ids - set(done) - set(failed))}, results "
                    f"differing from the single server {wrong}")

        # 1. SIGKILL a replica at 25 %, start it again at once
        items = [{"id": f"a-{i}", "text": t} for i, t in enumerate(texts)]
        lc.write_jsonl(d / "a.jsonl", items)
        out = d / "a.out.jsonl"
        five0 = int(c.stats()["FRONTEND"]["hrsp_5xx"])
        proc = lc.start_batch(c.url, d / "a.jsonl", out, 3, *PARAMS)
        while lc.count_lines(out) < len(items) // 4 and proc.poll() is None:
            time.sleep(0.05)
        c.kill(1)
        t_kill = time.monotonic()
        restarted = {}
        th = threading.Thread(target=lambda: (c.restart(1),
                                              restarted.update(s=time.monotonic() - t_kill)))
        th.start()
        rc, s = lc.finish_batch(proc)
        th.join()
        st = c.stats()
        print(f"kill run: exit {rc}, {s['done']} done, {s['failed']} failed, "
              f"{s['items_per_second']:.1f} items/s; killed at {len(items) // 4}, replica back UP "
              f"{restarted.get('s', float('nan')):.1f} s after the kill; haproxy 5xx "
              f"{int(st['FRONTEND']['hrsp_5xx']) - five0}, redispatches "
              f"{st['BACKEND']['wredis']}; {verify(items, out)}", flush=True)

        # 2. rolling restart during a run of the same size
        items = [{"id": f"b-{i}", "text": t} for i, t in enumerate(texts)]
        lc.write_jsonl(d / "b.jsonl", items)
        out = d / "b.out.jsonl"
        five0 = int(c.stats()["FRONTEND"]["hrsp_5xx"])
        proc = lc.start_batch(c.url, d / "b.jsonl", out, 3, *PARAMS)
        while lc.count_lines(out) < 20 and proc.poll() is None:
            time.sleep(0.05)
        t0 = time.monotonic()
        steps = []
        for i in range(3):
            if proc.poll() is not None:
                break
            c.replace(i)
            steps.append(time.monotonic() - t0)
        spanned = proc.poll() is None and len(steps) == 3
        rc, s = lc.finish_batch(proc)
        st = c.stats()
        print(f"rolling run: exit {rc}, {s['done']} done, {s['failed']} failed, "
              f"{s['items_per_second']:.1f} items/s; replacements done at "
              f"{', '.join(f'{x:.1f}' for x in steps)} s, run still going after the last: "
              f"{spanned}; haproxy 5xx {int(st['FRONTEND']['hrsp_5xx']) - five0}; "
              f"{verify(items, out)}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--n", type=int, default=1000)
    t.add_argument("--replicas", default="1,2,3")
    t.add_argument("--threads", default="1,default",
                   help="OMP_NUM_THREADS per replica, comma-separated ('default': unset)")
    t.add_argument("--default-threads-for", default="3",
                   help="replica counts that also run with torch's default threads")
    t.add_argument("--concurrency-per-replica", default="1,2")
    c = sub.add_parser("chaos")
    c.add_argument("--n", type=int, default=3000)
    args = ap.parse_args()
    {"throughput": throughput, "chaos": chaos}[args.cmd](args)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))  # run the clusters' cleanup
    sys.exit(main())
