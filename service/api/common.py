"""What routers share: the OpenAPI error responses of a /v1 route. (The checks are in
service/serving/checks.py, the forward call in service/runtime/engine.py.)"""

from __future__ import annotations

from attnscope.service.serving.checks import check_distinct, check_index, check_indices  # noqa: F401


def error_responses(invalid: str = "Invalid request (field, limit and value named).",
                    *, device: bool = True) -> dict:
    """OpenAPI ``responses`` of a /v1 route: every status it can answer besides 200, each with
    the error envelope. ``invalid`` describes the route's own 422 cases; ``device=False`` for
    routes that never wait for the device (no 429)."""
    from attnscope.schemas import ErrorResponse

    out = {
        401: {"model": ErrorResponse, "description": "API keys are configured and none was valid."},
        413: {"model": ErrorResponse, "description": "Request body too large."},
        422: {"model": ErrorResponse, "description": invalid},
        429: {"model": ErrorResponse, "description": "Overloaded: the device queue is full."},
        503: {"model": ErrorResponse, "description": "The model is not loaded yet."},
        504: {"model": ErrorResponse, "description": "The request ran past request_timeout_s."},
    }
    if not device:
        del out[429]
    return out
