"""Structured logs: one JSON object per line, carrying the request id of the request being served.

The request id lives in a :mod:`contextvars` variable set by
:class:`attnscope.service.ops.RequestContextMiddleware`; anyio copies the context into worker
threads, so a log line written during a forward pass carries its request's id too.

``logging_config(settings)`` is a :func:`logging.config.dictConfig` dictionary used both for the
process and for uvicorn (``uvicorn.run(log_config=...)``), so uvicorn's own lines are JSON as well.
Its per-request access log is switched off: the service writes its own ``request`` line
(method, path, route template, status, duration, request id) instead.
"""

from __future__ import annotations

import contextvars
import datetime as _dt
import json
import logging

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "attnscope_request_id", default=None
)

_STD_ATTRS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "request_id",
                                                     "color_message"}  # uvicorn's ANSI copy


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (``"-"`` outside a request) for text formats."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get() or "-"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (UTC, ISO 8601, ms), ``level``, ``logger``, ``msg``,
    ``request_id`` (when inside a request), the fields passed as ``extra={"fields": {...}}`` (or
    as plain ``extra`` keys), and ``exc`` (the formatted traceback) for exceptions."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict = {
            "ts": _dt.datetime.fromtimestamp(record.created, _dt.timezone.utc).isoformat(
                timespec="milliseconds"
            ).replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or request_id_var.get()
        if rid and rid != "-":
            out["request_id"] = rid
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        for k, v in record.__dict__.items():
            if k not in _STD_ATTRS and k != "fields" and k not in out:
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``time level logger [request_id]: message key=value ...``: the text format, with the
    fields passed as ``extra={"fields": {...}}`` (the access line's method, path, status,
    duration_ms, ...) appended, so it says what the JSON format says."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get() or "-"
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict) and fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return line


def logging_config(log_level: str = "info", log_format: str = "json") -> dict:
    """A dictConfig for the process and uvicorn. ``log_format``: ``"json"`` or ``"text"``."""
    level = log_level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": "attnscope.service.logs.RequestIdFilter"}},
        "formatters": {
            "json": {"()": "attnscope.service.logs.JsonFormatter"},
            "text": {"()": "attnscope.service.logs.TextFormatter"},
        },
        "handlers": {
            "default": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": "json" if log_format == "json" else "text",
                "filters": ["request_id"],
            }
        },
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": level, "propagate": False},
            "uvicorn.error": {"level": level},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
        },
        "root": {"handlers": ["default"], "level": level},
    }
