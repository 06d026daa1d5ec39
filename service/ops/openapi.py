"""OpenAPI and route templates: the error envelope in the document, route labels for metrics.

* :func:`document_errors`: every 4xx/5xx body in ``/openapi.json`` is the envelope
  (``ErrorResponse``), and ``/v1/...`` documents 401 / 504 when keys / a time limit are set;
  the line schema of the streamed (NDJSON) 200s, ``ProgressLine``, is in its components;
* :func:`model_bounds`: the served document states the resident model's bounds (layer and
  head indices, token ids, sequence lengths) where the schemas mark an index field;
* :func:`route_template` / :func:`openapi_templates`: the matched route's path template (a
  bounded metrics label), also for requests answered before routing (401, 413, 504).
"""

from __future__ import annotations

import copy
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


def model_bounds(spec: dict, n_layers: int, n_heads: int, n_vocab: int, n_ctx: int,
                 max_batch: int | None = None, d_model: int | None = None,
                 d_mlp: int | None = None, causal: bool = False) -> dict:
    """A copy of ``spec`` bounded by a model: every schema marked with
    ``schemas.common.INDEX_MARK`` gets the model's limit (an integer: ``maximum`` count - 1; a
    list of distinct indices: its items' ``maximum`` and at most count items; a list of token
    ids: ids < ``n_vocab``, at most ``n_ctx`` ids); a bound already tighter is kept. The mark
    stays (what the field indexes); an index is also ``minimum`` 0; ``"neuron"`` (an MLP
    neuron, ``mlp.hook_post``'s last axis) is bounded by ``d_mlp`` where given. A count marked with
    ``schemas.common.AT_MOST_MARK`` "d_model" gets ``maximum`` ``d_model`` (where given).
    ``max_batch``: where given, the lists of prompts marked ``schemas.common.BATCH_MARK``
    (texts, token-id lists, reference prompts, /v1/run's prompts) hold at most that many.
    ``causal``: the values marked ``schemas.common.ENCODER_ONLY_MARK`` leave their enums."""
    from attnscope.schemas.common import AT_MOST_MARK, BATCH_MARK, ENCODER_ONLY_MARK, INDEX_MARK

    counts = {"layer": n_layers, "head": n_heads, "token": n_vocab}
    if d_mlp is not None:
        counts["neuron"] = d_mlp
    sizes = {"d_model": d_model} if d_model is not None else {}
    out = copy.deepcopy(spec)

    def tighten(node: dict, key: str, value: int) -> None:
        node[key] = min(node.get(key, value), value)

    def index(node: dict, n: int) -> None:  # an integer index: 0 <= i < n
        tighten(node, "maximum", n - 1)
        node["minimum"] = max(node.get("minimum", 0), 0)

    def walk(node) -> None:
        if isinstance(node, list):
            for x in node:
                walk(x)
            return
        if not isinstance(node, dict):
            return
        what = node.get(INDEX_MARK)
        if what in counts:
            n = counts[what]
            if node.get("type") == "integer":
                index(node, n)
            elif node.get("type") == "array":
                items = node.setdefault("items", {})
                if isinstance(items, dict) and items.get("type") == "integer":
                    index(items, n)
                if what == "token":
                    tighten(node, "maxItems", n_ctx)
                elif node.get("uniqueItems"):
                    tighten(node, "maxItems", n)
        if node.get(AT_MOST_MARK) in sizes and node.get("type") == "integer":
            tighten(node, "maximum", sizes[node[AT_MOST_MARK]])
        if causal and isinstance(node.get(ENCODER_ONLY_MARK), list) and "enum" in node:
            node["enum"] = [v for v in node["enum"] if v not in node[ENCODER_ONLY_MARK]]
        if max_batch is not None and node.get("type") == "array" and node.get(BATCH_MARK):
            tighten(node, "maxItems", max_batch)
        for v in node.values():
            walk(v)

    walk(out)
    return out


def _resident_bounds(app: FastAPI, spec: dict) -> dict:
    """``spec`` bounded by the resident model (:func:`model_bounds`), or ``spec`` itself while
    none is loaded."""
    rt = getattr(app.state, "runtime", None)
    if rt is None or spec is None:
        return spec
    settings = getattr(app.state, "settings", None)
    n_vocab = min(len(rt.tokenizer), int(rt.model.config.vocab_size))
    return model_bounds(spec, rt.adapter.n_layers, rt.adapter.n_heads, n_vocab,
                        rt.adapter.n_ctx, getattr(settings, "max_batch", None),
                        rt.adapter.d_model, _d_mlp(rt), bool(rt.adapter.causal))


def _d_mlp(rt) -> int | None:
    """The resident causal LM's MLP width (``blocks.0.mlp.hook_post``'s last axis, as
    /v1/ablate's neuron check reads it), or None (an encoder, no hooked forward)."""
    try:
        from ..runtime import hooked
        from ..runtime import interventions as I

        return int(hooked.resolve(I.lm_parts(rt), "blocks.0.mlp.hook_post")[0].sizes[-1])
    except Exception:  # noqa: BLE001 - no neuron bound rather than no document
        return None


def _served_bounds(app: FastAPI) -> None:
    """``app.openapi`` (the outermost wrapper) wrapped: once the model is resident, the
    document bounded by it (made once per runtime); before, the model-free document."""
    inner = app.openapi
    made: dict = {}

    def openapi() -> dict:
        spec = inner()
        rt = getattr(app.state, "runtime", None)
        if rt is None:
            return spec
        if made.get("runtime") is not rt:
            made.update(runtime=rt, spec=_resident_bounds(app, spec))
        return made["spec"]

    app.openapi = openapi


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
        # the model's bounds: now if it is resident, and on top of the outermost app.openapi
        # (later wrappers included) for a model loaded after this first build
        spec = _resident_bounds(app, spec)
        app.openapi_schema = spec
        _served_bounds(app)
        return spec

    app.openapi = openapi
