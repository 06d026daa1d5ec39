"""Notebook views (attnscope.client.notebook): every client response has ``_repr_html_``, a
self-contained page (no network: every request is refused and none is made) that draws the
explorer's views in headless Chromium with the response's own numbers."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

import numpy as np
import pytest

from attnscope.client import Client, notebook
from conftest import SENTENCE
from web_browser import browser, page, screenshot  # noqa: F401  (fixtures)


def shown(v) -> str:  # JavaScript's toFixed(3)
    return str(Decimal(float(v)).quantize(Decimal("0.001"), rounding=ROUND_HALF_UP))


@pytest.fixture(scope="module")
def api(client):
    return Client("http://testserver", http_client=client, max_retries=0)


def show(page, html: str):
    """Load the view's HTML alone, refusing (and recording) any network request."""
    asked = []

    def refuse(route):
        asked.append(route.request.url)
        route.abort()

    page.route("http://**", refuse)
    page.route("https://**", refuse)
    page.set_content(f"<!doctype html><html><body>{html}</body></html>")
    page.wait_for_selector(".attnscope-nb[data-ready='1']", timeout=30_000)
    assert asked == []
    return page


def hover(page, q, k):
    c = page.locator(".nb-heatmap canvas")
    g = c.evaluate("c => ({x0: +c.dataset.x0, y0: +c.dataset.y0, cell: +c.dataset.cell})")
    c.evaluate("(c, y) => window.scrollBy(0, c.getBoundingClientRect().top + y - innerHeight / 2)",
               g["y0"] + (q + 0.5) * g["cell"])
    b = c.bounding_box()
    page.mouse.move(b["x"] + g["x0"] + (k + 0.5) * g["cell"], b["y"] + g["y0"] + (q + 0.5) * g["cell"])
    page.wait_for_function(f"document.querySelector('.nb-heatmap .tip').dataset.q === '{q}' && "
                           f"document.querySelector('.nb-heatmap .tip').dataset.k === '{k}'")
    return page.locator(".nb-heatmap .tip").get_attribute("data-value")


def test_attention_view_in_a_notebook_page(api, page):  # noqa: F811
    res = api.attention(SENTENCE, encoding="base64", dtype="float16", layout="tril")
    html = res._repr_html_()
    assert 'class="attnscope-nb"' in html and 'class="attnscope-nb"' in notebook.to_html(res)
    assert "<script type=\"module\">" in html and "http" not in html.split("<script")[0]
    p = res.attention.pattern.numpy().astype(np.float32)
    show(page, html)
    title = page.inner_text(".nb-heatmap .view-title")
    assert "attnscope-tiny-gpt2" in title and "head mean" in title and "Then I tried" in title
    # the head mean is computed in the page from the float16 heads: display rounding only
    assert abs(float(hover(page, 7, 3)) - p[0, :, 7, 3].mean()) <= 0.5e-3 + 1e-6
    page.select_option(".nb-layer", "1")
    page.select_option(".nb-head", "2")
    page.wait_for_function("document.querySelector('.nb-heatmap .view-title').textContent.includes('layer 1, head 2')")
    assert hover(page, 9, 4) == shown(p[1, 2, 9, 4])
    assert hover(page, 3, 9) == "masked"
    assert page.locator(".nb-cbar canvas.cbar").get_attribute("data-vmax") == "1"
    assert page.locator(".nb-lines line").count() == int((p[1, 2] >= 0.01).sum())
    screenshot(page, "notebook-attention", ".attnscope-nb")


def test_heads_and_trajectories_views(api, page):  # noqa: F811
    heads = api.heads(SENTENCE)
    show(page, heads._repr_html_())
    cells = page.locator(".nb-grid button.headcell")
    assert cells.count() == len(heads.heads)
    h = heads.heads[5]
    page.locator(f".nb-grid button[data-layer='{h.layer}'][data-head='{h.head}']").click()
    picked = page.inner_text(".nb-picked")
    assert picked.startswith(f"layer {h.layer}, head {h.head}: {h.label}")
    assert f"sink {h.scores.sink:.3f}" in picked
    tr = api.trajectories(SENTENCE, include_final=True)
    show(page, tr._repr_html_())
    t = tr.trajectories
    assert page.locator(".nb-traj line.step").count() == len(t.positions) * (len(t.states) - 1)
    evr = t.explained_variance_ratio
    assert page.text_content(".nb-traj .xlabel") == f"PC 1 ({100 * evr[0]:.1f} % of variance)"
    screenshot(page, "notebook-trajectories", ".attnscope-nb")


def test_static_views_and_refusals(api):
    tok = api.tokenize(SENTENCE)
    html = tok._repr_html_()
    assert f"{tok.tokens.n_tokens} tokens" in html and "&#x27; I&#x27;" in html
    links = api.links(SENTENCE, layer=1)
    html = links._repr_html_()
    q = links.links.links[0]
    assert "layer 1, head mean" in html and f"({q.links[0].weight:.3f})" in html
    ver = api.verify(SENTENCE)
    html = ver._repr_html_()
    assert ("PASSED" if ver.verification.passed else "FAILED") in html
    with pytest.raises(TypeError):
        notebook.to_html(object())
