"""The explorer (/ and /explorer) in headless Chromium against a real uvicorn serving the bundled
model: every number the page shows is the API's (hover a heat-map cell, head grid scores, links,
trajectories' explained variance, verification), masked cells look different from zeros, the
colour scale is 0..1 and labelled, the URL holds the state, no console errors; screenshots of
each view land in tests/artifacts/ and are checked not blank."""

from __future__ import annotations

import json
import os
import shutil
from decimal import ROUND_HALF_UP, Decimal
from urllib.parse import parse_qs, quote, urlparse

import httpx
import numpy as np
import pytest

from attnscope.client.wire import decode_tensor
from conftest import ROOT, SENTENCE
from web_browser import ARTIFACTS, browser, page, screenshot  # noqa: F401  (fixtures)

DIGITS = 3  # views.js DIGITS


def shown(v: float) -> str:
    """JavaScript's Number.prototype.toFixed(3) of a float (exact value, ties away from 0)."""
    return str(Decimal(float(v)).quantize(Decimal(1).scaleb(-DIGITS), rounding=ROUND_HALF_UP))


def api(url, path, body):
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def open_explorer(page, url, text=SENTENCE, layer=0, head="mean", path="/explorer", extra=""):
    page.goto(f"{url}{path}?text={quote(text)}&layer={layer}&head={head}{extra}")
    page.wait_for_function("document.body.dataset.state === 'ready'", timeout=60_000)


def hover_cell(page, q, k):
    c = page.locator("#heatmap canvas.heatmap")
    geo = c.evaluate("c => ({x0: +c.dataset.x0, y0: +c.dataset.y0, cell: +c.dataset.cell, n: +c.dataset.n})")
    # bring the cell to the middle of the viewport (mouse events need it on screen)
    c.evaluate("(c, y) => window.scrollBy(0, c.getBoundingClientRect().top + y - innerHeight / 2)",
               geo["y0"] + (q + 0.5) * geo["cell"])
    box = c.bounding_box()
    page.mouse.move(box["x"] + geo["x0"] + (k + 0.5) * geo["cell"],
                    box["y"] + geo["y0"] + (q + 0.5) * geo["cell"])
    tip = page.locator("#heatmap .tip")
    page.wait_for_function(
        f"(() => {{ const t = document.querySelector('#heatmap .tip'); "
        f"return t && t.dataset.q === '{q}' && t.dataset.k === '{k}'; }})()")
    return tip.get_attribute("data-value"), tip.inner_text()


def canvas_pixel(page, q, k):
    """RGB at the centre of cell (q, k), read from the canvas's own pixels."""
    return page.locator("#heatmap canvas.heatmap").evaluate(
        """(c, [q, k]) => { const d = window.devicePixelRatio || 1;
            const x = (+c.dataset.x0 + (k + 0.5) * +c.dataset.cell) * d;
            const y = (+c.dataset.y0 + (q + 0.5) * +c.dataset.cell) * d;
            return Array.from(c.getContext('2d').getImageData(x, y, 1, 1).data.slice(0, 3)); }""",
        [q, k])


@pytest.fixture(scope="module")
def patterns(live_server):
    """The API's own numbers for SENTENCE: float32 JSON and the float16/tril the page asks for."""
    full = api(live_server.url, "/v1/attention", {"text": SENTENCE})
    f16 = api(live_server.url, "/v1/attention", {"text": SENTENCE, "encoding": "base64",
                                                   "dtype": "float16", "layout": "tril"})
    mean16 = api(live_server.url, "/v1/attention", {"text": SENTENCE, "encoding": "base64",
                                                      "dtype": "float16", "layout": "tril",
                                                      "head_mean": True})
    mean32 = api(live_server.url, "/v1/attention", {"text": SENTENCE, "head_mean": True})
    return {
        "tokens": full["attention"]["tokens"],
        "f32": decode_tensor(full["attention"]["pattern"]),
        "f16": decode_tensor(f16["attention"]["pattern"]).astype(np.float32),
        "mean16": decode_tensor(mean16["attention"]["pattern"]).astype(np.float32),
        "mean32": decode_tensor(mean32["attention"]["pattern"]),
    }


def test_heatmap_hover_equals_the_api_and_masked_cells_are_not_zeros(live_server, page, patterns):
    requests = []
    page.on("request", lambda r: requests.append(r) if r.url.endswith("/v1/attention") else None)
    open_explorer(page, live_server.url, layer=1, head=0)
    n = len(patterns["tokens"])
    assert page.locator("#heatmap canvas").get_attribute("data-n") == str(n)
    title = page.inner_text("#heatmap .view-title")
    assert "attnscope-tiny-gpt2" in title and "layer 1, head 0" in title and "Then I tried" in title
    for q, k in [(0, 0), (5, 2), (n - 1, 3), (n - 1, n - 1), (12, 7)]:
        value, text = hover_cell(page, q, k)
        assert value == shown(patterns["f16"][1, 0, q, k]), (q, k, text)
        # and within float16 + display rounding of the float32 JSON number
        assert abs(float(value) - patterns["f32"][1, 0, q, k]) <= 0.5e-3 + 2 ** -11
        assert text.startswith(f"query {q} {json.dumps(patterns['tokens'][q]['label'])} \u2192 "
                               f"key {k} {json.dumps(patterns['tokens'][k]['label'])}: "), text
    value, text = hover_cell(page, 2, 5)
    assert value == "masked" and "masked" in text and patterns["f32"][1, 0, 2, 5] == 0.0
    # masked cells are grey, a weight of (almost) 0 is near-white: distinct colours
    masked_rgb = canvas_pixel(page, 2, 5)
    q0, k0 = np.unravel_index(np.argmin(np.where(np.tril(np.ones((n, n))) > 0,
                                                 patterns["f32"][1, 0], 9)), (n, n))
    low_rgb = canvas_pixel(page, int(q0), int(k0))
    assert patterns["f32"][1, 0, q0, k0] < 0.02
    assert max(low_rgb) > 235 and min(low_rgb) > 225, low_rgb  # near-white (#f7fbff end)
    assert max(masked_rgb) < 200 and max(masked_rgb) - min(masked_rgb) < 10, masked_rgb  # grey
    # the colour bar: fixed 0..1, labelled
    bar = page.locator("#cbar canvas.cbar")
    assert (bar.get_attribute("data-vmin"), bar.get_attribute("data-vmax")) == ("0", "1")
    assert page.locator("#cbar .cbar-ticks span").all_inner_texts() == ["0", "0.25", "0.5", "0.75", "1"]
    assert "attention weight" in page.inner_text("#cbar") and "masked" in page.inner_text("#cbar")
    # the page asked for float16, lower triangle, base64: compact on the wire
    bodies = [json.loads(r.post_data) for r in requests]
    assert bodies and all(b["encoding"] == "base64" and b["dtype"] == "float16"
                          and b["layout"] == "tril" for b in bodies), bodies
    # keyboard: focus the map, arrow keys move the cell
    page.locator("#heatmap canvas").focus()
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowRight")
    tip = page.locator("#heatmap .tip")
    assert (tip.get_attribute("data-q"), tip.get_attribute("data-k")) != (None, None)
    q, k = int(tip.get_attribute("data-q")), int(tip.get_attribute("data-k"))
    want = "masked" if k > q else shown(patterns["f16"][1, 0, q, k])
    assert tip.get_attribute("data-value") == want
    screenshot(page, "explorer-heatmap", "#panel-attention")


def test_head_mean_and_pickers_update_url(live_server, page, patterns):
    open_explorer(page, live_server.url, path="/", layer=0, head="mean")
    value, _ = hover_cell(page, 6, 3)
    assert value == shown(patterns["mean16"][0, 6, 3])
    assert abs(float(value) - patterns["mean32"][0, 6, 3]) <= 0.5e-3 + 2 ** -11
    page.select_option("#layer", "1")
    page.select_option("#head", "2")
    page.wait_for_function("document.querySelector('#panel-attention').dataset.ready === '1' && "
                           "document.querySelector('#heatmap .view-title').textContent.includes('head 2')")
    qs = parse_qs(urlparse(page.url).query)
    assert qs["layer"] == ["1"] and qs["head"] == ["2"] and qs["text"] == [SENTENCE]
    value, _ = hover_cell(page, 9, 4)
    assert value == shown(patterns["f16"][1, 2, 9, 4])
    # the URL restores the view
    page.goto(page.url)
    page.wait_for_function("document.body.dataset.state === 'ready'", timeout=60_000)
    assert page.input_value("#text") == SENTENCE
    assert page.input_value("#layer") == "1" and page.input_value("#head") == "2"
    assert hover_cell(page, 9, 4)[0] == value


def test_a_late_reply_for_an_earlier_pick_is_not_shown(live_server, page, patterns):
    """Pick layer 1 (head mean), then head 2 before layer 1's head-mean pattern arrives: that
    late reply (held back here until head 2 is on screen) must not replace head 2's heat map
    (the race behind a CI timeout: the mean's title and numbers overwrote the later pick)."""
    open_explorer(page, live_server.url, path="/", layer=0, head="mean")
    held = []

    def hold_layer1_mean(route):
        body = json.loads(route.request.post_data or "{}")
        if body.get("head_mean") and body.get("layers") == [1] and not held:
            held.append(route)  # answered below, after head 2 is shown
        else:
            route.continue_()

    page.route("**/v1/attention", hold_layer1_mean)
    page.select_option("#layer", "1")
    for _ in range(1200):  # the route handler runs while playwright waits
        if held:
            break
        page.wait_for_timeout(50)
    assert len(held) == 1
    page.select_option("#head", "2")
    page.wait_for_function("document.querySelector('#panel-attention').dataset.ready === '1' && "
                           "document.querySelector('#heatmap .view-title').textContent.includes('head 2')")
    late = held[0].fetch()
    with page.expect_response("**/v1/attention"):
        held[0].fulfill(response=late)
    page.evaluate("() => new Promise((r) => setTimeout(r, 200))")  # its handlers have run
    assert "head 2" in page.inner_text("#heatmap .view-title")
    assert hover_cell(page, 9, 4)[0] == shown(patterns["f16"][1, 2, 9, 4])


def test_head_grid_scores_and_click_opens_the_head(live_server, page, patterns):
    # the page sends one add_bos for every panel (its checkbox: the model's convention, BOS
    # first for GPT-2, as every endpoint's default)
    heads = api(live_server.url, "/v1/heads", {"text": SENTENCE})
    open_explorer(page, live_server.url)
    cells = page.locator("#headgrid button.headcell")
    assert cells.count() == len(heads["heads"]) == 8
    for h in heads["heads"]:
        b = page.locator(f"#headgrid button[data-layer='{h['layer']}'][data-head='{h['head']}']")
        assert b.get_attribute("data-label") == h["label"]
        title = b.get_attribute("title")
        for name, v in h["scores"].items():
            assert f"{name}: {'n/a' if v is None else f'{v:.3f}'}" in title, (name, title)
        first = title.split("\n")[0]  # every label the head earns, the primary one first
        others = [x for x in h["labels"] if x != h["label"]]
        assert first == f"layer {h['layer']}, head {h['head']}: {h['label']}" + (
            f" (also {', '.join(others)})" if others else ""), (first, h["labels"])
    # same label, same colour
    colours = {}
    for b in cells.all():
        colours.setdefault(b.get_attribute("data-label"), set()).add(
            b.evaluate("e => getComputedStyle(e).backgroundColor"))
    assert all(len(v) == 1 for v in colours.values())
    assert len({next(iter(v)) for v in colours.values()}) == len(colours)
    screenshot(page, "explorer-heads", "#panel-heads")
    page.locator("#headgrid button[data-layer='0'][data-head='3']").click()
    page.wait_for_function("document.querySelector('#heatmap .view-title').textContent.includes('layer 0, head 3')")
    assert page.input_value("#layer") == "0" and page.input_value("#head") == "3"
    assert parse_qs(urlparse(page.url).query)["head"] == ["3"]
    assert hover_cell(page, 10, 10)[0] == shown(patterns["f16"][0, 3, 10, 10])
    assert page.locator("#headgrid button.selected").get_attribute("data-head") == "3"


def test_line_view_links_trajectories_verification(live_server, page, patterns):
    open_explorer(page, live_server.url, layer=1, head=0)
    n = len(patterns["tokens"])
    # line view: one line per weight >= 0.01 of the checked head, opacity = weight
    lines = page.locator("#lineview line")
    want = int((patterns["f16"][1, 0] >= 0.01).sum())
    assert lines.count() == want
    first = lines.first
    q, k = int(first.get_attribute("data-q")), int(first.get_attribute("data-k"))
    assert abs(float(first.get_attribute("data-weight")) - patterns["f16"][1, 0, q, k]) < 1e-6
    assert all(int(l.get_attribute("data-k")) <= int(l.get_attribute("data-q"))
               for l in lines.all()[:50])  # causal: no line to a future key
    page.locator("#line-heads input[value='1']").check()
    page.wait_for_function(f"document.querySelectorAll('#lineview line').length === "
                           f"{want + int((patterns['f16'][1, 1] >= 0.01).sum())}")
    page.hover("#lineview .qtok[data-pos='5']")
    hidden = page.locator("#lineview line").evaluate_all(
        "ls => ls.filter(l => l.style.display !== 'none').map(l => +l.dataset.q)")
    assert hidden and set(hidden) == {5}
    screenshot(page, "explorer-lines", "#panel-lines")
    # links: the API's table
    links = api(live_server.url, "/v1/links", {"text": SENTENCE, "layer": 1, "head": 0, "top_k": 3})
    rows = page.locator("#links tr").all_inner_texts()[1:]
    assert len(rows) == len(links["links"]["links"])
    for row, ql in zip(rows, links["links"]["links"]):
        assert row.split("\t")[0].startswith(str(ql["query_pos"]))
        assert f"({ql['links'][0]['weight']:.3f})" in row
    # trajectories: one arrow per step and token, explained variance on both axes
    tr = api(live_server.url, "/v1/trajectories", {"text": SENTENCE})["trajectories"]
    steps = page.locator("#trajectories line.step")
    assert steps.count() == n * (len(tr["states"]) - 1)
    assert all(s.get_attribute("marker-end", timeout=1000).startswith("url(#arrow-")
               for s in steps.all()[:5])
    evr = tr["explained_variance_ratio"]
    assert page.text_content("#trajectories .xlabel") == f"PC 1 ({100 * evr[0]:.1f} % of variance)"
    assert page.text_content("#trajectories .ylabel") == f"PC 2 ({100 * evr[1]:.1f} % of variance)"
    screenshot(page, "explorer-trajectories", "#panel-trajectories")
    # verification: the API's verdict and per-layer rows
    v = api(live_server.url, "/v1/verify", {"text": SENTENCE})["verification"]
    assert v["passed"]
    shown = page.inner_text("#verify p.pass")  # the verdict once (the message's own word dropped)
    assert shown.startswith("PASSED: ") and shown.lower().count("passed") == 1, shown
    assert v["message"].endswith(shown.removeprefix("PASSED: ")), (shown, v["message"])
    assert page.locator("#verify tr").count() == 1 + len(v["layers"])
    screenshot(page, "explorer-verify", "#panel-verify")
    # model card and tokens
    m = httpx.get(live_server.url + "/v1/model").json()
    card = page.inner_text("#model-card")
    assert m["id"] in card and m["revision"] in card and f"{m['n_layers']} x {m['n_heads']}" in card
    chips = page.locator("#tokens .token")
    assert chips.count() == n
    t5 = patterns["tokens"][5]
    assert chips.nth(5).get_attribute("title") == (
        f"position 5, id {t5['id']}, characters {t5['start']}..{t5['end']}")
    path = screenshot(page, "explorer", full_page=True)
    page.evaluate("window.scrollTo(0, 0)")
    screenshot(page, "explorer-top")
    if os.environ.get("ATTNSCOPE_UPDATE_SCREENSHOT") == "1":  # the README's picture
        shutil.copy(ARTIFACTS / "explorer-top.png", ROOT / "docs" / "explorer.png")


def test_errors_are_shown_and_the_page_recovers(live_server, page):
    open_explorer(page, live_server.url)  # a text's results on screen first
    assert page.locator("#tokens .token").count() > 4
    page.fill("#text", "word " * 400)  # over the bundled model's 256-token context
    page.click("#run")
    page.wait_for_function("document.body.dataset.state === 'error'", timeout=60_000)
    status = page.inner_text("#status")
    assert "422 context_length_exceeded (text)" in status and "256" in status
    # the URL now names the failing text: no panel shows the previous text's results
    assert parse_qs(urlparse(page.url).query)["text"] == ["word " * 400]
    for sel in ("#tokens .token", "#heatmap canvas", "#lineview line", "#headgrid button",
                "#links tr", "#trajectories line", "#verify p"):
        assert page.locator(sel).count() == 0, sel
    assert page.inner_text("#token-count") == ""
    # the browser itself logs the failed fetch; nothing else went wrong
    page.errors[:] = [e for e in page.errors if "status of 422" not in e]
    page.fill("#text", "A short text again.")
    page.keyboard.press("Control+Enter")
    page.wait_for_function("document.body.dataset.state === 'ready'", timeout=60_000)
    assert page.locator("#tokens .token").count() >= 4


def test_url_values_past_the_model_are_said_and_rollout_has_no_head(live_server, page):
    m = httpx.get(live_server.url + "/v1/model").json()
    L, H = m["n_layers"], m["n_heads"]
    open_explorer(page, live_server.url, layer=L + 7, head=H + 3)
    status = page.inner_text("#status")
    assert f"layer {L + 7} is past the model's {L} layers: showing layer {L - 1}" in status, status
    assert f"head {H + 3} is past its {H} heads: showing head {H - 1}" in status, status
    qs = parse_qs(urlparse(page.url).query)
    assert qs["layer"] == [str(L - 1)] and qs["head"] == [str(H - 1)]
    assert not page.locator("#head").is_disabled()
    page.select_option("#view", "rollout")
    page.wait_for_function("document.querySelector('#heatmap .view-title').textContent.includes('rollout')")
    assert page.locator("#head").is_disabled()
    page.select_option("#view", "weight")
    page.wait_for_function("!document.querySelector('#head').disabled")


def test_line_view_legend_once_and_trajectory_labels_apart(live_server, page):
    text = "And God said, Let there be light: and there was light. And God saw the light."
    # the text's own tokens (add_bos=0): without the BOS sink this text gives L1H0 two labels
    open_explorer(page, live_server.url, text=text, layer=1, head=0, extra="&add_bos=0")
    # the head checkboxes carry the swatches; the line view adds only its count note
    assert page.locator("#line-heads .swatch").count() >= 2
    assert page.locator("#lineview .legend .swatch").count() == 0
    assert "lines (weights" in page.inner_text("#lineview .legend")
    # token labels at the paths' ends: inside the plot, no two overlapping; any left out is said
    boxes = page.locator("#trajectories text.toklabel").evaluate_all(
        "ts => ts.map(t => { const b = t.getBBox(); return [b.x, b.y, b.x + b.width, b.y + b.height]; })")
    W, H = (float(page.locator("#trajectories svg").get_attribute(a)) for a in ("width", "height"))
    n = len(api(live_server.url, "/v1/tokenize", {"text": text, "add_bos": False})["tokens"]["tokens"])
    assert boxes and all(b[0] >= 0 and b[1] >= 0 and b[2] <= W and b[3] <= H for b in boxes), boxes
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not (a[0] < b[2] - 0.5 and b[0] < a[2] - 0.5 and a[1] < b[3] - 0.5
                        and b[1] < a[3] - 0.5), (a, b)
    if len(boxes) < n:
        assert f"{n - len(boxes)} token label(s) not drawn" in page.inner_text("#panel-trajectories")
    assert page.locator("#trajectories g.path title").count() == n
    screenshot(page, "explorer-trajectories-labels", "#panel-trajectories")
    # a head with two labels names both in its tooltip (this text gives L1H0 two)
    heads = api(live_server.url, "/v1/heads", {"text": text, "add_bos": False})["heads"]
    multi = [h for h in heads if len(h["labels"]) > 1]
    assert multi, [h["labels"] for h in heads]
    for h in multi:
        title = page.locator(f"#headgrid button[data-layer='{h['layer']}'][data-head='{h['head']}']"
                             ).get_attribute("title")
        others = ", ".join(x for x in h["labels"] if x != h["label"])
        assert title.startswith(f"layer {h['layer']}, head {h['head']}: {h['label']} (also {others})\n"), title


def test_long_text_uses_compact_wire_forms_and_caps_the_line_view(live_server, page):
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)  # ~200 tokens
    # without BOS (the text's own tokens): with it the sink leaves under 4000 weights >= 0.01
    n = len(api(live_server.url, "/v1/tokenize", {"text": text, "add_bos": False})["tokens"]["tokens"])
    assert 150 < n <= 256
    sizes = []
    page.on("response", lambda r: sizes.append((r.url, len(r.body())))
            if r.url.endswith("/v1/attention") else None)
    open_explorer(page, live_server.url, text=text, layer=1, head="mean", extra="&add_bos=0")
    assert page.locator("#heatmap canvas").get_attribute("data-n") == str(n)
    # float16 lower triangle of one layer's 4 heads: 2 bytes x 4 x n(n+1)/2, base64 (4/3)
    tril = 2 * 4 * n * (n + 1) // 2 * 4 // 3
    assert sizes and max(s for _, s in sizes) < tril + 40_000
    lines = page.locator("#lineview line").count()
    assert 0 < lines <= 4000 and "strongest 4000 of" in page.inner_text("#lineview .legend")
    value, _ = hover_cell(page, n - 1, n - 2)
    assert value != "masked"


def _thread_server(runtime, **settings):
    """A real uvicorn on 127.0.0.1 in a thread, serving an app on an already loaded runtime."""
    import threading
    import time

    import uvicorn

    from attnscope.service.app import create_app
    from attnscope.service.config import Settings
    from conftest import free_port

    port = free_port()
    app = create_app(Settings(**{"model": "bundled", **settings}), runtime=runtime)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    return server, t, url


@pytest.fixture(scope="module")
def keyed_server(gpt2_runtime):
    """The bundled model behind api_keys."""
    server, t, url = _thread_server(gpt2_runtime, api_keys=["s3cret"])
    yield url
    server.should_exit = True
    t.join(timeout=10)


@pytest.fixture(scope="module")
def encoder_server(bert_runtime):
    """MiniLM (a BERT-family encoder: no causal mask)."""
    server, t, url = _thread_server(bert_runtime, model=str(bert_runtime.settings.model))
    yield url
    server.should_exit = True
    t.join(timeout=10)


def test_encoder_page_has_no_masked_cells_and_full_layout(encoder_server, page):
    requests = []
    page.on("request", lambda r: requests.append(json.loads(r.post_data))
            if r.url.endswith("/v1/attention") else None)
    text = "The cat sat on the mat."
    open_explorer(page, encoder_server, text=text, layer=2, head=5)
    ref = api(encoder_server, "/v1/attention", {"text": text, "layers": [2]})
    p = decode_tensor(ref["attention"]["pattern"])
    n = p.shape[-1]
    assert page.locator("#heatmap canvas").get_attribute("data-n") == str(n)
    for q, k in [(0, n - 1), (2, 4), (n - 1, 0)]:  # above the diagonal too: an encoder
        value, _ = hover_cell(page, q, k)
        assert abs(float(value) - p[0, 5, q, k]) <= 0.5e-3 + 2 ** -11
    assert requests and all(b.get("layout", "full") == "full" for b in requests)
    assert not page.is_visible("#add-bos")  # causal models only
    assert "masked" not in page.inner_text("#cbar")
    assert page.locator("#tokens .token.special").count() == 2  # [CLS] ... [SEP]
    screenshot(page, "explorer-encoder", "#panel-attention")


def test_with_api_keys_the_page_asks_for_a_key(keyed_server, page):
    page.goto(f"{keyed_server}/?text={quote('The cat sat.')}")
    page.wait_for_function("document.body.dataset.state === 'error'", timeout=60_000)
    assert "401 unauthorized" in page.inner_text("#status")
    assert page.is_visible("#api-key")
    page.errors[:] = [e for e in page.errors if "status of 401" not in e]
    page.fill("#api-key", "s3cret")
    page.press("#api-key", "Enter")
    page.wait_for_function("document.body.dataset.state === 'ready'", timeout=60_000)
    assert page.locator("#tokens .token").count() >= 3 and not page.is_visible("#api-key")


def test_verification_panel_shows_a_planted_fault(page):
    """Planted fault: the output projection of layer 1 changes after the text's forward was
    recorded (cached); the service's verification fails at layer 1 and the page says so."""
    import torch

    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime

    rt = Runtime.load(Settings(model="bundled"))  # its own copy: its weights change here
    server, t, url = _thread_server(rt)
    try:
        assert api(url, "/v1/verify", {"text": SENTENCE})["verification"]["passed"]  # cached
        w = rt.adapter.base().h[1].attn.c_proj.weight
        with torch.no_grad():
            w[:, 7].add_(0.05)
        open_explorer(page, url, layer=1, head=0)
        v = api(url, "/v1/verify", {"text": SENTENCE})["verification"]
        assert not v["passed"] and v["failed_layers"] == [1]
        shown = page.inner_text("#verify p.fail")  # the verdict once
        assert shown == "FAILED: " + v["message"].removeprefix("failed: "), (shown, v["message"])
        rows = page.locator("#verify tr").all_inner_texts()
        assert rows[1].split("\t")[-1] == "yes" and rows[2].split("\t")[-1] == "NO"
    finally:
        server.should_exit = True
        t.join(timeout=10)


def test_extra_panels_plug_in_with_register_panel(live_server, page):
    """The hook later panels (ablation/patching, norms, rollout) use: a registered panel
    renders with the page's context and, if layerAware, again when the layer/head changes."""
    open_explorer(page, live_server.url, layer=0, head=1)
    page.evaluate("""async () => {
      const { registerPanel } = await import('/static/web/explorer.js');
      registerPanel({ id: 'probe', title: 'Probe panel', layerAware: true,
        async render(ctx, body) {
          const r = await ctx.client.tokenize({ text: ctx.text, add_bos: ctx.addBos });
          body.textContent = `${ctx.model.id} layer ${ctx.layer} head ${ctx.head}: ` +
            `${r.tokens.n_tokens} tokens`;
        } });
    }""")
    page.wait_for_selector("#panel-probe[data-ready='1']")
    n = len(api(live_server.url, "/v1/tokenize", {"text": SENTENCE})["tokens"]["tokens"])
    assert page.inner_text("#panel-probe h2") == "Probe panel"
    assert page.inner_text("#panel-probe .panel-body") == f"attnscope-tiny-gpt2 layer 0 head 1: {n} tokens"
    page.select_option("#head", "3")
    page.wait_for_function("document.querySelector('#panel-probe .panel-body').textContent.includes('head 3')")


def test_a_late_reply_for_an_earlier_text_is_not_shown(live_server, page):
    """Analyse text A, then text B before A's head scores arrive: A's late /v1/heads reply
    (held back here until B is on screen) must not replace B's head grid."""
    a, b = "The cat sat on the mat and the cat sat on the mat.", "Hi there, friend"
    held = []

    def hold_first(route):
        if not held:
            held.append(route)  # answered below, after B is shown
        else:
            route.continue_()

    page.route("**/v1/heads", hold_first)
    page.goto(f"{live_server.url}/explorer")
    page.wait_for_function("document.body.dataset.state === 'idle'")
    page.fill("#text", a)
    page.click("#run")
    page.wait_for_function("document.querySelectorAll('#tokens .token').length > 0")
    assert len(held) == 1
    page.fill("#text", b)
    page.click("#run")
    page.wait_for_function("document.body.dataset.state === 'ready'", timeout=60_000)
    want = api(live_server.url, "/v1/heads", {"text": b})["heads"]
    late = held[0].fetch()
    with page.expect_response("**/v1/heads"):
        held[0].fulfill(response=late)
    page.evaluate("() => new Promise((r) => setTimeout(r, 200))")  # its handlers have run
    for h in want:
        title = page.locator(f"#headgrid button[data-layer='{h['layer']}'][data-head='{h['head']}']"
                             ).get_attribute("title")
        assert f"self: {h['scores']['self']:.3f}" in title, (h, title)
    assert page.locator("#tokens .token").count() == len(
        api(live_server.url, "/v1/tokenize", {"text": b})["tokens"]["tokens"])


def test_a_panel_that_cannot_be_computed_says_why_and_the_rest_stand(live_server, page):
    """A 1-token text: head scores need 2 tokens; the heads panel says so, the heat map,
    tokens and links are there, and the status line names the panel."""
    open_explorer(page, live_server.url, text="x", extra="&add_bos=0")  # no BOS: 1 token
    assert page.locator("#tokens .token").count() == 1
    assert page.locator("#heatmap canvas").count() >= 1
    err = page.inner_text("#headgrid .panel-error")
    assert "422" in err and "2 tokens" in err, err
    status = page.inner_text("#status")
    assert status.startswith("1 token analysed by "), status
    assert "heads: 422" in status, status
    page.errors[:] = [e for e in page.errors if "status of 422" not in e]  # the browser's own log
    # URL values that are not indices are said too
    page.goto(f"{live_server.url}/explorer?text=hello%20world&layer=abc&head=-2")
    page.wait_for_function("document.body.dataset.state === 'ready'", timeout=60_000)
    status = page.inner_text("#status")
    assert "layer=abc is not a layer index: showing layer 0" in status, status
    assert "head=-2 is not a head index: showing head mean" in status, status


def test_bos_is_the_first_token_by_default_and_one_flag_away(live_server, page):
    """The explorer follows the model's convention (GPT-2: BOS first, as every endpoint's
    add_bos null): the checkbox starts checked, the first token is <|endoftext|> and the URL
    stays clean; unchecking gives the text's own tokens and says add_bos=0 in the URL."""
    open_explorer(page, live_server.url)
    assert page.is_checked("#add-bos")
    first = page.locator("#tokens .token").first
    assert first.inner_text().strip().startswith("<|endoftext|>")
    n = len(api(live_server.url, "/v1/tokenize", {"text": SENTENCE})["tokens"]["tokens"])
    assert page.locator("#tokens .token").count() == n
    assert "add_bos" not in parse_qs(urlparse(page.url).query)
    page.uncheck("#add-bos")
    page.click("#run")
    page.wait_for_function(f"document.querySelectorAll('#tokens .token').length === {n - 1} && "
                           "document.body.dataset.state === 'ready'", timeout=60_000)
    assert parse_qs(urlparse(page.url).query)["add_bos"] == ["0"]
    assert not page.locator("#tokens .token").first.inner_text().strip().startswith("<|endoftext|>")


@pytest.fixture(scope="module")
def llama_server():
    """The bundled Llama (RoPE theta 1e4, 4 query heads / 2 key/value heads, RMSNorm)."""
    from attnscope.service.config import Settings
    from attnscope.service.runtime.model import Runtime

    rt = Runtime.load(Settings(model="bundled-llama"))
    server, t, url = _thread_server(rt, model="bundled-llama")
    yield url
    server.should_exit = True
    t.join(timeout=10)


def test_llama_page_labels_key_value_groups_and_shows_the_attention_facts(llama_server, page):
    info = httpx.get(llama_server + "/v1/model", timeout=30).json()
    kv = info["attention"]["kv_head_of_query_head"]
    assert kv == [0, 0, 1, 1]
    open_explorer(page, llama_server, layer=1, head=2)
    card = page.inner_text("#model-card")
    facts = dict(zip(page.locator("#model-card dt").all_inner_texts(),
                     page.locator("#model-card dd").all_inner_texts()))
    assert facts["positions"] == f"RoPE on all dims, theta {info['attention']['rope_theta']:g}"
    assert facts["key/value heads"] == ("2 (grouped-query, 2 query heads each; kv 0: heads 0, 1; "
                                        "kv 1: heads 2, 3)")
    assert facts["sliding window"] == "none (full causal)"
    assert facts["soft-cap"] == "none"
    assert facts["norm"] == "RMSNorm"
    assert "attnscope-tiny-llama" in card
    options = page.locator("#head option").all_inner_texts()
    assert options == ["head mean"] + [f"head {h} \u00b7 kv {kv[h]}" for h in range(4)]
    assert "layer 1, head 2 \u00b7 kv 1" in page.inner_text("#heatmap .view-title")
    # the line view's head picker names the groups too
    labels = page.locator("#line-heads label").all_inner_texts()
    assert [x.strip() for x in labels] == [f"head {h} \u00b7 kv {kv[h]}" for h in range(4)]
    assert page.inner_text("#heads-note").endswith(
        "; key/value groups (every layer): kv 0 = heads 0, 1; kv 1 = heads 2, 3")
    screenshot(page, "explorer-llama-model", "#model-card")
    screenshot(page, "explorer-llama-top")


def test_gpt2_page_has_no_key_value_labels(live_server, page):
    open_explorer(page, live_server.url, layer=0, head=1)
    assert page.locator("#head option").all_inner_texts()[1:3] == ["head 0", "head 1"]
    facts = dict(zip(page.locator("#model-card dt").all_inner_texts(),
                     page.locator("#model-card dd").all_inner_texts()))
    assert "key/value heads" not in facts
    assert "key/value" not in page.inner_text("#heads-note")
    assert facts["positions"] == "learned absolute" and facts["norm"] == "LayerNorm"
