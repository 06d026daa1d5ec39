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


@functools.lru_cache(maxsize=None)
def _rows(model: str, names: tuple[str, ...]) -> dict[str, dict]:
    """Every case of ``names`` measured in one fresh interpreter (one model load; each case
    warmed, its heap trimmed and its peak mark reset before it: :func:`estimate_peak.measure`),
    by case name."""
    return {r["case"]: r for r in EP.run_fresh(model, list(names))}


BUNDLED = tuple(n for n, (_, m, _) in EP.case_table().items() if m == "bundled")


@pytest.mark.model
@pytest.mark.parametrize("path", sorted(EP.cases()))
def test_peak_is_within_the_estimate(path):
    measured = _rows("bundled", BUNDLED)
    rows = [measured[n] for n in _names(path, "bundled") if n in measured]
    assert len(rows) == len(_names(path, "bundled")), (path, sorted(measured))
    bad = [r for r in rows if not EP.within(r)]
    assert not bad, _report(bad)


#: GPT-2-small cases too slow for the suite (5.6 min and 48 s of a 2-core CI machine): run by
#: hand, ``python tests/estimate_peak.py small small:patch-per-position-residual``
SMALL_BY_HAND = ("small:patch-per-position-residual", "small:logit-lens")
SMALL = tuple(n for n, (_, m, _) in EP.case_table().items()
              if m == "small" and n not in SMALL_BY_HAND)


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("name", SMALL)
def test_peak_is_within_the_estimate_on_gpt2_small(name):
    rows = EP.run_fresh("small", [name])  # each alone: a GPT-2-small case after another
    # measured 1.14x where alone it is within (the earlier cases' heap left fragmented)
    assert len(rows) == 1 and EP.within(rows[0]), _report(rows)


@pytest.mark.model
def test_a_halved_estimator_is_caught():
    """Planted fault: /v1/scratch-attention's estimator returns half; its heavy matrices
    request (4.2M weights) then peaks over 1.1 x the estimate."""
    rows = EP.run_fresh("bundled", ["scratch-matrices"],
                        halve_fn="attnscope.service.serving.scratch:_estimate")
    assert len(rows) == 1 and rows[0]["status"] == 200, rows
    assert not EP.within(rows[0]), _report(rows)
