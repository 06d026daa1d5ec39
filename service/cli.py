"""``attnscope serve``: start the service (one uvicorn worker, one model copy)."""

from __future__ import annotations

import argparse
import logging
import logging.config
import sys

from pydantic import ValidationError


def _serve_parser(sub) -> argparse.ArgumentParser:
    from .config import Settings

    p = sub.add_parser("serve", help="start the HTTP service")
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_ = (field.description or "") + f" (env ATTNSCOPE_{name.upper()}, default {field.default!r})"
        help_ = help_.replace("%", "%%")  # argparse formats help strings with %
        if field.annotation is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            p.add_argument(flag, dest=name, default=None, help=help_)
    return p


def serve(args: argparse.Namespace) -> int:
    from .app import create_app
    from .config import Settings

    overrides = {k: v for k, v in vars(args).items() if k not in ("cmd", "func") and v is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        # one line per setting at fault, named as its flag (and its environment variable)
        for e in exc.errors(include_url=False):
            name = str(e["loc"][0]) if e.get("loc") else ""
            where = (f"--{name.replace('_', '-')} (env ATTNSCOPE_{name.upper()})" if name
                     else "configuration")
            msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
            got = f" (got {e['input']!r})" if name and not isinstance(e.get("input"), dict) else ""
            print(f"attnscope serve: {where}: {msg}{got}", file=sys.stderr)
        return 2
    from .logs import logging_config

    from .server import serve as run_server

    log_config = logging_config(settings.log_level, settings.log_format)
    logging.config.dictConfig(log_config)
    app = create_app(settings)
    try:
        run_server(app, settings)  # uvicorn with our connection/header limits
    except ValueError as exc:
        print(f"attnscope serve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="attnscope", description="attnscope: attention as a service")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _serve_parser(sub).set_defaults(func=serve)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
