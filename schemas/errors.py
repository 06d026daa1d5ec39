"""The error envelope's vocabulary: every ``error.type`` the service sends, with its status.

The one list, shared by the service (``service/errors.py`` classes and the app's handlers
send only these; ``tests/test_errors.py`` checks them against this table) and the client
(``attnscope.client`` builds its exception per type from it). Any other HTTP error the web
framework raises goes out as ``http_error`` with its own status; the client maps it by status.
"""

from __future__ import annotations

ERROR_TYPES: dict[str, int] = {
    "validation_error": 422,         # empty text, unknown field, bad option value, bad JSON
    "context_length_exceeded": 422,  # more tokens than the model's context
    "out_of_range": 422,             # a layer or head index outside the model
    "batch_too_large": 422,          # more texts than max_batch
    "memory_limit_exceeded": 422,    # the memory estimate is over max_request_bytes
    "device_limit_exceeded": 422,    # the device-work estimate (FLOP) is over max_request_flops
    "unsupported_model": 422,        # predictions / ablate / patch on a model without an LM head
    "unsupported_model_config": 422,  # the model's config sets a switch an analysis lacks
    "unauthorized": 401,             # API keys configured, none or a wrong one given
    "not_found": 404,                # no such path
    "method_not_allowed": 405,       # e.g. GET /v1/attention
    "not_acceptable": 406,           # Accept names no media type the endpoint produces
    "payload_too_large": 413,        # body over max_body_bytes
    "overloaded": 429,               # max_queue requests already wait for the device
    "internal_error": 500,           # a bug (logged with the request id)
    "non_finite_values": 500,        # the model produced NaN/inf
    "not_ready": 503,                # the model is not loaded (yet)
    "shutting_down": 503,            # the server is draining (SIGTERM); retry elsewhere
    "timeout": 504,                  # the request ran past request_timeout_s
}
"""Envelope ``error.type`` -> HTTP status."""
