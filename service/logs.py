"""Structured logs: one JSON object per line, carrying the request id of the request being served.

The request id lives in a :mod:`contextvars` variable set by
:class:`attnscope.service.ops.middlewares.RequestContextMiddleware`; anyio copies the context
into worker threads, so a log line written during a forward pass carries its request's id too.

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

# Characters that end a line for some reader (str.splitlines, journald, log shippers: C0
# controls incl. CR/LF/VT/FF/FS/GS/RS, NEL U+0085, LINE/PARAGRAPH SEPARATOR U+2028/U+2029),
# plus the other C0 controls and DEL (terminal escapes): written as escapes, so no value a
# client controls (a path with %0a, a header) can start a forged log line.
_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F] if c != 0x09}
_ESCAPES.update({0x0A: "\\n", 0x0D: "\\r", 0x85: "\\u0085", 0x2028: "\\u2028",
                 0x2029: "\\u2029"})
_JSON_ESCAPES = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def one_line(text: str) -> str:
    """``text`` with every line-breaking or control character escaped (``\\n``, ``\\x1b``, ...)."""
    return text.translate(_ESCAPES)


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
        # json escapes C0 controls already; the Unicode line separators it writes raw
        return json.dumps(out, default=str, ensure_ascii=False).translate(_JSON_ESCAPES)


class TextFormatter(logging.Formatter):
    """``time level logger [request_id]: message key=value ...``: the text format, with the
    fields passed as ``extra={"fields": {...}}`` (the access line's method, path, status,
    duration_ms, ...) appended, so it says what the JSON format says."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get() or "-"
        record.message = record.getMessage()
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        line = one_line(self.formatMessage(record))
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict) and fields:
            line += " " + " ".join(f"{one_line(str(k))}={one_line(str(v))}"
                                   for k, v in fields.items())
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:  # a traceback: its lines indented, each escaped (never a record)
            line += "".join("\n    | " + one_line(x) for x in record.exc_text.splitlines())
        if record.stack_info:
            line += "".join("\n    | " + one_line(x) for x in record.stack_info.splitlines())
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
