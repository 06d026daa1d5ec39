"""Typed exceptions: one class per error ``type`` of the service's envelope.

Every non-2xx answer of attnscope is ``{"error": {"type", "message", "param"}}``; the types
and their statuses are listed once, in ``attnscope.schemas.errors.ERROR_TYPES`` (shared with
the service). The client raises the class registered for ``type`` (:data:`ERROR_TYPES` is
built from that table: a type without a class of its own gets its status's class), and an
unknown type falls back to the class for the HTTP status (so a newer server's new error types
still land in the right family). Transport failures raise :class:`APIConnectionError` /
:class:`APITimeoutError`. Every exception raised for an HTTP answer or a transport failure is
raised ``from`` the underlying httpx error. A request that fails its schema on this side, before
anything is sent, raises :class:`RequestValidationError` (also a ``ValueError``), raised
``from`` pydantic's error.

Hierarchy (openai-python's shape)::

    AttnscopeError
    ├── RequestValidationError         refused before sending: message, param, errors
    ├── APIError                       message, request, body
    │   ├── APIConnectionError         the server could not be reached
    │   │   └── APITimeoutError        no answer within the timeout
    │   ├── APIResponseValidationError a 2xx body that does not fit the schema
    │   └── APIStatusError             status_code, type, param, response
    │       ├── BadRequestError (400)
    │       ├── UnauthorizedError (401, unauthorized)
    │       ├── PermissionDeniedError (403, forbidden)
    │       ├── NotFoundError (404, not_found)
    │       ├── MethodNotAllowedError (405, method_not_allowed)
    │       ├── NotAcceptableError (406, not_acceptable)
    │       ├── RequestTimeoutError (408)
    │       ├── PayloadTooLargeError (413, payload_too_large)
    │       ├── UnprocessableEntityError (422, validation_error; was ValidationError)
    │       │   ├── ContextLengthExceededError (context_length_exceeded)
    │       │   ├── OutOfRangeError (out_of_range)
    │       │   ├── BatchTooLargeError (batch_too_large)
    │       │   └── MemoryLimitExceededError (memory_limit_exceeded)
    │       ├── OverloadedError (429, overloaded)
    │       ├── InternalServerError (5xx, internal_error)
    │       │   └── NonFiniteValuesError (non_finite_values)
    │       ├── NotReadyError (503, not_ready)
    │       └── GatewayTimeoutError (504, timeout)
"""

from __future__ import annotations

from typing import Any

import warnings

import httpx

from attnscope.schemas.errors import ERROR_TYPES as _SERVER_ERROR_TYPES

__all__ = [
    "AttnscopeError",
    "RequestValidationError",
    "APIError",
    "APIConnectionError",
    "APITimeoutError",
    "APIResponseValidationError",
    "APIStatusError",
    "BadRequestError",
    "UnauthorizedError",
    "PermissionDeniedError",
    "NotFoundError",
    "MethodNotAllowedError",
    "RequestTimeoutError",
    "NotAcceptableError",
    "PayloadTooLargeError",
    "UnprocessableEntityError",
    "ContextLengthExceededError",
    "OutOfRangeError",
    "BatchTooLargeError",
    "MemoryLimitExceededError",
    "OverloadedError",
    "InternalServerError",
    "NonFiniteValuesError",
    "NotReadyError",
    "GatewayTimeoutError",
    "status_error",
]


class AttnscopeError(Exception):
    """Base of every exception the client raises."""


class RequestValidationError(AttnscopeError, ValueError):
    """The request does not fit its schema (unknown option, bad value, empty text ...): refused
    by the client before anything is sent, so no status and no response.

    Attributes:
        message: every problem, ``"field: what is wrong"``, joined with ``"; "``.
        param: the first field at fault, dotted as the server's envelope names it (or None).
        errors: pydantic's list of errors (``loc``, ``msg``, ``type`` ...).
    """

    type = "validation_error"

    def __init__(self, message: str, param: str | None = None, errors: list | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.errors = list(errors or [])

    @classmethod
    def from_pydantic(cls, exc: Any, what: str = "request") -> RequestValidationError:
        """From a ``pydantic.ValidationError`` of the request model (``what`` names it)."""
        errs = exc.errors(include_url=False)
        parts, param = [], None
        for e in errs:
            param = param or ".".join(str(x) for x in e.get("loc", ())) or None
            parts.append(pydantic_problem(e))
        return cls(f"invalid {what}: " + "; ".join(parts), param, errs)


def pydantic_problem(e: dict) -> str:
    """One of pydantic's errors (``ValidationError.errors()``) as ``"field: what is wrong"``
    (a model-level rule: its message alone), without the "Value error, " pydantic puts in
    front of a validator's own message."""
    loc = ".".join(str(x) for x in e.get("loc", ()))
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg


class APIError(AttnscopeError):
    """An error talking to the service. ``body`` is the decoded JSON body, if any."""

    message: str
    request: httpx.Request | None
    body: Any

    def __init__(self, message: str, request: httpx.Request | None = None, body: Any = None):
        super().__init__(message)
        self.message = message
        self.request = request
        self.body = body


class APIConnectionError(APIError):
    """The service could not be reached (refused, reset, DNS, ...) after every retry."""

    def __init__(self, message: str = "connection error", request: httpx.Request | None = None):
        super().__init__(message, request)


class APITimeoutError(APIConnectionError):
    """No answer within the client's timeout (after every retry)."""

    def __init__(self, request: httpx.Request | None = None, message: str = "request timed out"):
        super().__init__(message, request)


class APIResponseValidationError(APIError):
    """The service answered 2xx with a body that does not fit the response schema."""

    def __init__(self, message: str, response: httpx.Response, body: Any = None):
        super().__init__(message, response.request, body)
        self.response = response
        self.status_code = response.status_code


class APIStatusError(APIError):
    """The service answered with a non-2xx status and (usually) the error envelope.

    Attributes:
        status_code: the HTTP status.
        type: the envelope's machine-readable ``error.type`` (branch on this, not on text).
        param: the request field at fault (dotted), or None.
        response: the httpx response.
    """

    status_code: int
    type: str | None
    param: str | None

    def __init__(self, message: str, *, response: httpx.Response, body: Any = None,
                 type: str | None = None, param: str | None = None):
        super().__init__(message, response.request, body)
        self.response = response
        self.status_code = response.status_code
        self.type = type
        self.param = param

    def __str__(self) -> str:  # "422 out_of_range: layers[0] = 7 is out of range ..."
        return f"{self.status_code} {self.type or 'error'}: {self.message}"


class BadRequestError(APIStatusError):
    pass


class UnauthorizedError(APIStatusError):
    """401: missing or wrong API key (``ATTNSCOPE_API_KEY`` / ``api_key=``)."""


class PermissionDeniedError(APIStatusError):
    pass


class NotFoundError(APIStatusError):
    pass


class MethodNotAllowedError(APIStatusError):
    pass


class RequestTimeoutError(APIStatusError):
    pass


class NotAcceptableError(APIStatusError):
    """406: the ``Accept`` header names no media type the endpoint can produce."""


class PayloadTooLargeError(APIStatusError):
    pass


class UnprocessableEntityError(APIStatusError):
    """422: the server refused the request as invalid (the message names the field, the limit
    and the value). Called ``ValidationError`` before 0.2 (still importable, deprecated: the
    name was easy to confuse with ``pydantic.ValidationError``)."""


class ContextLengthExceededError(UnprocessableEntityError):
    pass


class OutOfRangeError(UnprocessableEntityError):
    pass


class BatchTooLargeError(UnprocessableEntityError):
    pass


class MemoryLimitExceededError(UnprocessableEntityError):
    """422: the request would need more memory than the server's ``max_request_bytes``."""


class OverloadedError(APIStatusError):
    """429: the service's device queue (or a rate limit) is full; retried automatically."""


class InternalServerError(APIStatusError):
    pass


class NonFiniteValuesError(InternalServerError):
    """500: the model produced NaN/inf; deterministic for the input, so never retried."""


class NotReadyError(APIStatusError):
    """503: the model is not loaded yet (retried automatically)."""


class GatewayTimeoutError(APIStatusError):
    pass


STATUS_ERRORS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: UnauthorizedError,
    403: PermissionDeniedError,
    404: NotFoundError,
    405: MethodNotAllowedError,
    406: NotAcceptableError,
    408: RequestTimeoutError,
    413: PayloadTooLargeError,
    422: UnprocessableEntityError,
    429: OverloadedError,
    503: NotReadyError,
    504: GatewayTimeoutError,
}
"""Fallback by HTTP status when the envelope's type is unknown or missing."""

_TYPE_CLASSES: dict[str, type[APIStatusError]] = {
    "validation_error": UnprocessableEntityError,
    "context_length_exceeded": ContextLengthExceededError,
    "out_of_range": OutOfRangeError,
    "batch_too_large": BatchTooLargeError,
    "memory_limit_exceeded": MemoryLimitExceededError,
    "non_finite_values": NonFiniteValuesError,
    "internal_error": InternalServerError,
}
"""Types with a class of their own (the rest get their status's class)."""


def _status_class(status: int) -> type[APIStatusError]:
    cls = STATUS_ERRORS.get(status)
    if cls is None:
        cls = InternalServerError if status >= 500 else APIStatusError
    return cls


ERROR_TYPES: dict[str, type[APIStatusError]] = {
    t: _TYPE_CLASSES.get(t) or _status_class(status) for t, status in _SERVER_ERROR_TYPES.items()
}
"""Envelope ``error.type`` -> exception class, for every type in
``attnscope.schemas.errors.ERROR_TYPES`` (the service's one list)."""


_DEPRECATED = {"ValidationError": ("UnprocessableEntityError", UnprocessableEntityError)}


def _deprecated(name: str, stacklevel: int):
    new, obj = _DEPRECATED[name]
    warnings.warn(f"attnscope.client.{name} is deprecated: use {new} (the 422 answer; "
                  "RequestValidationError is the local check)", DeprecationWarning,
                  stacklevel=stacklevel + 1)
    return obj


def __getattr__(name: str):
    if name in _DEPRECATED:
        return _deprecated(name, 2)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def status_error(response: httpx.Response) -> APIStatusError:
    """Build the typed exception for a non-2xx ``response`` (envelope or not)."""
    body: Any = None
    etype = param = None
    message = f"HTTP {response.status_code}"
    try:
        body = response.json()
    except ValueError:
        text = response.text.strip()
        if text:
            message = f"HTTP {response.status_code}: {text[:300]}"
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        etype = err.get("type")
        param = err.get("param")
        message = str(err.get("message") or message)
    elif isinstance(body, dict) and "detail" in body:  # a plain FastAPI/Starlette answer
        message = str(body["detail"])
    if response.status_code == 404 and etype in (None, "not_found"):
        # a wrong base URL (a path prefix, /v1 twice, another service) answers 404 for every
        # endpoint: say which URL was asked and what to check
        try:
            url = str(response.request.url)
        except RuntimeError:  # a response built without its request
            url = None
        message += (f" ({url} was not found: check the path of the client's base URL, e.g. "
                    "http://127.0.0.1:8000 without /v1 or a trailing path)" if url else
                    " (check the path of the client's base URL)")
    cls = ERROR_TYPES.get(etype or "")
    if cls is None:
        cls = _status_class(response.status_code)
    return cls(message, response=response, body=body, type=etype, param=param)
