"""Schemathesis against the service's own OpenAPI schema, through a real uvicorn on 127.0.0.1.

Every operation in /openapi.json gets a bounded number of generated requests (valid and
invalid ones). Checks: no 5xx, every status code documented, the documented content type, and
every response body valid against the schema (errors against the envelope schema).
Bounded: FUZZ_EXAMPLES examples per operation, no shrinking, no example database on disk.
"""

from __future__ import annotations

import os

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from schemathesis import checks as st_checks  # noqa: E402

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))
CHECKS = [getattr(st_checks, n) for n in (
    "not_a_server_error", "status_code_conformance", "content_type_conformance",
    "response_schema_conformance",
)]

pytestmark = pytest.mark.e2e


def test_openapi_contract(live_server):
    """Each operation: EXAMPLES generated cases; every failure is collected, then reported."""
    from hypothesis import given

    schema = schemathesis.openapi.from_url(live_server.url + "/openapi.json")
    failures: list[str] = []
    n_ops = 0
    for result in schema.get_all_operations():
        op = result.ok()
        n_ops += 1

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case):
            case.call_and_validate(checks=CHECKS, timeout=60)

        try:
            run()
        except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - collected, reported below
            failures.append(f"{op.label}: {str(exc)[:1500]}")
    assert n_ops >= 5
    assert not failures, "\n\n".join(failures)
