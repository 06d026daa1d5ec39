"""The explorer's analysis views (issue 26 items 4 and 5) in headless Chromium against a real
uvicorn serving a random 12-head GPT-2 (n_layer 2, n_head 12, n_embd 96, the bundled
tokenizer): logit lens grid, direct logit attribution bars, ablation and patching grids,
composition graph, at 800, 1,400 and 1,920 px; every number shown is the API's. Also the
fixes of the new user's findings (API keys, head grid width, colour bars, legends, norm view,
numbers, heat-map axes and keyboard cursor, patching with equal metrics), the notebook views
of every new response type and the matplotlib figures. Screenshots in tests/artifacts/."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import parse_qs, quote, urlparse

import httpx
import numpy as np
import pytest

from conftest import BUNDLED_MODEL_DIR
from test_web_explorer import _thread_server, api
from web_browser import ARTIFACTS, browser, page, screenshot  # noqa: F401  (fixtures)

TEXT = "When Mary and John went to the store, John gave a drink to Mary because she was thirsty"
CORRUPTED = "When Mary and John went to the store, she gave a drink to Mary because John was thirsty"
WIDTHS = [800, 1400, 1920]
OLD_WEB = os.environ.get("ATTNSCOPE_OLD_WEB")  # a folder of older explorer files (demonstration)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory) -> Path:
    """A random GPT-2 with 12 heads (GPT-2 small's count) and 2 layers, saved with the
    bundled tokenizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    d = tmp_path_factory.mktemp("gpt2-12-heads")
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(vocab_size=2048, n_layer=2, n_head=12, n_embd=96,
                                   n_positions=256, bos_token_id=0, eos_token_id=0))
    m.save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL_DIR / f, d / f)
    return d


@pytest.fixture(scope="module")
def wide_runtime(wide_dir):
    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime

    return Runtime.load(Settings(model=str(wide_dir)))


@pytest.fixture(scope="module")
def wide(wide_runtime, wide_dir):
    server, t, url = _thread_server(wide_runtime, model=str(wide_dir))
    yield url
    server.should_exit = True
    t.join(timeout=10)


@pytest.fixture(scope="module")
def wide_keyed(wide_runtime, wide_dir):
    server, t, url = _thread_server(wide_runtime, model=str(wide_dir), api_keys=["s3cret"])
    yield url
    server.should_exit = True
    t.join(timeout=10)


def _old_files(page):
    """With ATTNSCOPE_OLD_WEB set, serve that folder's explorer files instead (to show a test
    fails on older code)."""
    if not OLD_WEB:
        return
    html = (Path(OLD_WEB) / "index.html").read_text()

    def index(route):
        if urlparse(route.request.url).path == "/":
            route.fulfill(body=html, content_type="text/html")
        else:
            route.continue_()
    page.route("**/*", index)  # (routes added later are tried first)

    def serve(body, ctype):
        return lambda route: route.fulfill(body=body, content_type=ctype)

    for name in ("explorer.js", "views.js", "explorer.css"):
        page.route(f"**/static/web/{name}", serve((Path(OLD_WEB) / name).read_text(),
                                                  "text/css" if name.endswith(".css") else "text/javascript"))


def open_at(page, url, width, text=TEXT, extra=""):
    page.set_viewport_size({"width": width, "height": 900})
    page.goto(f"{url}/?text={quote(text)}&layer=1&head=0{extra}")
    page.wait_for_function("document.body.dataset.state === 'ready' && "
                           "document.querySelector('#panel-composition').dataset.ready === '1' && "
                           "document.querySelector('#panel-dla').dataset.ready === '1'")


def inside(page, sel, container):
    """Every element matched by `sel` lies (horizontally) inside `container`'s visible box."""
    return page.evaluate("""([sel, con]) => { const c = document.querySelector(con).getBoundingClientRect();
      return [...document.querySelectorAll(sel)].map((e) => { const r = e.getBoundingClientRect();
        return [r.left >= c.left - 0.5 && r.right <= c.right + 0.5, e.textContent, r.left, r.right, c.left, c.right]; }); }""",
                         [sel, container])


# ---- item 5: the API key flow --------------------------------------------------------------

def test_typing_the_key_then_analyse_keeps_the_text_and_the_url(wide_keyed, page):
    """With api_keys set the page asks for a key; typing it and clicking Analyse analyses the
    text from the shared URL (before: the page reloaded to an empty form)."""
    _old_files(page)
    text = "The cat sat on the mat."
    page.goto(f"{wide_keyed}/?text={quote(text)}&layer=1&head=3")
    page.wait_for_function("document.body.dataset.state === 'error'")
    page.errors[:] = [e for e in page.errors if "status of 401" not in e]
    assert page.is_visible("#api-key")
    page.fill("#api-key", "s3cret")
    page.click("#run")
    page.wait_for_function("['ready', 'idle'].includes(document.body.dataset.state) || "
                           "(document.readyState === 'complete' && !location.search.includes('text='))",
                           timeout=30_000)
    page.wait_for_timeout(300)
    qs = parse_qs(urlparse(page.url).query)
    assert qs.get("text") == [text] and qs.get("layer") == ["1"] and qs.get("head") == ["3"], page.url
    assert page.input_value("#text") == text
    page.wait_for_function("document.body.dataset.state === 'ready'", timeout=30_000)
    assert page.locator("#tokens .token").count() >= 6 and not page.is_visible("#api-key")


# ---- item 4 and 5: every view at three widths with 12 heads ---------------------------------

@pytest.mark.parametrize("width", WIDTHS)
def test_views_at_width(wide, page, width):
    url = wide
    open_at(page, url, width)
    m = httpx.get(url + "/v1/model").json()
    L, H = m["n_layers"], m["n_heads"]
    assert H == 12
    # head grid: all 12 heads inside the panel (or a visible scroll bar and its note)
    fits = inside(page, "#headgrid button.headcell", "#panel-heads")
    assert len(fits) == L * H
    scrolls = page.get_attribute("#headgrid .grid-scroll-wrap", "data-scrolls") == "1"
    assert all(f[0] for f in fits) or (scrolls and page.is_visible("#headgrid .scroll-note")), fits
    if width >= 1400:
        assert all(f[0] for f in fits), [f for f in fits if not f[0]]
    # colour bar: title and ticks never cut (inside the panel, one line per tick)
    for sel in ("#cbar .cbar-title", "#cbar .cbar-ticks span"):
        assert all(f[0] for f in inside(page, sel, "#panel-attention")), sel
    # line view: 12 heads, 12 different swatch colours
    cols = page.locator("#line-heads .swatch").evaluate_all("s => s.map(e => getComputedStyle(e).backgroundColor)")
    assert len(cols) == H and len(set(cols)) == H, cols
    # trajectories: 20+ tokens, every path its own colour
    strokes = page.locator("#trajectories g.path").evaluate_all(
        "gs => gs.map(g => g.querySelector('line.step').getAttribute('stroke'))")
    assert len(strokes) >= 20 and len(set(strokes[:20])) == 20, strokes
    # heat map: axis titles and a keyboard cursor
    assert page.is_visible("#heatmap .axis-x") and "key" in page.inner_text("#heatmap .axis-x")
    assert "query" in page.inner_text("#heatmap .axis-y")
    page.locator("#heatmap canvas").focus()
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowRight")
    cur = page.locator("#heatmap .heatmap-cursor")
    assert cur.is_visible() and (cur.get_attribute("data-q"), cur.get_attribute("data-k")) == ("1", "1")
    # logit lens: (L + 1) states x T positions, the API's top token, probability and rank
    lens = api(url, "/v1/logit-lens", {"text": TEXT, "top_k": 5})["prompts"][0]
    T = lens["n_tokens"]
    assert page.locator("#lens td.lenscell").count() == (L + 1) * T
    for st, pos in [(0, 3), (L, T - 2), (1, 7)]:
        want = lens["states"][st]["positions"][pos]
        c = page.locator(f"#lens td.lenscell[data-state='{lens['states'][st]['label']}'][data-pos='{pos}']")
        assert float(c.get_attribute("data-prob")) == pytest.approx(want["top"][0]["prob"], abs=1e-9)
        assert c.get_attribute("data-rank") == str(want["target"]["rank"])
        assert f"rank {want['target']['rank']} (0 = top)" in c.get_attribute("title")
    # DLA: a bar per head, MLP, bias and embedding; the API's numbers; sum and ln_final bias
    top = lens["states"][L]["positions"][T - 1]["top"]
    dla = api(url, "/v1/logit-attribution", {"text": TEXT, "target": top[0]["id"],
                                              "distractor": top[1]["id"]})["prompts"][0]["positions"][0]
    bars = page.locator("#dla g.bar")
    assert bars.count() == 2 + L * H + 2 * L
    b = page.locator("#dla g.bar[data-name='L1H7']")
    assert float(b.get_attribute("data-value")) == pytest.approx(dla["heads"][1][7], abs=1e-9)
    sums = page.locator("#dla table.dla-sum").inner_text()
    assert "ln_final bias" in sums and "sum of the parts" in sums
    # composition: edges = the scores at or above the threshold shown
    circ = api(url, "/v1/circuits", {"composition": True, "top_k": 1})["composition"]
    thr = float(page.input_value("#comp-thr"))
    n_edges = sum(circ[k][la][ha][lb][hb] >= thr for k in "qkv" for la in range(L) for ha in range(H)
                  for lb in range(la + 1, L) for hb in range(H))
    assert page.locator("#composition path.edge").count() == min(n_edges, 1500) > 0
    assert page.locator("#composition g.node").count() == L * H
    for sel in ("#panel-heads", "#panel-attention", "#panel-lens", "#panel-dla", "#panel-composition"):
        screenshot(page, f"views-{width}-{sel[7:]}", sel)
    screenshot(page, f"views-{width}-page", full_page=True)


@pytest.mark.parametrize("width", WIDTHS)
def test_ablation_and_patching_grids(wide, page, width):
    url = wide
    open_at(page, url, width)
    page.click("#scan-run")
    page.wait_for_function("document.querySelector('#panel-interventions').dataset.ready === '1' && "
                           "document.querySelector('#scan table.effectgrid')")
    scan = api(url, "/v1/ablate", {"text": TEXT, "scan": True, "scan_metric": "loss"})["scan"]["effect"]
    cells = page.locator("#scan td.effcell")
    assert cells.count() == 2 * 12
    assert float(page.get_attribute("#scan td.effcell[data-row='1'][data-col='11']", "data-value")) == \
        pytest.approx(scan[1][11], abs=1e-9)
    bar = page.locator("#scan canvas.cbar")  # diverging, centred on 0, labelled
    vmax = max(abs(v) for r in scan for v in r)
    assert float(bar.get_attribute("data-vmin")) == pytest.approx(-vmax) and \
        float(bar.get_attribute("data-vmax")) == pytest.approx(vmax)
    assert "loss" in page.inner_text("#scan .cbar-title")
    assert all(f[0] for f in inside(page, "#scan td.effcell", "#panel-interventions")) or \
        page.is_visible("#scan .scroll-note")
    # patching: heads, head x position of a layer, residual [layer, pos]
    page.fill("#patch-corrupted", CORRUPTED)
    page.fill("#patch-target", " John")
    page.fill("#patch-distractor", " the")
    page.check("#patch-pos")
    page.check("#patch-resid")
    page.click("#patch-run")
    page.wait_for_selector("#patch .patch-resid table.effectgrid")
    ref = api(url, "/v1/patch", {"clean_text": TEXT, "corrupted_text": CORRUPTED, "per_position": True,
                                 "residual": True, "logit_diff": {"target": " John", "distractor": " the"}})
    T = len(ref["clean_tokens"])
    assert page.locator("#patch .patch-heads td.effcell").count() == 2 * 12
    assert page.locator("#patch .patch-perpos td.effcell").count() == 12 * T
    assert page.locator("#patch .patch-resid td.effcell").count() == 2 * T
    got = float(page.get_attribute("#patch .patch-heads td.effcell[data-row='0'][data-col='5']", "data-value"))
    assert got == pytest.approx(ref["heads"][0][5], abs=1e-9)
    page.select_option("#patch select.patch-layer", "1")
    got = float(page.get_attribute(f"#patch .patch-perpos td.effcell[data-row='3'][data-col='{T - 1}']", "data-value"))
    assert got == pytest.approx(ref["heads_per_position"][1][3][T - 1], abs=1e-9)
    screenshot(page, f"views-{width}-interventions", "#panel-interventions")
    if width != 1400:
        return
    # the same text as clean and corrupted: equal metrics, the page says why (no white grid)
    page.fill("#patch-corrupted", TEXT)
    page.click("#patch-run")
    page.wait_for_selector("#patch .patch-equal")
    msg = page.inner_text("#patch .patch-equal")
    assert "same" in msg and "divides by zero" in msg
    assert page.locator("#patch table.effectgrid").count() == 0  # no all-white (or noise) grid
    screenshot(page, "views-patch-equal", "#panel-interventions")


def test_norm_view_names_norms_and_numbers_do_not_break(wide, page):
    open_at(page, wide, 1400, extra="&view=norm")
    assert "norm" in page.inner_text("#attn-hint") and "weight" not in page.inner_text("#attn-hint")
    assert "norms" in page.inner_text("#heatmap .view-title")
    assert "contribution norm" in page.inner_text("#cbar .cbar-title")
    ticks = page.locator("#cbar .cbar-ticks span").all_inner_texts()
    assert ticks[0] == "0.000" and float(ticks[-1]) > 0
    page.locator("#heatmap canvas").focus()
    page.keyboard.press("ArrowDown")
    assert ": norm " in page.inner_text("#heatmap .tip")
    # every number cell of the verification table on one line (no break inside 1.2e-5)
    lines = page.locator("#verify td.num").evaluate_all("""tds => tds.map(td => { const r = document.createRange();
        r.selectNodeContents(td); return [td.textContent, new Set([...r.getClientRects()].map(x => Math.round(x.top))).size,
        getComputedStyle(td).whiteSpace]; })""")
    assert lines and all(n == 1 and ws == "nowrap" for _, n, ws in lines), lines
    assert any("e" in t for t, _, _ in lines)
    screenshot(page, "views-norm", "#panel-attention")


# ---- notebook views of every new response type ----------------------------------------------

@pytest.fixture(scope="module")
def responses(wide):
    from attnscope.client import Client
    from attnscope.schemas import CircuitsResponse, LogitAttributionResponse, LogitLensResponse

    with Client(wide) as c:
        yield {
            "lens": c.request("POST", "/v1/logit-lens", {"text": TEXT, "top_k": 3}, LogitLensResponse),
            "dla": c.request("POST", "/v1/logit-attribution", {"text": TEXT, "target": " John",
                                                                "distractor": " the", "positions": [-1, -3]},
                             LogitAttributionResponse),
            "circuits": c.request("POST", "/v1/circuits", {"composition": True, "top_k": 2}, CircuitsResponse),
            "scan": c.ablate(TEXT, scan=True, scan_metric="loss"),
            "ablate": c.ablate(TEXT, heads=[[1, 3], [0, 11]]),
            "patch": c.patch(TEXT, CORRUPTED, logit_diff={"target": " John", "distractor": " the"},
                             per_position=True, residual=True),
            "patch_equal": c.patch(TEXT, TEXT, logit_diff={"target": " John", "distractor": " the"}),
            "run": c.run(texts=[TEXT], cache=["blocks.*.attn.hook_z", "blocks.0.hook_resid_pre"], loss=True),
        }


def nb_show(page, html):
    asked = []
    page.route("http://**", lambda r: (asked.append(r.request.url), r.abort()))
    page.set_content(f"<!doctype html><html><body>{html}</body></html>")
    page.wait_for_selector(".attnscope-nb[data-ready='1']")
    assert asked == []


def test_notebook_views_of_lens_dla_circuits_ablate_patch_run(responses, page):
    from attnscope.schemas import CircuitsResponse

    r = responses
    page.set_viewport_size({"width": 1400, "height": 900})
    nb_show(page, r["lens"]._repr_html_())
    p = r["lens"].prompts[0]
    assert page.locator("td.lenscell").count() == len(p.states) * p.n_tokens
    screenshot(page, "notebook-lens", ".attnscope-nb")
    nb_show(page, r["dla"]._repr_html_())
    d = r["dla"].prompts[0].positions
    assert page.locator("g.bar").count() == 2 + 2 * 12 + 2 * 2
    assert float(page.get_attribute("g.bar[data-name='L0H4']", "data-value")) == pytest.approx(d[0].heads[0][4])
    page.select_option(".nb-pos", "1")
    assert float(page.get_attribute("g.bar[data-name='L0H4']", "data-value")) == pytest.approx(d[1].heads[0][4])
    screenshot(page, "notebook-dla", ".attnscope-nb")
    assert isinstance(r["circuits"], CircuitsResponse)
    nb_show(page, r["circuits"]._repr_html_())
    assert page.locator(".nb-copy td.effcell").count() == 24 and page.locator("g.node").count() == 24
    assert page.locator("path.edge").count() > 0
    screenshot(page, "notebook-circuits", ".attnscope-nb")
    nb_show(page, r["scan"]._repr_html_())
    assert page.locator("td.effcell").count() == 24
    html = r["ablate"]._repr_html_()
    assert "L1H3, L0H11" in html and "mean loss" in html
    nb_show(page, r["patch"]._repr_html_())
    assert page.locator(".patch-heads td.effcell").count() == 24 and page.locator(".patch-resid").count() == 1
    screenshot(page, "notebook-patch", ".attnscope-nb")
    nb_show(page, r["patch_equal"]._repr_html_())
    assert "divides by zero" in page.inner_text(".patch-equal") and page.locator("table.effectgrid").count() == 0
    html = r["run"]._repr_html_()
    for name, a in r["run"].cache.items():
        assert name in html and " x ".join(map(str, a.shape)) in html
    assert "2 cached hooks" not in html and f"{len(r['run'].cache)} cached hooks" in html


# ---- matplotlib figures ----------------------------------------------------------------------

def test_plots_of_lens_dla_composition_patching(responses, tmp_path):
    from attnscope.client import plots

    r = responses
    out = ARTIFACTS / "plots"
    out.mkdir(parents=True, exist_ok=True)
    figs = {
        "lens": plots.logit_lens(r["lens"]),
        "dla": plots.logit_attribution(r["dla"], position=0),
        "dla-sorted": plots.logit_attribution(r["dla"], position=1, order="value"),
        "composition": plots.composition(r["circuits"]),
        "composition-k": plots.composition(r["circuits"], kind="k", threshold=0.1),
        "scan": plots.effect_grid(r["scan"], label="loss change (nats)"),
        "patch-heads": plots.effect_grid(r["patch"], label="normalised"),
        "patch-perpos": plots.patch_per_position(r["patch"], layer=1),
        "patch-resid": plots.residual_grid(r["patch"]),
    }
    for name, fig in figs.items():
        path = out / f"views-{name}.png"
        fig.savefig(path, dpi=80)
        assert path.stat().st_size > 5000, name
        title = fig.axes[0].get_title()
        assert title, name
    assert "logit lens" in figs["lens"].axes[0].get_title() and "gpt2" in figs["lens"].axes[0].get_title()
    assert "ln_final bias" in figs["dla"].axes[0].get_title()
    n_bars = len(figs["dla"].axes[0].patches)
    assert n_bars == 2 + 2 * 12 + 2 * 2
    # bad input: said, never an empty figure
    with pytest.raises(ValueError, match="divides by zero"):
        plots.effect_grid(r["patch_equal"])
    with pytest.raises(ValueError, match="divides by zero"):
        plots.residual_grid(r["patch_equal"])
    with pytest.raises(ValueError, match="prompt 3"):
        plots.logit_lens(r["lens"], prompt=3)
    with pytest.raises(ValueError, match="order"):
        plots.logit_attribution(r["dla"], order="size")
    with pytest.raises(ValueError, match="kind"):
        plots.composition(r["circuits"], kind="x")
    with pytest.raises(ValueError, match="layer 5"):
        plots.patch_per_position(r["patch"], layer=5)
    with pytest.raises(ValueError, match="logit-lens"):
        plots.logit_lens(r["scan"])


def test_client_404_names_the_base_url_path(wide):
    from attnscope.client import Client, NotFoundError

    with Client(wide + "/api/v2", max_retries=0) as c:
        with pytest.raises(NotFoundError) as e:
            c.model()
    assert "check the path of the client's base URL" in str(e.value) and "/api/v2/v1/model" in str(e.value)


def test_cli_rollout_flow_plot_draws_the_flow(wide, monkeypatch, capsys, tmp_path):
    from attnscope.client import cli, plots

    seen = []
    real = plots.rollout_heatmap

    def spy(res, *a, **kw):
        fig = real(res, *a, **kw)
        seen.append(fig.axes[0].get_title())
        return fig

    monkeypatch.setattr(plots, "rollout_heatmap", spy)
    monkeypatch.setenv("ATTNSCOPE_BASE_URL", wide)
    out = tmp_path / "flow.png"
    assert cli.main(["rollout", "The cat sat on the mat.", "--flow", "--plot", str(out)]) == 0
    assert out.stat().st_size > 5000 and seen and "attention flow" in seen[0], seen
    seen.clear()
    assert cli.main(["rollout", "The cat sat on the mat.", "--plot", str(out)]) == 0
    assert "attention rollout" in seen[0], seen
