"""The notebook view of /v1/patch hook grids and declared metrics (service/web/views.js
``patchView``, through ``PatchResponse._repr_html_``) in headless Chromium: a two-axis grid
is one table of ``[layer, pos]`` cells, a three-axis grid one layer at a time with a layer
selector, a declared metric is named without ``logit_diff``; equal clean and corrupted
metrics draw no grid."""

from __future__ import annotations

import pytest

from web_browser import browser, page, screenshot  # noqa: F401  (fixtures)

CLEAN = "the cat sat on the mat and the cat sat"
CORRUPTED = "the dog sat on the mat and the cat sat"


def nb_show(page, html):
    asked = []
    page.route("http://**", lambda r: (asked.append(r.request.url), r.abort()))
    page.set_content(f"<!doctype html><html><body>{html}</body></html>")
    page.wait_for_selector(".attnscope-nb[data-ready='1']")
    assert asked == []


def test_hook_grids_in_the_notebook_view(live_server, page):
    from attnscope.client import Client

    with Client(live_server.url) as c:
        m = {"kind": "prob", "terms": [{"position": -2, "target": " sat"}]}
        two = c.patch(CLEAN, CORRUPTED, metric=m, hook="resid_pre")
        three = c.patch(CLEAN, CORRUPTED, metric="loss", hook="v", by_position=True)
        equal = c.patch(CLEAN, CLEAN, metric=m, hook="mlp_out")
    T = len(two.clean_tokens)
    page.set_viewport_size({"width": 1400, "height": 900})
    nb_show(page, two._repr_html_())
    assert "declared metric prob" in page.inner_text(".attnscope-nb")
    assert page.locator(".patch-grid td.effcell").count() == 2 * T
    assert "get_act_patch_resid_pre" in page.inner_text(".attnscope-nb")
    screenshot(page, "notebook-patch-hook", ".attnscope-nb")
    nb_show(page, three._repr_html_())
    assert page.locator(".patch-grid td.effcell").count() == T * 4  # one layer: pos x head
    page.select_option(".patch-layer", "1")
    assert "layer 1" in page.inner_text(".patch-grid")
    nb_show(page, equal._repr_html_())
    assert "divides by zero" in page.inner_text(".patch-equal")
    assert page.locator("table.effectgrid").count() == 0
