"""OpenAPI and route templates: the error envelope in the document, route labels for metrics.

* :func:`document_errors`: every 4xx/5xx body in ``/openapi.json`` is the envelope
  (``ErrorResponse``), and ``/v1/...`` documents 401 / 504 when keys / a time limit are set;
  the line schema of the streamed (NDJSON) 200s, ``ProgressLine``, is in its components;
* :func:`route_template` / :func:`openapi_templates`: the matched route's path template (a
  bounded metrics label), also for requests answered before routing (401, 413, 504).
"""

from __future__ import annotations

import json

from fastapi import FastAPI


def route_template(scope, templates=None) -> str:
    """The matched route's path template (bounded label values), else ``"unmatched"``.
    Requests answered before routing (401, 413, 504) are matched by ``templates(path)``."""
    route = scope.get("route")
    path = getattr(route, "path_format", None) or getattr(route, "path", None)
    if path is None and templates is not None:
        path = templates(scope.get("path", ""))
    return path or "unmatched"


def openapi_templates(app: FastAPI):
    """``path -> template`` over the OpenAPI paths (compiled on first use)."""
    compiled: list = []

    def match(path: str) -> str | None:
        if not compiled:
            from starlette.routing import compile_path

            for template in app.openapi().get("paths", {}):
                compiled.append((compile_path(template)[0], template))
        for rx, template in compiled:
            if rx.match(path):
                return template
        return None

    return match


def _component(comps: dict, model) -> None:
    """``model``'s JSON schema (and the schemas it refers to) under ``components/schemas``
    unless there already."""
    if model.__name__ in comps:
        return
    js = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in js.pop("$defs", {}).items():
        comps.setdefault(name, sub)
    comps[model.__name__] = js


def document_errors(app: FastAPI, keys: bool, timeout_s: float) -> None:
    """Make OpenAPI tell the truth about errors: every 4xx/5xx body is the envelope
    (``ErrorResponse``), not FastAPI's ``HTTPValidationError``; ``/v1/...`` documents 401 when
    keys are configured and 504 when a time limit is set."""
    from attnscope.schemas.common import ErrorResponse

    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        spec = build()
        comps = spec.setdefault("components", {}).setdefault("schemas", {})
        _component(comps, ErrorResponse)
        if '"#/components/schemas/ProgressLine"' in json.dumps(spec.get("paths", {})):
            from attnscope.schemas.interventions import ProgressLine

            _component(comps, ProgressLine)  # the NDJSON 200's line schema (streams=True)
        ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        extra = {}
        if keys:
            extra["401"] = "Unauthorized: API keys are configured and the request has none or "\
                "a wrong one ('Authorization: Bearer <key>')."
        if timeout_s > 0:
            extra["504"] = f"The request took longer than request_timeout_s ({timeout_s:g} s)."
        for path, ops in spec.get("paths", {}).items():
            for op in ops.values():
                responses = op.get("responses", {})
                for code, resp in responses.items():
                    if code[:1] in ("4", "5"):
                        schema = (resp.get("content") or {}).get("application/json", {}).get("schema")
                        if not schema or schema.get("$ref", "").endswith("/HTTPValidationError"):
                            resp["content"] = ref
                if path.startswith("/v1/"):
                    for code, desc in extra.items():
                        responses.setdefault(code, {"description": desc, "content": ref})
        app.openapi_schema = spec
        return spec

    app.openapi = openapi
