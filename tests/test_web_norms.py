"""The explorer's heat-map view switch (weight / norm / rollout) in headless Chromium against a
real uvicorn: the numbers under the cursor are /v1/attention-norms' and /v1/rollout's, the
colour scale names its unit and range, the URL keeps the view."""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

import numpy as np

from attnscope.client.wire import decode_tensor
from conftest import SENTENCE
from test_web_explorer import api, hover_cell, open_explorer, shown
from web_browser import browser, page, screenshot  # noqa: F401  (fixtures)


def _view_url(page, url, view, layer, head):
    page.goto(f"{url}/explorer?text={SENTENCE.replace(' ', '%20')}&layer={layer}&head={head}&view={view}")
    page.wait_for_function("document.body.dataset.state === 'ready'", timeout=60_000)


def test_norm_and_rollout_views_show_the_api_numbers(live_server, page):
    url = live_server.url
    base = {"text": SENTENCE, "layers": [1], "encoding": "base64", "dtype": "float32"}
    summed = decode_tensor(api(url, "/v1/attention-norms", base)["norms"]["summed"])[0]
    head2 = decode_tensor(api(url, "/v1/attention-norms", {**base, "heads": [2]})["norms"]["norms"])[0, 0]
    roll = decode_tensor(api(url, "/v1/rollout", base)["rollout"]["rollout"])[0]
    n = summed.shape[0]

    _view_url(page, url, "norm", 1, "mean")
    assert "norms" in page.inner_text("#heatmap .view-title")
    for q, k in [(0, 0), (5, 2), (n - 1, 3)]:
        value, _ = hover_cell(page, q, k)
        assert value == shown(summed[q, k]), (q, k)
    assert hover_cell(page, 2, 5)[0] == "masked"
    bar = page.locator("#cbar canvas.cbar")
    assert abs(float(bar.get_attribute("data-vmax")) - summed.max()) < 1e-5
    assert "contribution norm" in page.inner_text("#cbar")
    screenshot(page, "explorer-norm-view", "#panel-attention")

    page.select_option("#head", "2")
    page.wait_for_function("document.querySelector('#heatmap .view-title').textContent.includes('head 2')")
    value, _ = hover_cell(page, 6, 1)
    assert value == shown(head2[6, 1])

    page.select_option("#view", "rollout")
    page.wait_for_function("document.querySelector('#heatmap .view-title').textContent.includes('rollout')")
    assert parse_qs(urlparse(page.url).query)["view"] == ["rollout"]
    for q, k in [(0, 0), (7, 0), (n - 1, n - 2)]:
        value, _ = hover_cell(page, q, k)
        assert value == shown(roll[q, k]), (q, k)
    bar = page.locator("#cbar canvas.cbar")
    assert bar.get_attribute("data-vmax") == "1"
    np.testing.assert_allclose(roll.sum(-1), 1.0, atol=1e-5)

    page.select_option("#view", "weight")  # back to the weights, as before
    page.wait_for_function("!document.querySelector('#heatmap .view-title').textContent.includes('rollout')")
    assert "view" not in parse_qs(urlparse(page.url).query)
    assert page.locator("#cbar .cbar-ticks span").all_inner_texts() == ["0", "0.25", "0.5", "0.75", "1"]
