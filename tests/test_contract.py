"""Numbers written in two layers that may not import each other stay one number.

The head-label thresholds are part of the API contract (``schemas.heads.HeadThresholds``, whose
defaults are documented in OpenAPI), and the pure analysis (``service.analysis.heads``, which
may not import schemas) keeps the same defaults for callers that pass none: this test holds
them equal, field by field, and holds the label order to the thresholds' fields.
"""

from __future__ import annotations

from attnscope.schemas.heads import HeadLabel, HeadThresholds
from attnscope.service.analysis import heads as H


def test_threshold_defaults_are_the_schemas():
    schema = HeadThresholds().model_dump()
    assert schema == dict(H.DEFAULT_THRESHOLDS)
    for name, field in HeadThresholds.model_fields.items():  # the documented default, too
        assert f"Default {field.default}." in field.description, name


def test_every_label_has_a_threshold_and_a_name():
    assert set(H.LABEL_ORDER) == set(HeadThresholds.model_fields)
    assert set(HeadLabel.__args__) == set(H.LABEL_ORDER) | {"none"}


def test_a_planted_drift_is_seen(monkeypatch):
    monkeypatch.setitem(H.DEFAULT_THRESHOLDS, "sink", 0.55)
    assert HeadThresholds().model_dump() != dict(H.DEFAULT_THRESHOLDS)
