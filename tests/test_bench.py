"""The benchmark (bench/run.py) runs end to end on a tiny model and writes its JSON.

Checks that it runs and reports every section with sane shapes, never its timings (issue 6:
benchmarks are not unit tests)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.e2e
def test_bench_quick_tiny(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--tiny", "--quick", "--runs", "1",
         "--memory-requests", "4", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = list(out.glob("bench-*.json"))
    assert len(files) == 1
    res = json.loads(files[0].read_text())
    lengths = res["meta"]["lengths"]
    assert set(res["floor"]) == {str(T) for T in lengths}
    for T in map(str, lengths):
        enc = res["attention"][T]
        assert set(enc) == {"json", "json_round3", "base64_f32", "base64_f16", "tril_f16",
                            "sparse_top16_f16", "binary_f32", "binary_tril_f16"}
        for e in enc.values():
            assert e["latency_s"] > 0 and e["bytes"] > 0 and e["ratio_to_floor"] > 0
        # float16 halves float32, tril roughly halves again (same tensor, same server)
        assert enc["base64_f16"]["bytes"] < enc["base64_f32"]["bytes"]
        assert res["encoders"][T]["tril_f16"]["bytes"] < res["encoders"][T]["base64_f16"]["bytes"]
    assert res["analyses"]["one_alone_s"] > 0
    # the fresh-server (cache filling) figures, and the fills before the steady-state ones
    cf = res["cache_fill"]
    assert cf["base64_f16"]["ratio_to_floor"] > 0 and cf["analyses"]["one_alone_s"] > 0
    fills = res["steady_state_fills"]
    assert fills and all(f["requests"] >= 1 and f["cache_entries"] > 0 for f in fills)
    assert set(res["throughput"]) >= {"1", "4"}
    assert res["memory"]["run"]["after"]["rss_bytes"] > 0
    assert res["memory"]["final"]["peak_rss_bytes"] >= res["memory"]["run"]["after"]["rss_bytes"]
    assert res["targets"] and all("figure" in t for t in res["targets"])
    assert "Targets (issue 6)" in proc.stdout
