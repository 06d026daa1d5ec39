"""Headless Chromium for the browser tests (tests/test_web_*.py): PyPI's playwright driving
Debian's /usr/bin/chromium (never a downloaded browser), one browser per test module, a fresh
page per test whose console errors and uncaught exceptions fail the test.

Where /usr/bin/chromium is missing the tests skip with the reason, except when
``ATTNSCOPE_REQUIRE_BROWSER=1`` (set by ./scripts/test's full run, which installs Debian's chromium first): then
they fail, so CI never skips them silently. Screenshots go to tests/artifacts/ (gitignored).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("ATTNSCOPE_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"


def _require_browser():
    if not Path(CHROMIUM).exists():
        msg = (f"{CHROMIUM} is missing: apt-get install chromium (Debian's package; "
               "./scripts/test installs it)")
        if os.environ.get("ATTNSCOPE_REQUIRE_BROWSER") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        if os.environ.get("ATTNSCOPE_REQUIRE_BROWSER") == "1":
            pytest.fail("playwright is not installed (pip install -e '.[test]')")
        pytest.skip("playwright is not installed (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def browser():
    _require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                               args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield b
        b.close()


class PageErrors(list):
    """Console errors and uncaught exceptions of one page, as strings."""


@pytest.fixture
def page(browser):
    """A fresh 1280x900 page; console errors / page errors / failed requests fail the test."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    # waits are for events (a panel ready, a value shown); on a busy machine a full re-render
    # has taken longer than playwright's 30 s default, so the bound is generous
    ctx.set_default_timeout(120_000)
    p = ctx.new_page()
    errors = PageErrors()
    p.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}")
         if m.type == "error" else None)
    p.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    p.on("requestfailed", lambda r: errors.append(f"requestfailed: {r.url} {r.failure}"))
    p.errors = errors
    yield p
    ctx.close()
    assert not errors, errors


def screenshot(page, name: str, selector: str | None = None, full_page: bool = False) -> Path:
    """Save a PNG of the page (or of ``selector``) under tests/artifacts/ and check that it is
    not blank: a rendered view has many distinct colours, a blank one a handful."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    if selector:
        data = page.locator(selector).screenshot(path=str(path))
    else:
        data = page.screenshot(path=str(path), full_page=full_page)
    assert_not_blank(data)
    return path


def assert_not_blank(png: bytes, min_colours: int = 16) -> None:
    from PIL import Image
    import io

    im = Image.open(io.BytesIO(png)).convert("RGB")
    im.thumbnail((400, 400))
    colours = im.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) >= min_colours, \
        f"screenshot looks blank: {len(colours or [])} distinct colours"
