"""CORS (Starlette's middleware) with the error envelope on refused preflights."""

from __future__ import annotations

from ..encoding import ORJSONResponse
from ..errors import envelope


def cors_middleware():
    """Starlette's CORSMiddleware whose refused preflights (400) answer the error envelope
    (type ``validation_error``, param the refused part: origin, method or headers)."""
    from starlette.middleware.cors import CORSMiddleware

    class EnvelopeCORSMiddleware(CORSMiddleware):
        def preflight_response(self, request_headers):
            resp = super().preflight_response(request_headers)
            if resp.status_code < 400:
                return resp
            text = bytes(resp.body).decode("utf-8", "replace")
            keep = {k: v for k, v in resp.headers.items()
                    if k.lower() not in ("content-length", "content-type")}
            what = text.removeprefix("Disallowed CORS ").split(",")[0].strip() or "origin"
            param = {"origin": "Origin", "method": "Access-Control-Request-Method",
                     "headers": "Access-Control-Request-Headers"}.get(what, "Origin")
            # the refusal names what was refused, never the allowed origins (which would
            # tell anyone where the service is used from); methods and headers are public
            return ORJSONResponse(
                envelope("validation_error", f"CORS preflight refused ({text}); allowed "
                         "methods GET, POST, OPTIONS, headers Authorization, Content-Type, "
                         "X-Request-ID", param),
                status_code=resp.status_code, headers=keep,
            )

    return EnvelopeCORSMiddleware
