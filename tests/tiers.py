"""Test tiers, by what a test needs (pyproject.toml declares the markers):

* ``unit``    nothing: no model, no server, no browser, no cluster
* ``model``   the bundled checkpoint or MiniLM (a runtime, the in-process app)
* ``server``  a real uvicorn (a subprocess or a thread) on 127.0.0.1; ``e2e`` implies it
* ``browser`` Debian's Chromium through playwright (tests/web_browser.py)
* ``cluster`` Debian's haproxy (tests/test_scaleout*.py)

``slow`` is orthogonal: a model-tier test too slow for ``./scripts/test --fast``, which runs
``unit`` and ``model`` without ``slow`` (``-m "not (server or browser or cluster or slow)"``).

:func:`tier` marks every collected test without anyone thinking about it: by the fixtures it
uses (the whole closure: ``page`` brings ``browser``, ``client`` brings ``gpt2_runtime``), by its
file (``test_scaleout*``, ``test_web_*``) and by what its source and its module's helpers it
calls say (``start_server(``, ``uvicorn.Server(``, ``Runtime.load(`` ...). A test can always be
marked by hand as well; marks add up (a browser test against a live server is ``browser`` and
``server``). :func:`require` is the runtime net under the guess: ``conftest.start_server``
calls it, so a test that starts a server without being tiered ``server`` fails, saying so.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "model", "server", "browser", "cluster")

FIXTURES = {
    "model": {"gpt2_runtime", "bert_runtime", "client", "bert_client", "bundled_dir",
              "minilm_path", "gpt2_small_random_dir"},
    "server": {"live_server"},
    "browser": {"browser", "page"},
}
WORDS = {
    "model": ("Runtime.load(", "from_pretrained(", "BUNDLED_MODEL_DIR", "minilm_dir(",
              "create_app("),
    "server": ("start_server(", "uvicorn.Server(", "uvicorn_config(", "live_server"),
    "browser": ("sync_playwright", "CHROMIUM"),
    "cluster": ('"haproxy"', "loopback_cluster"),
}
FILES = {"cluster": ("test_scaleout",), "browser": ("test_web_",)}
_NAME = re.compile(r"\b([A-Za-z_]\w*)\b")
_module_needs: dict[str, dict[str, set[str]]] = {}


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _words(src: str) -> set[str]:
    return {t for t, ws in WORDS.items() if any(w in src for w in ws)}


def _helpers(module) -> dict[str, set[str]]:
    """What each module-level function or class of ``module`` needs, through the helpers it
    calls (a fixed point over the module's own names)."""
    key = getattr(module, "__file__", None) or repr(module)
    if key in _module_needs:
        return _module_needs[key]
    srcs = {n: _source(o) for n, o in vars(module).items()
            if (inspect.isfunction(o) or inspect.isclass(o)) and getattr(o, "__module__", None)
            == module.__name__}
    needs = {n: _words(s) for n, s in srcs.items()}
    refs = {n: set(_NAME.findall(s)) & set(srcs) - {n} for n, s in srcs.items()}
    changed = True
    while changed:
        changed = False
        for n in needs:
            new = set().union(needs[n], *(needs[r] for r in refs[n]))
            if new != needs[n]:
                needs[n], changed = new, True
    _module_needs[key] = needs
    return needs


def _needs_of(func) -> set[str]:
    src = _source(func)
    module = inspect.getmodule(func)
    needs = _words(src)
    if module is not None and Path(getattr(module, "__file__", "") or "/").resolve().is_relative_to(TESTS):
        helpers = _helpers(module)
        needs |= set().union(*(helpers[n] for n in set(_NAME.findall(src)) & set(helpers)
                               if n != func.__name__))
    return needs


def needs(item) -> set[str]:
    """The tiers ``item`` needs beyond ``unit`` (empty: a unit test)."""
    got = {m.name for m in item.iter_markers() if m.name in TIERS}
    if item.get_closest_marker("e2e"):
        got.add("server")
    fixtures = set(getattr(item, "fixturenames", ()))
    for t, names in FIXTURES.items():
        if fixtures & names:
            got.add(t)
    name = Path(str(item.fspath)).name
    for t, prefixes in FILES.items():
        if name.startswith(prefixes):
            got.add(t)
    func = getattr(item, "function", None)
    if func is not None:
        got |= _needs_of(func)
    infos = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}) or {}
    for defs in infos.values():
        for d in defs:
            f = getattr(d, "func", None)
            path = getattr(getattr(f, "__code__", None), "co_filename", "")
            if f is not None and path and Path(path).resolve().is_relative_to(TESTS):
                got |= _needs_of(f)
    got.discard("unit")
    return got


def tier(items) -> None:
    """Mark every item with the tiers it needs (``unit`` when none)."""
    for item in items:
        have = {m.name for m in item.iter_markers()}
        for t in sorted(needs(item)) or ["unit"]:
            if t not in have:
                item.add_marker(getattr(pytest.mark, t))


_current: list = []


def running(item) -> None:
    """conftest's ``pytest_runtest_setup``: the item whose setup or call is under way."""
    _current[:] = [item]


def require(t: str, what: str) -> None:
    """Fail the running test when it does ``what`` (which needs tier ``t``) untiered: the
    guess in :func:`needs` missed it, and ``--fast`` would run it."""
    if _current and _current[0].get_closest_marker(t) is None:
        pytest.fail(f"{_current[0].nodeid} {what} but is not tiered {t!r} (tests/tiers.py did "
                    f"not see it): mark it @pytest.mark.{t}", pytrace=False)
