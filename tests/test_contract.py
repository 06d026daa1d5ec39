"""The head-label thresholds are written once, in the API contract.

``schemas.heads.HeadThresholds`` holds their values (documented in OpenAPI, shared with the
client). The pure analysis (``service.analysis.heads``, which may not import schemas) has none
of its own: ``classify_all`` takes a threshold for exactly each label and refuses anything
else, and the serving layer passes the request's ``HeadThresholds`` (defaults + overrides).
These tests hold the ends together: the schema's fields are the analysis' labels, the
analysis cannot fall back to numbers of its own, what ``/v1/heads`` labels with is the
schema's values (every margin is its score minus the schema's threshold), and the defaults the
README names are the schema's.
"""

from __future__ import annotations

import math
import re

import pytest

from attnscope.schemas.heads import HeadLabel, HeadThresholds
from attnscope.service.analysis import heads as H

from conftest import ROOT, SENTENCE


def test_every_threshold_documents_its_default():
    for name, field in HeadThresholds.model_fields.items():  # the default shown in OpenAPI
        assert f"Default {field.default}." in field.description, name


def test_every_label_has_a_threshold_and_a_name():
    assert set(H.LABEL_ORDER) == set(HeadThresholds.model_fields)
    assert set(HeadLabel.__args__) == set(H.LABEL_ORDER) | {"none"}


SCORES = {"induction_probe": 0.1, "induction": 0.1, "previous_s004": 0.9, "duplicate_token": 0.0,
          "next_token": None, "self": 0.1, "sink_s004": 0.2, "entropy_normalized": 0.5}


def test_the_analysis_has_no_thresholds_of_its_own():
    full = HeadThresholds().model_dump()
    assert H.classify_all(SCORES, full)["label"] == "previous_token"
    partial = {k: v for k, v in full.items() if k != "sink"}
    with pytest.raises(ValueError, match=r"missing \['sink'\]"):
        H.classify_all(SCORES, partial)  # no default to fall back to
    with pytest.raises(ValueError, match=r"unknown \['banana'\]"):
        H.classify_all(SCORES, {**full, "banana": 0.5})
    with pytest.raises(TypeError):
        H.classify_all(SCORES)  # type: ignore[call-arg]


def threshold_mismatches(body: dict, thresholds: dict) -> list[str]:
    """Heads of a ``/v1/heads`` body whose margins are not ``score - thresholds[label]`` (the
    score of :data:`H.LABEL_SCORE`, induction falling back to the text's score), or whose echoed
    thresholds differ: ``["layer.head label", ...]``."""
    bad = [] if body["thresholds"] == thresholds else ["echoed thresholds"]
    for head in body["heads"]:
        for label, margin in head["margins"].items():
            v = H.label_score(head["scores"], label)
            want = None if v is None else v - thresholds[label]
            if (want is None) != (margin is None) or (want is not None and margin != want):
                bad.append(f"{head['layer']}.{head['head']} {label}")
    return bad


@pytest.fixture(scope="module")
def default_heads(client):
    r = client.post("/v1/heads", json={"text": SENTENCE})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_service_labels_with_the_schemas_thresholds(default_heads):
    body = default_heads
    assert threshold_mismatches(body, HeadThresholds().model_dump()) == []
    assert len(body["heads"]) >= 4 and any(
        m is not None and not math.isnan(m) for h in body["heads"] for m in h["margins"].values())


def test_a_planted_threshold_drift_is_seen(default_heads):
    drifted = {**HeadThresholds().model_dump(), "sink": 0.55}
    bad = threshold_mismatches(default_heads, drifted)
    assert "echoed thresholds" in bad
    assert any(b.endswith(" sink") for b in bad) and not any(b.endswith(" self") for b in bad)


README_SHORT = {"previous": "previous_token", "duplicate": "duplicate_token", "next": "next_token",
                "induction": "induction", "self": "self", "sink": "sink", "broad": "broad"}


def readme_thresholds(text: str) -> dict[str, float]:
    """The defaults the README's ``/v1/heads`` row names: ``(defaults previous 0.5 on ...)``."""
    row = next(line for line in text.splitlines() if line.startswith("| `POST /v1/heads` |"))
    part = row.split("(defaults ", 1)[1].split(")", 1)[0]
    pairs = re.findall(r"\b(previous|duplicate|next|induction|self|sink|broad) (\d+(?:\.\d+)?)",
                       part)
    return {README_SHORT[n]: float(v) for n, v in pairs}


def test_the_api_docs_name_the_schemas_defaults():
    text = (ROOT / "docs" / "api.md").read_text()  # the endpoint details (README links it)
    assert readme_thresholds(text) == HeadThresholds().model_dump()
    assert "sink 0.6 on sink_s004" in text
    planted = text.replace("sink 0.6 on sink_s004", "sink 0.65 on sink_s004")
    assert readme_thresholds(planted) == {**HeadThresholds().model_dump(), "sink": 0.65}
