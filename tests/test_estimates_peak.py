"""Every endpoint's memory estimate covers what its request really allocates (issue 29 item 8:
"estimates that cover what the job allocates, checked by a test per endpoint").

For each POST endpoint of the endpoint table, heavy but legal requests
(tests/estimate_peak.py ``CASES``) run in a fresh interpreter through the real app on the
bundled model (and, slow tier, on a random GPT-2-small-shaped model); the kernel's peak-RSS
mark (VmHWM, reset before the request) minus the RSS before is the request's peak, and the
bytes the engine asked the memory budget for are its estimate:
``peak <= 1.1 x estimate + 2 MiB`` (``estimate_peak.within``). A new endpoint without a case
fails :func:`test_every_post_endpoint_has_a_case`. Planted fault: the scratch estimator
halved (``estimate_peak.halve``) is caught by the same check.
"""

from __future__ import annotations

import functools

import pytest

import estimate_peak as EP


@functools.lru_cache(maxsize=1)
def _post_paths() -> tuple[str, ...]:
    from attnscope.service.serving.core.table import default_table

    return tuple(ep.path for ep in default_table() if ep.method == "POST")


def test_every_post_endpoint_has_a_case():
    table = EP.cases()
    missing = [p for p in _post_paths() if not any(m == "bundled" for _, m, _ in
                                                     table.get(p, []))]
    assert not missing, f"add a heavy bundled-model case for {missing} to estimate_peak.cases()"


def _names(path: str, model: str) -> list[str]:
    return [n for n, m, _ in EP.cases()[path] if m == model]


def _report(rows: list[dict]) -> str:
    return "; ".join(f"{r['case']}: status {r['status']}, peak {r['peak'] / 2**20:.1f} MiB, "
                     f"estimate {r['estimate'] / 2**20:.1f} MiB "
                     f"({r['peak'] / max(r['estimate'], 1):.2f}x) {r.get('error', '')}"
                     for r in rows)


@pytest.mark.model
@pytest.mark.parametrize("path", sorted(EP.cases()))
def test_peak_is_within_the_estimate(path):
    rows = EP.run_fresh("bundled", _names(path, "bundled"))
    assert len(rows) == len(_names(path, "bundled")), rows
    bad = [r for r in rows if not EP.within(r)]
    assert not bad, _report(bad)


SMALL = [n for n, (_, m, _) in EP.case_table().items() if m == "small"]


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("name", SMALL)
def test_peak_is_within_the_estimate_on_gpt2_small(name):
    rows = EP.run_fresh("small", [name])
    assert len(rows) == 1 and EP.within(rows[0]), _report(rows)


@pytest.mark.model
def test_a_halved_estimator_is_caught():
    """Planted fault: /v1/scratch-attention's estimator returns half; its heavy matrices
    request (4.2M weights) then peaks over 1.1 x the estimate."""
    rows = EP.run_fresh("bundled", ["scratch-matrices"],
                        halve_fn="attnscope.service.serving.scratch:_estimate")
    assert len(rows) == 1 and rows[0]["status"] == 200, rows
    assert not EP.within(rows[0]), _report(rows)
