"""Domain errors and the one exception -> HTTP status table.

Every non-2xx response has the envelope ``{"error": {"type", "message", "param"}}``; clients
branch on ``type``. Runtime and analysis code raise these (they know nothing about HTTP);
``service.app`` turns them into responses through ``STATUS``.
"""

from __future__ import annotations


class AttnscopeError(Exception):
    """Base: ``type`` is the machine-readable error type, ``param`` the request field at fault,
    ``headers`` extra response headers."""

    type = "internal_error"
    status = 500
    headers: dict[str, str] = {}

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(AttnscopeError):
    type = "validation_error"
    status = 422


class ContextLengthExceeded(InvalidRequest):
    type = "context_length_exceeded"


class OutOfRange(InvalidRequest):
    type = "out_of_range"


class BatchTooLarge(InvalidRequest):
    type = "batch_too_large"


class MemoryLimitExceeded(InvalidRequest):
    """The request would need more memory than ``max_request_bytes`` (checked before any
    forward runs; the message names the estimate and the limit)."""

    type = "memory_limit_exceeded"


class UnsupportedModelConfig(InvalidRequest):
    """The resident model's config sets a switch an analysis does not implement (e.g. the
    from-scratch verification and an activation it has no formula for): refused, never
    answered as if the switch were absent. The message names the config key and its value."""

    type = "unsupported_model_config"


class NotAcceptable(AttnscopeError):
    """The ``Accept`` header names no media type the endpoint can produce."""

    type = "not_acceptable"
    status = 406


class PayloadTooLarge(AttnscopeError):
    type = "payload_too_large"
    status = 413


class Overloaded(AttnscopeError):
    type = "overloaded"
    status = 429
    headers = {"Retry-After": "1"}  # seconds (RFC 9110 10.2.3); the queue moves in ~0.2 s steps


class NotReady(AttnscopeError):
    type = "not_ready"
    status = 503


class ShuttingDown(AttnscopeError):
    """The server is draining (SIGTERM): a request arriving now, or whose job was stopped at
    the end of the grace period, gets 503 with ``Retry-After`` (another replica answers)."""

    type = "shutting_down"
    status = 503
    headers = {"Retry-After": "1", "Connection": "close"}


class DeviceLimitExceeded(InvalidRequest):
    """The request's estimated device work exceeds ``max_request_flops`` (checked before any
    forward runs; the message names the estimate and the limit)."""

    type = "device_limit_exceeded"


class Unauthorized(AttnscopeError):
    type = "unauthorized"
    status = 401


class Timeout(AttnscopeError):
    type = "timeout"
    status = 504


class NonFiniteValues(AttnscopeError):
    """A tensor the model produced holds NaN/inf where none may be (never sent silently)."""

    type = "non_finite_values"
    status = 500


def n_tokens(n: int) -> str:
    """``"1 token"``, ``"2 tokens"``: a token count in an error message."""
    return f"{n} token" if n == 1 else f"{n} tokens"


def envelope(type_: str, message: str, param: str | None = None) -> dict:
    return {"error": {"type": type_, "message": message, "param": param}}


_PATH = None


def scrub_paths(text: str) -> str:
    """``text`` with every filesystem path (``/...``, ``~/...``, ``./...``, ``C:\\...``)
    replaced by its last component in angle brackets (``<model>``): messages clients read
    (``/readyz``, 503s, ``/v1/model``) never show where the model lives; the log has it."""
    global _PATH
    import re

    if _PATH is None:
        _PATH = re.compile(r"(?:(?<=^)|(?<=[\s'\"(=:,\[]))(?:~|\.{1,2})?(?:[A-Za-z]:)?[/\\]"
                           r"[^\s'\")\],]*")

    def last(m) -> str:
        parts = [p for p in re.split(r"[/\\]", m.group(0)) if p and p not in ("~", ".", "..")]
        return f"<{parts[-1]}>" if parts else "<path>"

    return _PATH.sub(last, text)
