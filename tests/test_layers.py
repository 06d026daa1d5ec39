"""The layer rule of docs/architecture.md, checked on the source: every module's imports, walked with ast.

Generic import linters cannot see our modules: setuptools' ``package-dir`` remaps
``attnscope.service`` to ``service/``, ``attnscope.schemas`` to ``schemas/`` and
``attnscope.client`` to ``clients/python/attnscope/client/``, so this test reads that map from
``pyproject.toml``, names every ``.py`` file by its import name, and collects each file's
imports: top-level and function-level (a lazy import is still a dependency), ``if
TYPE_CHECKING`` ones, relative ones (resolved against the module's package) and
``importlib.import_module("...")`` / ``__import__("...")`` with a literal name.

The rules (data flows down, nothing reaches upward or sideways):

* analysis (``attnscope.service.analysis``) imports neither runtime, schemas, api, serving,
  encoding, the app nor HTTP or pydantic: torch/numpy in, plain results out;
* schemas import pydantic only (with the standard library and pydantic's own packages), so the
  client installs without torch;
* encoding does not import runtime (nor api, serving, the app);
* the client never imports the service (``attnscope serve`` starts it as a separate process);
* runtime owns torch and the model only: it imports neither api, serving (nor its core),
  encoding, analysis, schemas, pydantic nor HTTP libraries;
* the serving core (engine, slot, budget, admission, estimates, the route builder) imports no
  feature module; serving never imports api, and no service module imports the client;
* imports inside each of the three packages are relative (``from ..runtime import model``),
  so editors and import-following tools see the structure (:func:`absolute_inner_imports`).

The planted-fault tests below feed the checker a synthetic tree and a synthetic graph with
one upward import each and see it reported. The same map also checks that every package under
the mapped directories is listed in ``[tool.setuptools] packages`` (else wheels lack it).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]

SVC = "attnscope.service"
STDLIB = frozenset(sys.stdlib_module_names)
HTTP_LIBS = ("fastapi", "starlette", "httpx", "uvicorn", "anyio", "h11", "httptools")


@dataclass(frozen=True)
class Rule:
    """Modules under ``layer`` may not import anything under a ``forbidden`` prefix; with
    ``allowed`` set, every non-stdlib import must be under one of those prefixes."""

    name: str
    layer: tuple[str, ...]
    forbidden: tuple[str, ...] = ()
    allowed: tuple[str, ...] | None = None

    def applies(self, module: str) -> bool:
        return any(_under(module, p) for p in self.layer)

    def breaks(self, target: str) -> bool:
        if any(_under(target, p) for p in self.forbidden):
            return True
        if self.allowed is not None:
            top = target.split(".")[0]
            return top not in STDLIB and not any(_under(target, p) for p in self.allowed)
        return False


RULES: tuple[Rule, ...] = (
    Rule("analysis is pure (torch/numpy in, plain results out)", (f"{SVC}.analysis",),
         forbidden=(f"{SVC}.runtime", "attnscope.schemas", f"{SVC}.api", f"{SVC}.serving",
                    f"{SVC}.encoding", f"{SVC}.app", f"{SVC}.deps", f"{SVC}.ops",
                    "attnscope.client", "pydantic", *HTTP_LIBS)),
    Rule("schemas import pydantic only", ("attnscope.schemas",),
         allowed=("attnscope.schemas", "pydantic", "pydantic_core", "annotated_types",
                  "typing_extensions")),
    Rule("encoding does not import runtime", (f"{SVC}.encoding",),
         forbidden=(f"{SVC}.runtime", f"{SVC}.api", f"{SVC}.serving", f"{SVC}.app",
                    f"{SVC}.deps")),
    Rule("the client never imports the service", ("attnscope.client",),
         forbidden=(SVC,)),
    Rule("runtime owns torch and the model only", (f"{SVC}.runtime",),
         forbidden=(f"{SVC}.api", f"{SVC}.serving", f"{SVC}.app", f"{SVC}.deps",
                    f"{SVC}.encoding", f"{SVC}.analysis", f"{SVC}.ops", "attnscope.schemas",
                    "pydantic", *HTTP_LIBS)),
    Rule("the serving core imports no feature", (f"{SVC}.serving.core",),
         forbidden=(f"{SVC}.api", f"{SVC}.app", f"{SVC}.serving.attention",
                    f"{SVC}.serving.heads", f"{SVC}.serving.links",
                    f"{SVC}.serving.trajectories", f"{SVC}.serving.verify",
                    f"{SVC}.serving.scratch", f"{SVC}.serving.interventions",
                    f"{SVC}.serving.norms", f"{SVC}.serving.rollout",
                    f"{SVC}.serving.tokenize", f"{SVC}.serving.run")),
    Rule("serving never imports api", (f"{SVC}.serving",),
         forbidden=(f"{SVC}.api", f"{SVC}.app")),
    Rule("the service never imports the client", (SVC,),
         forbidden=("attnscope.client",)),
)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


# -- the walk --------------------------------------------------------------------------------

def package_dirs(pyproject: Path) -> dict[str, Path]:
    """``[tool.setuptools] package-dir`` of ``pyproject``: import prefix -> directory."""
    conf = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"]
    return {pkg: (pyproject.parent / d).resolve() for pkg, d in conf.items()}


def modules(dirs: dict[str, Path]) -> dict[str, Path]:
    """Every ``.py`` file under the mapped directories, by its import name."""
    out: dict[str, Path] = {}
    for pkg, d in dirs.items():
        for f in sorted(d.rglob("*.py")):
            rel = f.relative_to(d).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join((pkg, *rel))] = f
    return out


def imports_of(module: str, path: Path) -> list[tuple[str, int]]:
    """``(imported name, line)`` for every import in ``path`` (``module`` is its import name).
    ``from a.b import c`` yields ``a.b`` and ``a.b.c`` (c may be a submodule)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                base_parts = parts if is_pkg else parts[:-1]
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base == "__future__":
                continue
            out.append((base, node.lineno))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in ("import_module", "__import__"):
                out.append((node.args[0].value.split(":")[0], node.lineno))
    return out


def graph(dirs: dict[str, Path]) -> dict[str, list[tuple[str, int]]]:
    return {m: imports_of(m, p) for m, p in modules(dirs).items()}


def violations(g: dict[str, list[tuple[str, int]]], files: dict[str, Path] | None = None,
               rules: tuple[Rule, ...] = RULES) -> list[str]:
    """One line per import that breaks a rule: ``file:line module imports target (rule)``."""
    out = []
    for mod, targets in sorted(g.items()):
        where = mod
        if files and mod in files:
            f = files[mod]
            where = str(f.relative_to(ROOT)) if f.is_relative_to(ROOT) else str(f)
        for rule in rules:
            if not rule.applies(mod):
                continue
            seen = set()  # one line per import statement (``from a import b`` gives a, a.b)
            for target, line in targets:
                if line in seen or not rule.breaks(target):
                    continue
                seen.add(line)
                out.append(f"{where}:{line} {mod} imports {target} ({rule.name})")
    return out


def absolute_inner_imports(dirs: dict[str, Path]) -> list[str]:
    """One line per absolute import of a module's own top package (``from attnscope.service.x
    import y`` inside ``attnscope.service``): imports inside a package are relative
    (``from ..runtime import model``), so editors and import-following tools see the structure
    the package-dir remap otherwise hides. Imports between the three packages stay absolute."""
    out = []
    for mod, path in modules(dirs).items():
        top = next(p for p in dirs if _under(mod, p))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for n in names:
                if _under(n, top):
                    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                    out.append(f"{where}:{node.lineno} {mod} imports {n} absolutely "
                               f"(imports inside {top} are relative)")
    return out


def missing_packages(pyproject: Path) -> list[str]:
    """Packages ``[tool.setuptools] packages`` lists that no folder holds (pip refuses to
    install such a project: a moved or deleted package left in the list)."""
    conf = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]
    dirs = {pkg: pyproject.parent / d for pkg, d in conf["package-dir"].items()}
    out = []
    for pkg in conf.get("packages", []):
        top = next((p for p in dirs if _under(pkg, p)), None)
        rel = pkg[len(top):].lstrip(".").split(".") if top else []
        if top is None or not (dirs[top].joinpath(*[r for r in rel if r])).is_dir():
            out.append(pkg)
    return out


def unlisted_packages(pyproject: Path) -> list[str]:
    """Packages (folders with an ``__init__.py``) under the mapped directories that
    ``[tool.setuptools] packages`` does not list: a wheel or a non-editable install would ship
    without them (the editable install used here finds them anyway)."""
    listed = set(tomllib.loads(pyproject.read_text())["tool"]["setuptools"].get("packages", []))
    found = {m for m, f in modules(package_dirs(pyproject)).items() if f.name == "__init__.py"}
    return sorted(found - listed)


# -- the project -----------------------------------------------------------------------------

def test_the_walk_sees_every_layer():
    dirs = package_dirs(ROOT / "pyproject.toml")
    assert set(dirs) == {SVC, "attnscope.schemas", "attnscope.client"}
    files = modules(dirs)
    g = graph(dirs)
    for layer in (f"{SVC}.analysis.heads", f"{SVC}.runtime.model", f"{SVC}.encoding",
                  "attnscope.schemas.common", "attnscope.client._client", f"{SVC}.app"):
        assert any(_under(m, layer) for m in files), layer
    # the walk sees imports through the remap: the client imports the schemas, the app the runtime
    assert any(t.startswith("attnscope.schemas") for t, _ in g["attnscope.client._client"])
    assert any(t.startswith(f"{SVC}.runtime") for t, _ in g[f"{SVC}.app"])


def test_every_package_is_listed_for_setuptools(tmp_path):
    assert unlisted_packages(ROOT / "pyproject.toml") == []
    assert missing_packages(ROOT / "pyproject.toml") == []
    # planted: a new subpackage that pyproject.toml does not list
    (tmp_path / "service" / "ops").mkdir(parents=True)
    for d in ("service", "service/ops"):
        (tmp_path / d / "__init__.py").write_text("")
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "attnscope.service" = "service" }\n'
        'packages = ["attnscope.service"]\n')
    assert unlisted_packages(tmp_path / "pyproject.toml") == [f"{SVC}.ops"]
    # planted: a listed package whose folder is gone (service/api after the endpoint table)
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "attnscope.service" = "service" }\n'
        'packages = ["attnscope.service", "attnscope.service.ops", "attnscope.service.api"]\n')
    assert missing_packages(tmp_path / "pyproject.toml") == [f"{SVC}.api"]


def test_the_layer_rule_holds():
    dirs = package_dirs(ROOT / "pyproject.toml")
    bad = violations(graph(dirs), modules(dirs))
    assert not bad, "imports that break the layer rule (docs/architecture.md):\n" + "\n".join(bad)


def test_imports_inside_a_package_are_relative(tmp_path):
    dirs = package_dirs(ROOT / "pyproject.toml")
    bad = absolute_inner_imports(dirs)
    assert not bad, "\n".join(bad)
    # the walk resolves them: the serving core's engine imports the runtime, relatively
    assert any(_under(t, f"{SVC}.runtime") for t, _ in graph(dirs)[f"{SVC}.serving.core.engine"])
    # planted: one absolute import inside the service, one in the client
    planted = _tree(tmp_path, {**CLEAN,
                               "service/analysis/bad.py": "from attnscope.service.errors import X\n",
                               "clients/python/attnscope/client/bad.py":
                                   "import attnscope.client.cli\n"})
    bad = absolute_inner_imports(planted)
    assert len(bad) == 2 and all("absolutely" in b for b in bad), bad
    (tmp_path / "clean").mkdir()
    assert absolute_inner_imports(_tree(tmp_path / "clean", CLEAN)) == []


# -- planted faults: the checker must see them -----------------------------------------------

def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "attnscope.service" = "service", '
        '"attnscope.schemas" = "schemas", "attnscope.client" = "clients/python/attnscope/client" }\n')
    for rel, src in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(src)
    return package_dirs(tmp_path / "pyproject.toml")


CLEAN = {
    "service/__init__.py": "",
    "service/errors.py": "class InvalidRequest(Exception): ...\n",
    "service/analysis/__init__.py": "",
    "service/analysis/good.py": "import torch\nfrom ..errors import InvalidRequest\n"
                                "from . import _blas\n",
    "service/analysis/_blas.py": "import threading\n",
    "service/runtime/__init__.py": "",
    "service/runtime/model.py": "import torch\nfrom ..errors import InvalidRequest\n",
    "service/serving/__init__.py": "",
    "service/serving/heads.py": "from ..analysis import good\nfrom ..runtime import model\n"
                                "from .core import engine\n",
    "service/serving/core/__init__.py": "",
    "service/serving/core/engine.py": "import fastapi\nfrom ...runtime import model\n",
    "service/encoding.py": "import numpy as np\nfrom .errors import InvalidRequest\n",
    "schemas/__init__.py": "from .common import X\n",
    "schemas/common.py": "from typing import Literal\nfrom pydantic import BaseModel\nX = 1\n",
    "clients/python/attnscope/client/__init__.py": "from attnscope.schemas import X\n",
    "clients/python/attnscope/client/cli.py": "import subprocess\n",
}


def test_a_clean_synthetic_tree_passes(tmp_path):
    dirs = _tree(tmp_path, CLEAN)
    assert len(modules(dirs)) == len(CLEAN)
    assert violations(graph(dirs), modules(dirs)) == []


@pytest.mark.parametrize("rel, src, rule", [
    # relative, two levels up, inside a function: analysis -> runtime
    ("service/analysis/bad.py", "def f():\n    from ..runtime import model\n",
     "analysis is pure"),
    ("service/analysis/bad.py", "from attnscope.schemas.common import X\n", "analysis is pure"),
    ("service/analysis/bad.py", "from attnscope.service import encoding\n", "analysis is pure"),
    ("service/analysis/bad.py", "import fastapi\n", "analysis is pure"),
    ("service/analysis/bad.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from attnscope.service.runtime.model import Runtime\n", "analysis is pure"),
    ("schemas/bad.py", "import numpy as np\n", "schemas import pydantic only"),
    ("schemas/bad.py", "from attnscope.service.errors import InvalidRequest\n",
     "schemas import pydantic only"),
    ("service/encoding.py", "def f():\n    from .runtime.memory import x\n",
     "encoding does not import runtime"),
    ("clients/python/attnscope/client/cli.py", "def serve():\n"
     "    from attnscope.service import cli\n", "the client never imports the service"),
    ("clients/python/attnscope/client/cli.py", "import importlib\n"
     "importlib.import_module('attnscope.service.cli')\n", "the client never imports the service"),
    ("service/runtime/model.py", "from attnscope.service.api import heads\n",
     "runtime owns torch and the model only"),
    # relative, upward: runtime -> serving, runtime -> the serving core
    ("service/runtime/model.py", "from ..serving import heads\n",
     "runtime owns torch and the model only"),
    ("service/runtime/model.py", "def f():\n    from ..serving.core.engine import Plan\n",
     "runtime owns torch and the model only"),
    ("service/runtime/model.py", "from fastapi import Response\n",
     "runtime owns torch and the model only"),
    ("service/runtime/model.py", "from .. import encoding\n",
     "runtime owns torch and the model only"),
    ("service/runtime/model.py", "from ..analysis.good import x\n",
     "runtime owns torch and the model only"),
    ("service/serving/heads.py", "from ..api.common import check_index\n",
     "serving never imports api"),
    ("service/serving/core/engine.py", "from .. import heads\n",
     "the serving core imports no feature"),
    ("service/encoding.py", "from attnscope.client import wire\n",
     "the service never imports the client"),
])
def test_a_planted_upward_import_fails(tmp_path, rel, src, rule):
    dirs = _tree(tmp_path, {**CLEAN, rel: src})
    bad = violations(graph(dirs), modules(dirs))
    assert bad, f"{rel}: {src!r} was not reported"
    assert all(rule in b for b in bad), bad
    assert all(b.startswith(str(tmp_path / rel)) for b in bad), bad


def test_a_synthetic_graph():
    g = {f"{SVC}.analysis.x": [("torch", 1), (f"{SVC}.runtime.adapters", 3)],
         f"{SVC}.analysis.y": [("numpy", 1), (f"{SVC}.errors", 2)],
         "attnscope.client.cli": [("attnscope.schemas", 1)]}
    assert violations(g) == [f"{SVC}.analysis.x:3 {SVC}.analysis.x imports "
                             f"{SVC}.runtime.adapters (analysis is pure (torch/numpy in, "
                             "plain results out))"]
