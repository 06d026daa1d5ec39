"""Serving: one module per feature (docs/architecture.md, "Layers"). Each declares its
``ENDPOINTS`` (service/serving/core/table.py), a ``check`` and a ``plan(rt, req, items)`` that
makes the feature's model-aware checks, estimates its response and returns the
:class:`~.core.engine.Plan` whose ``job`` turns recorded forwards into the response body by
calling the pure analyses; the job runs on the device thread, in the same turn as the
forwards. The orchestration lives once, in ``core/``."""
