"""Operations: request ids and JSON request logs, Prometheus metrics, API keys, CORS, time limit.

``install_ops(app, settings)`` adds, outermost first (pure ASGI middlewares, no per-request
``BaseHTTPMiddleware`` overhead)::

    RequestContextMiddleware  request id (X-Request-ID accepted if sane, else generated; echoed),
                              one JSON log line per request, request metrics, and the 500
                              envelope for anything unhandled
    CORSMiddleware            only when settings.cors_origins is non-empty (Starlette's)
    ApiKeyMiddleware          only when settings.api_keys is non-empty: /v1/... needs
                              ``Authorization: Bearer <key>``; 401 envelope otherwise
    TimeoutMiddleware         settings.request_timeout_s > 0: 504 envelope at the deadline
    BodyLimitMiddleware       (service.app) 413 beyond max_body_bytes

and ``GET /metrics`` (Prometheus text format; not in the OpenAPI schema).

Open without a key: ``/healthz``, ``/readyz`` (probes), ``/metrics`` (scrapers; it shows
counts, latencies and the model's identity, never request content — keep it on an internal
network), ``/openapi.json`` and ``/docs``. Everything under ``/v1/`` (everything that runs the
model) needs a key when keys are configured.

One module per job: :mod:`.metrics` (the registry, the state collector, ``/metrics``),
:mod:`.middlewares` (request context and access log, API keys, time limit),
:mod:`.openapi` (the error envelope in OpenAPI, route templates), :mod:`.cors`.
"""

from __future__ import annotations

from fastapi import FastAPI

from .cors import cors_middleware
from .metrics import LATENCY_BUCKETS, Metrics, metrics_router
from .middlewares import (
    OPEN_PATHS,
    ApiKeyMiddleware,
    RequestContextMiddleware,
    TimeoutMiddleware,
    send_envelope,
)
from .openapi import document_errors, openapi_templates

__all__ = [
    "LATENCY_BUCKETS", "OPEN_PATHS", "ApiKeyMiddleware", "Metrics", "RequestContextMiddleware",
    "TimeoutMiddleware", "install_ops", "metrics_router", "send_envelope",
]


def install_ops(app: FastAPI, settings) -> None:
    """Add metrics, the operational middlewares (see the module docstring) and ``/metrics``.
    Call after the body-limit middleware was added (middlewares added later wrap it)."""
    app.state.metrics = Metrics(app)
    app.include_router(metrics_router)
    timeout_s = float(getattr(settings, "request_timeout_s", 0) or 0)
    app.state.abandoned = set()
    app.add_middleware(TimeoutMiddleware, seconds=timeout_s, abandoned=app.state.abandoned)
    keys = [k for k in (getattr(settings, "api_keys", []) or []) if k.strip()]
    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=keys)
    origins = list(getattr(settings, "cors_origins", []) or [])
    if origins:
        app.add_middleware(
            cors_middleware(),
            allow_origins=origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "X-Request-ID"],
            expose_headers=["X-Request-ID"],
            max_age=600,
        )
    app.add_middleware(RequestContextMiddleware, metrics=app.state.metrics,
                       templates=openapi_templates(app))
    document_errors(app, bool(keys), timeout_s)
