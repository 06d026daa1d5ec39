"""The endpoint table: one :class:`Endpoint` per feature route (docs/architecture.md, "How to
add an endpoint").

A feature module in ``service/serving/`` declares ``ENDPOINTS = [Endpoint(...), ...]``: its
path, request and response schemas, its token-independent ``check``, whether its texts are
tokenized, and its ``plan`` (model-aware checks, the memory estimate and the job; see
:class:`~.engine.Plan`). :func:`default_table` collects every feature module's endpoints, in
their ``order``; the route builder (:func:`.routes.add_routes`) makes one FastAPI route per
entry (OpenAPI follows from the schemas and the texts given here), and the JS client's methods
and the TypeScript client interface are rendered from the same table (:func:`js_endpoints`,
:func:`typescript_client`). Adding an endpoint touches its schema, its feature module, its
analysis, its tests and its docs: nothing else.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Endpoint:
    """One route of the API.

    ``path``: e.g. ``"/v1/attention"``; ``name``: the client method (``attention``);
    ``request``/``response``: the pydantic schemas (``request`` None for a GET).
    ``plan(runtime, req, items) -> Plan`` (with ``binary=`` when ``binary``): the feature's
    model-aware checks, estimate and job. ``check(runtime, req)``: token-independent checks,
    run once, before tokenizing. ``prepare(runtime, req) -> req``: request defaults that depend
    on the model (e.g. ``add_bos`` null -> the model's convention), before ``check``.
    ``tokenize``: the request's ``text``/``texts`` are tokenized into ``items``.
    ``binary``: the response negotiates ``Accept: application/x-safetensors`` (406 otherwise).
    ``needs_model``: False when the plan may run before the model loaded (gets None).
    ``handler(engine, req) -> response``: an endpoint that is not a device job (GET
    /v1/model, /v1/tokenize); replaces the engine call. ``summary``, ``description`` (the
    OpenAPI text: formula, units, source, errors), ``invalid`` (its 422 cases), ``tags``.
    ``device``: the route waits for the device (documents 429). ``order``: position in the
    table (OpenAPI and clients list endpoints in this order). ``streams``: its plans report
    progress, so ``Accept: application/x-ndjson`` gets the NDJSON 200 (progress lines, then
    the body; documented in OpenAPI with the line schema ``ProgressLine``).
    """

    path: str
    name: str
    request: type | None
    response: type
    summary: str
    description: str
    plan: Callable[..., Any] | None = None
    check: Callable[..., None] | None = None
    prepare: Callable[..., Any] | None = None
    tokenize: bool = True
    binary: bool = False
    needs_model: bool = True
    handler: Callable[..., Any] | None = None
    invalid: str = "Invalid request (field, limit and value named)."
    tags: tuple[str, ...] = ()
    device: bool = True
    order: int = 100
    streams: bool = False

    @property
    def method(self) -> str:
        return "GET" if self.request is None else "POST"

    @property
    def body_optional(self) -> bool:
        """A POST whose request schema validates from ``{}`` (every field defaulted, no
        cross-field rule): its body may be empty or missing."""
        if self.request is None:
            return False
        try:
            self.request.model_validate({})
        except Exception:  # noqa: BLE001 - a required field or a cross-field rule: body needed
            return False
        return True


def default_table() -> list[Endpoint]:
    """Every ``ENDPOINTS`` entry of the modules of ``service/serving/`` (not its core), in
    ``order`` then path. Raises ``ValueError`` on two endpoints with one path or name."""
    from .. import __name__ as serving_pkg, __path__ as serving_path

    found: list[Endpoint] = []
    for info in pkgutil.iter_modules(serving_path):
        if info.name == "core" or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{serving_pkg}.{info.name}")
        found += list(getattr(module, "ENDPOINTS", ()))
    return check_table(found)


def check_table(endpoints: list[Endpoint]) -> list[Endpoint]:
    """``endpoints`` sorted by (``order``, path); ``ValueError`` when a path or a client
    method name is used twice."""
    for attr in ("path", "name"):
        seen: set[str] = set()
        for ep in endpoints:
            value = getattr(ep, attr)
            if value in seen:
                raise ValueError(f"two endpoints with {attr} {value!r} in the endpoint table")
            seen.add(value)
    return sorted(endpoints, key=lambda e: (e.order, e.path))


# ------------------------------------------------------------- clients made from the table
JS_BEGIN = "// ---- endpoints: generated from the endpoint table (scripts/gen-clients); do not edit\n"
JS_END = "// ---- end of the generated endpoints\n"


def js_endpoints(endpoints: list[Endpoint]) -> str:
    """The generated block of ``service/web/attnscope.js``: ``ENDPOINTS``, one entry per
    route (client method name, HTTP method, path, whether it negotiates safetensors), from
    which ``Client`` gets one method per endpoint."""
    rows = [{"name": e.name, "method": e.method, "path": e.path, "binary": e.binary}
            for e in endpoints]
    body = ",\n".join("  " + json.dumps(r, separators=(", ", ": ")) for r in rows)
    return f"{JS_BEGIN}export const ENDPOINTS = [\n{body},\n];\n{JS_END}"


def with_js_endpoints(source: str, endpoints: list[Endpoint]) -> str:
    """``source`` (attnscope.js) with its generated block replaced by ``endpoints``'. Raises
    ``ValueError`` when the markers are missing."""
    try:
        start = source.index(JS_BEGIN)
        end = source.index(JS_END, start) + len(JS_END)
    except ValueError:
        raise ValueError("attnscope.js has no generated endpoints block") from None
    return source[:start] + js_endpoints(endpoints) + source[end:]


def typescript_client(endpoints: list[Endpoint]) -> str:
    """``clients/typescript/client.d.ts``: the JS client's methods typed with the request and
    response schemas of ``attnscope.d.ts`` (openapi-typescript's ``components``)."""
    lines = [
        "/**",
        " * The attnscope JS client (service/web/attnscope.js), typed: one method per endpoint.",
        " * Generated from the endpoint table by scripts/gen-clients; do not edit.",
        " */",
        'import type { components } from "./attnscope.d.ts";',
        "",
        "type S = components[\"schemas\"];",
        "export interface CallOptions { binary?: boolean; signal?: AbortSignal }",
        "",
        "export interface AttnscopeClient {",
    ]
    for e in endpoints:
        out = f'S["{e.response.__name__}"]'
        doc = f"  /** {e.method} {e.path}: {e.summary} */"
        if e.request is None:
            lines += [doc, f"  {e.name}(): Promise<{out}>;"]
        else:
            opts = ", opts?: CallOptions" if e.binary else ""
            q = "?" if e.body_optional else ""
            lines += [doc, f'  {e.name}(body{q}: S["{e.request.__name__}"]{opts}): Promise<{out}>;']
    lines += ["}", ""]
    return "\n".join(lines)
