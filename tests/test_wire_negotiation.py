"""Accept negotiation: JSON or safetensors on /v1/attention (q-values, wildcards, garbage), 406
envelopes naming Accept, and the endpoints without a binary form never answering 500.
"""

from __future__ import annotations

import pytest

from conftest import assert_error as _err


# ------------------------------------------------------------------ Accept negotiation
ST = "application/x-safetensors"
TEXT = "The cat sat on the mat."


@pytest.mark.regression
@pytest.mark.parametrize("accept,binary", [
    ("", False), (" ", False), (",", False), (";", False), (" , ; ", False),
    ("*/*", False), ("application/*", False), (ST, True), (ST.upper(), True),
    (f"{ST};q=0.5, application/json", False), (f"{ST};Q=1, application/json;q=0.9", True),
    (f"{ST} ; q=0.8 , */* ; q=0.1", True), (f"{ST};q=2, application/json", False),
    (f"{ST}, text/html", True), ("text/html, */*;q=0.1", False),
])
def test_accept_negotiation(client, accept, binary):
    r = client.post("/v1/attention", json={"text": TEXT, "layers": [0]}, headers={"accept": accept})
    assert r.status_code == 200, (accept, r.text)
    assert r.headers["content-type"].startswith(ST if binary else "application/json")


def _good(c, headers=None):
    r = c.post("/v1/attention", json={"text": "hello world", "layers": [0]}, headers=headers or {})
    assert r.status_code == 200, r.text


@pytest.mark.regression
@pytest.mark.parametrize("accept", [
    "text/html", "garbage", "text/*", "*/*;q=0", "application/json;q=0",
    "application/json;q=-1", f"{ST};q=0", f"{ST};q=abc", f"{ST};q=nan", f"{ST};q=inf",
    "application/json;q=NaN", "x" * 10000,
])
def test_accept_refused_is_406(client, accept):
    e = _err(client.post("/v1/attention", json={"text": TEXT}, headers={"accept": accept}), 406,
             "not_acceptable", "Accept")
    assert len(e["message"]) < 400
    _good(client)


@pytest.mark.regression
@pytest.mark.parametrize("path,body", [
    ("/v1/tokenize", {"text": TEXT}), ("/v1/heads", {"text": TEXT, "probe": {"enabled": False}}),
    ("/v1/links", {"text": TEXT, "layer": 0}), ("/v1/trajectories", {"text": TEXT}),
    ("/v1/verify", {"text": TEXT}), ("/v1/scratch-attention", {"text": TEXT}),
])
@pytest.mark.parametrize("accept", ["", " ", "text/html", ST, f"{ST};q=abc", "*/*"])
def test_accept_on_other_endpoints_never_500(client, path, body, accept):
    """Endpoints without a binary form answer JSON (today whatever Accept says) or a 406
    envelope; never a 500, never a safetensors body."""
    r = client.post(path, json=body, headers={"accept": accept})
    assert r.status_code in (200, 406), r.text
    assert r.headers["content-type"].startswith("application/json")
    if r.status_code == 406:
        _err(r, 406, "not_acceptable", "Accept")
