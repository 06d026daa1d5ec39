"""One list of error types: ``attnscope.schemas.errors.ERROR_TYPES`` (type -> status).

The service's error classes and every envelope its handlers and middlewares write (found in the
source with ast) use only types of that table, with its status; the client's exception per
type is built from it; the README's error table lists the same types. A planted new type in a
synthetic service tree is reported.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import attnscope.client as ac
from attnscope.client import _errors as client_errors
from attnscope.schemas.errors import ERROR_TYPES
from attnscope.service import errors as service_errors
from conftest import ROOT

FRAMEWORK_FALLBACK = "http_error"  # another framework HTTPException: its own status


def sent_types(service_dir: Path) -> dict[str, list[str]]:
    """Error types the service source writes: ``envelope("t", ...)``, ``send_envelope(send,
    status, "t", ...)``, class attributes ``type = "t"`` of exception classes, and the values of
    status -> type dict literals (``{404: "not_found", ...}``). type -> ["file:line", ...]."""
    found: dict[str, list[str]] = {}

    def add(t, f, node):
        found.setdefault(t, []).append(f"{f.relative_to(service_dir)}:{node.lineno}")

    for f in sorted(service_dir.rglob("*.py")):
        tree = ast.parse(f.read_text(), str(f))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                pos = {"envelope": 0, "send_envelope": 2}.get(name)
                if pos is not None and len(node.args) > pos:
                    arg = node.args[pos]
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        add(arg.value, f, node)
                    elif isinstance(arg, ast.Call) and len(arg.args) == 2 \
                            and isinstance(arg.args[1], ast.Constant):  # types.get(s, "x")
                        add(arg.args[1].value, f, node)
            elif isinstance(node, ast.ClassDef):
                for st in node.body:
                    if isinstance(st, ast.Assign) and len(st.targets) == 1 \
                            and getattr(st.targets[0], "id", None) == "type" \
                            and isinstance(st.value, ast.Constant):
                        add(st.value.value, f, st)
            elif isinstance(node, ast.Dict) and node.keys and all(
                    isinstance(k, ast.Constant) and isinstance(k.value, int)
                    and 400 <= k.value < 600 for k in node.keys) and all(
                    isinstance(v, ast.Constant) and isinstance(v.value, str) for v in node.values):
                for v in node.values:
                    add(v.value, f, node)
    return found


def unknown_types(service_dir: Path) -> dict[str, list[str]]:
    return {t: w for t, w in sent_types(service_dir).items()
            if t not in ERROR_TYPES and t != FRAMEWORK_FALLBACK}


def test_the_service_sends_only_listed_types():
    found = sent_types(ROOT / "service")
    assert {"validation_error", "not_found", "unauthorized", "internal_error"} <= set(found)
    assert unknown_types(ROOT / "service") == {}, \
        "error types missing from schemas/errors.py ERROR_TYPES"


def test_every_service_error_class_has_the_listed_status():
    classes = [c for _, c in inspect.getmembers(service_errors, inspect.isclass)
               if issubclass(c, service_errors.AttnscopeError)]
    assert len(classes) >= 10
    for c in classes:
        assert c.type in ERROR_TYPES, c
        assert c.status == ERROR_TYPES[c.type], (c, c.status, ERROR_TYPES[c.type])


def test_the_client_has_a_class_for_every_listed_type():
    assert set(ac.ERROR_TYPES) == set(ERROR_TYPES)
    assert set(client_errors._TYPE_CLASSES) <= set(ERROR_TYPES)  # no stale types
    for t, status in ERROR_TYPES.items():
        cls = ac.ERROR_TYPES[t]
        family = ac.STATUS_ERRORS.get(status) or (
            ac.InternalServerError if status >= 500 else ac.APIStatusError)
        assert issubclass(cls, family), (t, cls, family)


def test_the_readme_error_table_lists_the_same_types():
    text = (ROOT / "README.md").read_text()
    section = text.split("### Errors", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d{3}) \| `([a-z_]+)` \|", section, re.M)
    assert {t: int(s) for s, t in rows} == ERROR_TYPES


def test_a_planted_new_type_is_reported(tmp_path):
    (tmp_path / "a.py").write_text(
        "class Teapot(Exception):\n    type = 'teapot'\n    status = 418\n"
        "def f(send):\n    return envelope('brand_new', 'm')\n"
        "async def g(send):\n    await send_envelope(send, 599, 'another_one', 'm')\n"
        "TYPES = {404: 'not_found', 410: 'gone'}\n"
        "def h(exc):\n    return envelope(TYPES.get(exc.status, 'fallback_type'), 'm')\n")
    assert set(unknown_types(tmp_path)) == {"teapot", "brand_new", "another_one", "gone",
                                            "fallback_type"}
    (tmp_path / "a.py").write_text("def f():\n    return envelope('validation_error', 'm')\n")
    assert unknown_types(tmp_path) == {}


@pytest.mark.parametrize("etype", sorted(ERROR_TYPES))
def test_an_envelope_of_each_type_raises_its_class(etype):
    import httpx

    status = ERROR_TYPES[etype]
    req = httpx.Request("POST", "http://x/v1/attention")
    r = httpx.Response(status, json={"error": {"type": etype, "message": "m", "param": "p"}},
                       request=req)
    e = client_errors.status_error(r)
    assert type(e) is ac.ERROR_TYPES[etype] and e.type == etype and e.status_code == status
