"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..encoding import ORJSONResponse
from ..errors import envelope

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> dict:
    """Always 200 while the process serves HTTP (even while the model loads)."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="Readiness: the model is loaded and its probe forward worked",
    responses={503: {"description": "Not ready (loading, or the load failed)."}},
)
async def readyz(request: Request):
    """200 ``{"status": "ready", "model": id}`` once the model is loaded and its probe forward
    returned every layer's attention; 503 with the error envelope until then, and while the
    server drains (``shutting_down``)."""
    if getattr(request.app.state, "draining", False):
        return ORJSONResponse(envelope("shutting_down", "the service is shutting down"),
                              status_code=503)
    rt = getattr(request.app.state, "runtime", None)
    if rt is None:
        err = getattr(request.app.state, "load_error", None)
        msg = f"model failed to load: {err}" if err else "model is loading"
        return ORJSONResponse(envelope("not_ready", msg), status_code=503)
    return {"status": "ready", "model": rt.info["id"]}
