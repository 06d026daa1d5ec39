"""Issue 17, point 7: log lines that cannot be forged, no model paths or allowed origins shown
to clients, only the Swagger UI files /docs needs, and index checks that do not scale with a
huge list."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from attnscope.service.config import BUNDLED_MODEL_DIR, Settings
from attnscope.service.logs import JsonFormatter, TextFormatter

FORGED = "/x\n2026-01-01 00:00:00,000 INFO attnscope.access [-]: request status=200\r\u2028\u2029\x85\x1b[2J"


def _record(**kw):
    return logging.makeLogRecord({"name": "attnscope.access", "levelname": "INFO",
                                  "levelno": 20, "msg": "request", **kw})


@pytest.mark.parametrize("where", ["fields", "message"])
def test_text_log_lines_cannot_be_forged(where):
    rec = _record(fields={"path": FORGED}) if where == "fields" else _record(msg="GET %s", args=(FORGED,))
    line = TextFormatter().format(rec)
    assert line.splitlines() == [line]  # one line, whatever splitlines counts as a break
    assert "\x1b" not in line and "\\n2026" in line


def test_json_log_lines_escape_unicode_line_separators():
    line = JsonFormatter().format(_record(fields={"path": FORGED}))
    assert line.splitlines() == [line]
    assert json.loads(line)["path"] == FORGED  # the value itself is intact


def test_an_unescaped_formatter_would_be_forged():
    """Planted fault: the plain logging formatter lets the same path start a second line."""
    plain = logging.Formatter("%(message)s path=%(path)s")
    assert len(plain.format(_record(path=FORGED)).splitlines()) > 1


def test_tracebacks_are_indented_continuation_lines():
    try:
        raise ValueError("boom\nINFO forged")
    except ValueError:
        import sys

        rec = _record(exc_info=sys.exc_info())
    lines = TextFormatter().format(rec).split("\n")
    assert all(x.startswith("    | ") for x in lines[1:]) and len(lines) > 2


def test_model_paths_are_not_shown_to_clients(tmp_path, make_client):
    from attnscope.service.runtime import Runtime

    secret = tmp_path / "secret-lab" / "my-finetune"
    shutil.copytree(BUNDLED_MODEL_DIR, secret)
    rt = Runtime.load(Settings(model=str(secret)))
    c = make_client(rt, model=str(secret))
    for path in ("/readyz", "/v1/model"):
        r = c.get(path)
        assert r.status_code == 200 and str(tmp_path) not in r.text, r.text
    assert c.get("/v1/model").json()["requested"] == "my-finetune"


def test_load_errors_shown_to_clients_have_no_paths(tmp_path):
    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app

    missing = tmp_path / "private" / "weights-here"
    missing.mkdir(parents=True)
    app = create_app(Settings(model=str(missing), exit_on_load_failure=False))
    with TestClient(app) as c:
        import time

        for _ in range(2400):  # wait for the event (the load failed); 120 s: a safety net
            r = c.get("/readyz")
            if "failed" in r.text:
                break
            time.sleep(0.05)
        assert r.status_code == 503 and "failed to load" in r.text
        assert str(tmp_path) not in r.text and "weights-here" in r.text, r.text


def test_refused_cors_preflight_does_not_list_allowed_origins(make_client, gpt2_runtime):
    c = make_client(gpt2_runtime, cors_origins="https://internal.lab.example")
    r = c.options("/v1/attention", headers={"Origin": "https://evil.example",
                                            "Access-Control-Request-Method": "POST"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "Origin"
    assert "internal.lab.example" not in r.text
    ok = c.options("/v1/attention", headers={"Origin": "https://internal.lab.example",
                                             "Access-Control-Request-Method": "POST"})
    assert ok.status_code == 200


def test_only_the_swagger_files_docs_needs_are_served(client):
    from attnscope.service.web import SWAGGER_UI_FILES

    docs = client.get("/docs").text
    for f in SWAGGER_UI_FILES:
        assert client.get(f"/static/swagger-ui/{f}").status_code == 200
    assert "swagger-ui-bundle.js" in docs
    for f in ("index.html", "swagger-ui-bundle.js.map", "swagger-initializer.js", "petstore.json",
              "../config.py"):
        assert client.get(f"/static/swagger-ui/{f}").status_code == 404, f


def test_huge_index_lists_are_checked_in_o_limit(client):
    """A 400,000-entry ``layers`` list: 422 from its length alone (the schema's max_length,
    MAX_INDICES). Within that length: 422 naming the first offending entry, found among the
    first n_layers + 1 entries (distinct in-range indices are at most n_layers)."""
    from attnscope.schemas.common import MAX_INDICES

    for layers in ([0] * 400_000, list(range(400_000))):
        r = client.post("/v1/attention", json={"text": "a b", "layers": layers})
        e = r.json()["error"]
        assert r.status_code == 422 and e["param"] == "layers", e
        assert f"at most {MAX_INDICES} items" in e["message"] and "400000" in e["message"], e
    r = client.post("/v1/attention", json={"text": "a b", "layers": [0] * MAX_INDICES})
    assert r.status_code == 422 and r.json()["error"]["param"] == "layers.1"
    r = client.post("/v1/attention", json={"text": "a b", "layers": list(range(MAX_INDICES))})
    assert r.status_code == 422 and r.json()["error"]["param"] == "layers.2"
    assert client.post("/v1/attention", json={"text": "a b", "layers": [1, 0]}).status_code == 200
