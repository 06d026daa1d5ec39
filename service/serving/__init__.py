"""Serving: one module per endpoint family. Each ``plan(rt, req, items)`` makes the feature's
model-aware checks, estimates its response and returns the :class:`~attnscope.service.runtime.
engine.Plan` whose ``job`` turns recorded forwards into the response body by calling the pure
analyses; the job runs on the device thread, in the same turn as the forwards (DESIGN.md)."""
