"""The path-patching views (issue 27 item 6) in headless Chromium against the real app: the
explorer's path-patching panel (every head -> every later head input in one request, a grid of
chosen sender -> receiver experiments, the chosen components together; bad input said in the
panel) on the bundled GPT-2 and, with "head h \u00b7 kv g" headers, the bundled Llama (4 query
heads, 2 key/value heads); the heads grid's per-head kv headers; the notebook view of
PathPatchResponse. Every cell is compared with the API's own response, and each check is run
once more on a page serving a views.js with a planted fault (a wrong cell, a wrong header),
where it must fail."""

from __future__ import annotations

from urllib.parse import quote

import httpx
import pytest

from test_web_explorer import api, llama_server  # noqa: F401  (fixture)
from web_browser import browser, page, screenshot  # noqa: F401  (fixtures)

CLEAN = "the cat sat on the mat and the cat sat"
CORRUPTED = "the dog sat on the mat and the cat sat"
METRIC = {"kind": "logit_diff", "terms": [{"position": -1, "target": " on", "distractor": " the"}]}
VIEWS = None  # views.js as served (read once)


# ---- helpers --------------------------------------------------------------------------------

def fmt_num(v: float, digits: int = 3) -> str:
    """views.js fmtNum: 3 significant digits, exponent form outside 1e-3..1e5, U+2212 minus."""
    if v == 0:
        return "0"
    if 1e-3 <= abs(v) < 1e5:
        x = float(f"{v:.{digits}g}")
        s = str(int(x)) if x.is_integer() else repr(x)
    else:
        m, e = f"{v:.{digits - 1}e}".split("e")
        s = f"{m}e{'-' if e[0] == '-' else '+'}{int(e[1:])}"
    s = s.replace("e-", "e\u2212")
    return "\u2212" + s[1:] if s.startswith("-") else s


def head_name(h: int, kv) -> str:
    return f"head {h} \u00b7 kv {kv[h]}" if kv else f"head {h}"


def ref_path_patch(url: str, **body) -> dict:
    return api(url, "/v1/path-patch", {"pairs": [{"clean_text": CLEAN, "corrupted_text": CORRUPTED}],
                                       "metric": METRIC, **body})


def plant(page, url: str, old: str, new: str) -> None:
    """Serve views.js with ``old`` replaced by ``new`` (a planted fault) to this page."""
    src = httpx.get(url + "/static/web/views.js").text
    assert src.count(old) == 1, old
    bad = src.replace(old, new)
    page.route("**/static/web/views.js", lambda r: r.fulfill(body=bad, content_type="text/javascript"))


def open_explorer(page, url: str, text: str = CLEAN) -> None:
    page.set_viewport_size({"width": 1400, "height": 900})
    page.goto(f"{url}/?text={quote(text)}&layer=0&head=mean")
    page.wait_for_function("document.body.dataset.state === 'ready'")


def run_path_patch(page, mode: str, corrupted: str = CORRUPTED, target=" on", distractor=" the",
                   positions="-1") -> None:
    page.fill("#pp-corrupted", corrupted)
    page.select_option("#pp-mode", mode)
    page.fill("#pp-target", target)
    page.fill("#pp-distractor", distractor)
    page.fill("#pp-positions", positions)
    page.click("#pp-run")
    page.wait_for_function("document.querySelector('#panel-pathpatch').dataset.ready === '1'")


def cells(page, root: str) -> list[dict]:
    return page.locator(f"{root} .pp-grid td.effcell").evaluate_all(
        "tds => tds.map(td => ({sender: td.dataset.sender, receiver: td.dataset.receiver, "
        "input: td.dataset.input, value: td.dataset.value, raw: td.dataset.raw, title: td.title, "
        "row: +td.dataset.row, col: +td.dataset.col}))")


def grid_columns(g: dict, kv) -> tuple[list, list[list[str]]]:
    """The receiver columns a /v1/path-patch grid should show, ``[(layer, head, input)]``, and
    the expected header rows: layer / "head h[ \u00b7 kv g]" / input, or on a grouped-query grid
    (k/v receivers are key/value heads, ``head_axes``) layer / input / "kv g" (q: query heads)."""
    L, H, inputs = len(g["raw"]), len(g["raw"][0]), g["inputs"]
    axes, n = g.get("head_axes") or {}, g.get("receiver_heads") or {}
    layers = [f"layer {l}" for l in range(1, L)]
    if any(axes.get(x) == "kv_head" for x in inputs):
        cols = [(l, h, x) for l in range(1, L) for x in inputs for h in range(n[x])]
        names = [f"kv {h}" if axes[x] == "kv_head" else head_name(h, kv) for _, h, x in cols]
        return cols, [layers, [x for _ in range(1, L) for x in inputs], names]
    cols = [(l, h, x) for l in range(1, L) for h in range(H) for x in inputs]
    return cols, [layers, [head_name(h, kv) for _ in range(1, L) for h in range(H)], [x for _, _, x in cols]]


def check_grid(page, root: str, ref: dict, kv=None) -> None:
    """The grid under ``root`` shows ``ref``'s every cell (normalised as colour and data-value,
    raw in data-raw and the tooltip), its headers (:func:`grid_columns`) and the hover
    readout."""
    g = ref["grid"]
    L, H, inputs = len(g["raw"]), len(g["raw"][0]), g["inputs"]
    cols, headers = grid_columns(g, kv)
    got = cells(page, root)
    assert len(got) == (L - 1) * H * len(cols), len(got)
    assert sorted((c["receiver"], c["input"]) for c in got) == \
        sorted((f"{l}.{h}", x) for l, h, x in cols for _ in range((L - 1) * H))
    for c in got:
        ls, hs = map(int, c["sender"].split("."))
        lr, hr = map(int, c["receiver"].split("."))
        k = inputs.index(c["input"])
        want_n, want_r = g["normalized"][ls][hs][lr][hr][k], g["raw"][ls][hs][lr][hr][k]
        if want_r is None:
            assert c["value"] == "null" and c["raw"] == "null", c
            continue
        assert float(c["value"]) == pytest.approx(want_n, rel=1e-6, abs=1e-9), (c, want_n)
        assert float(c["raw"]) == pytest.approx(want_r, rel=1e-6, abs=1e-9), (c, want_r)
        assert f"normalised {fmt_num(want_n, 4)}" in c["title"], (c["title"], want_n)
        assert f"patched {fmt_num(want_r, 4)}" in c["title"], (c["title"], want_r)
        assert f"change {fmt_num(want_r - ref['base']['mean'], 4)}" in c["title"], c["title"]
    # headers: receiver layer / head / input, sender rows
    for i, want in enumerate(headers):
        got_h = page.locator(f"{root} .pp-grid tr.pp-head-{i} th.pp-colhead").all_inner_texts()
        assert got_h == want, (i, got_h, want)
    rows = page.locator(f"{root} .pp-grid th.pp-rowhead").all_inner_texts()
    assert rows == [f"L{l} {head_name(h, kv)}" for l in range(L - 1) for h in range(H)], rows
    # hover: the readout says the cell's values (the cell with the largest |normalised|)
    best = max((c for c in got if c["value"] != "null"), key=lambda c: abs(float(c["value"])))
    cell = page.locator(f"{root} .pp-grid td.effcell[data-row='{best['row']}'][data-col='{best['col']}']")
    cell.scroll_into_view_if_needed()
    cell.hover()
    page.wait_for_function(f"document.querySelector('{root} .pp-readout').dataset.col === '{best['col']}' && "
                           f"document.querySelector('{root} .pp-readout').dataset.row === '{best['row']}'")
    text = page.inner_text(f"{root} .pp-readout")
    assert text == best["title"] and "normalised" in text and "patched" in text, text
    # colour bar: symmetric at the largest |normalised|
    vmax = max(abs(v) for a in g["normalized"] for b in a for c in b for d in c for v in d if v is not None)
    assert float(page.get_attribute(f"{root} canvas.cbar", "data-vmax")) == pytest.approx(vmax)
    assert float(page.get_attribute(f"{root} canvas.cbar", "data-vmin")) == pytest.approx(-vmax)


def expected_422s(page, n: int) -> None:
    """The page's console logs each 4xx the test asked for: exactly ``n`` of them, dropped."""
    said = [e for e in page.errors if "status of 422" in e]
    assert len(said) == n, page.errors
    page.errors[:] = [e for e in page.errors if "status of 422" not in e]


def fails(check, *a, **kw) -> str:
    """``check`` raises AssertionError (on a page with a planted fault); its message."""
    with pytest.raises(AssertionError) as e:
        check(*a, **kw)
    return str(e.value)


# ---- the bundled GPT-2 -------------------------------------------------------------------

def test_explorer_path_patch_grid_matches_the_api(live_server, page):
    url = live_server.url
    open_explorer(page, url)
    run_path_patch(page, "grid")
    ref = ref_path_patch(url, grid=True)
    check_grid(page, "#pathpatch", ref)
    note = page.inner_text("#pathpatch .pp-head-note")
    assert f"base (clean) {fmt_num(ref['base']['mean'], 4)}" in note
    assert f"other (corrupted) {fmt_num(ref['other']['mean'], 4)}" in note
    screenshot(page, "path-patch-grid", "#panel-pathpatch")
    # only q and v inputs: the grid has those columns only
    page.uncheck("#pp-grid-k")
    page.click("#pp-run")
    page.wait_for_function("document.querySelector('#panel-pathpatch').dataset.ready === '1' && "
                           "document.querySelectorAll('#pathpatch td.effcell').length === 32")
    check_grid(page, "#pathpatch", ref_path_patch(url, grid=True, grid_inputs=["q", "v"]))


def test_a_planted_wrong_cell_fails_the_grid_check(live_server, page):
    url = live_server.url
    ref = ref_path_patch(url, grid=True)
    # the cell of input k shows input q's value
    plant(page, url, "normalized: g.normalized[s.l][s.h][c.l][c.h][c.k] }",
          "normalized: g.normalized[s.l][s.h][c.l][c.h][c.k === 1 ? 0 : c.k] }")
    open_explorer(page, url)
    run_path_patch(page, "grid")
    msg = fails(check_grid, page, "#pathpatch", ref)
    assert "'input': 'k'" in msg, msg
    # the hover text names the raw value as the normalised one
    page.unroute("**/static/web/views.js")
    plant(page, url, "`; normalised ${c ? fmtNum(c.normalized, 4) : \"n/a\"}`",
          "`; normalised ${c ? fmtNum(c.raw, 4) : \"n/a\"}`")
    open_explorer(page, url)
    run_path_patch(page, "grid")
    assert "normalised" in fails(check_grid, page, "#pathpatch", ref)


def test_explorer_pairs_and_together_modes(live_server, page):
    url = live_server.url
    open_explorer(page, url)
    page.click("#pp-pick summary")
    for sel in ("[data-kind='head'][data-layer='0'][data-head='1']", "[data-kind='mlp'][data-layer='0']",
                "[data-kind='head'][data-layer='1'][data-head='2']"):
        page.check(f"#pp-senders input.pp-send{sel}")
    for sel in ("[data-kind='head'][data-layer='1'][data-head='3'][data-input='q']",
                "[data-kind='mlp'][data-layer='1']", "[data-kind='logits']"):
        page.check(f"#pp-receivers input.pp-recv{sel}")
    run_path_patch(page, "pairs")
    senders = [{"kind": "head", "layer": 0, "head": 1}, {"kind": "mlp", "layer": 0},
               {"kind": "head", "layer": 1, "head": 2}]
    receivers = [{"kind": "head", "layer": 1, "heads": [3], "input": "q"}, {"kind": "mlp", "layer": 1},
                 {"kind": "logits"}]
    got = {(c["row"], c["col"]): c for c in cells(page, "#pathpatch")}
    assert len(got) == 9
    cols = page.locator("#pathpatch tr.pp-head-1 th.pp-colhead").all_inner_texts()
    assert cols == ["head 3", "MLP", ""], cols
    rows = page.locator("#pathpatch th.pp-rowhead").all_inner_texts()
    assert rows == ["L0 head 1", "MLP 0", "L1 head 2"], rows
    for i, s in enumerate(senders):
        for j, r in enumerate(receivers):
            c = got[(i, j)]
            if (i, j) == (2, 0):  # L1H2 -> L1's q input: not after the sender
                assert c["value"] == "null" and "n/a" in c["title"], c
                continue
            ref = ref_path_patch(url, senders=[s], receivers=[r])
            assert float(c["value"]) == pytest.approx(ref["normalized"], rel=1e-6), (i, j, c)
            assert float(c["raw"]) == pytest.approx(ref["patched"]["mean"], rel=1e-6), (i, j, c)
    screenshot(page, "path-patch-pairs", "#panel-pathpatch")
    # the same components together: one experiment, its statistics
    run_path_patch(page, "together")
    assert "the logits are a receiver alone" in page.inner_text("#pathpatch .panel-error")  # the 422
    page.uncheck("#pp-receivers input.pp-recv[data-kind='logits']")
    run_path_patch(page, "together")
    assert "is not after sender 2" in page.inner_text("#pathpatch .panel-error")  # L1H2 -> L1H3 q
    page.uncheck("#pp-senders input.pp-send[data-kind='head'][data-layer='1'][data-head='2']")
    run_path_patch(page, "together")
    ref = ref_path_patch(url, senders=senders[:2], receivers=receivers[:2])
    assert page.inner_text("#pathpatch td.pp-normalized") == fmt_num(ref["normalized"], 4)
    summary = page.inner_text("#pathpatch table.pp-summary")
    assert fmt_num(ref["patched"]["mean"], 4) in summary and fmt_num(ref["base"]["mean"], 4) in summary
    assert page.inner_text("#pathpatch .pp-what") == "senders L0 head 1, MLP 0 \u2192 receivers L1 head 3 q input, MLP 1"
    expected_422s(page, 2)


def test_explorer_path_patch_bad_input_and_equal_runs(live_server, page):
    url = live_server.url
    open_explorer(page, url)
    run_path_patch(page, "grid", target=" Mary")  # two tokens of this vocabulary
    err = page.inner_text("#pathpatch .panel-error")
    assert "422" in err and "metric.terms.0.target" in err, err
    run_path_patch(page, "grid", corrupted="the dog sat")  # fewer tokens than the text
    err = page.inner_text("#pathpatch .panel-error")
    assert "pairs.0" in err and "same token count" in err, err
    run_path_patch(page, "grid", positions="last")
    assert "positions" in page.inner_text("#pathpatch .panel-error")
    run_path_patch(page, "grid", corrupted=CLEAN)
    msg = page.inner_text("#pathpatch .pp-equal")
    assert "divides by zero" in msg and page.locator("#pathpatch table.pathgrid").count() == 0
    # the page still serves: a good request afterwards draws its grid
    run_path_patch(page, "grid")
    assert page.locator("#pathpatch td.effcell").count() == 48
    expected_422s(page, 2)  # (the positions are refused in the page, before a request)


# ---- the bundled Llama: kv labels ------------------------------------------------------------

def check_head_headers(page, kv) -> None:
    got = page.locator("#headgrid th.headcol").all_inner_texts()
    assert got == [head_name(h, kv) for h in range(len(kv))], got


def test_llama_kv_labels_in_the_path_patch_grid_and_the_heads_grid(llama_server, page):  # noqa: F811
    url = llama_server
    kv = httpx.get(url + "/v1/model").json()["attention"]["kv_head_of_query_head"]
    assert kv == [0, 0, 1, 1]
    open_explorer(page, url)
    page.wait_for_function("document.querySelector('#panel-heads').dataset.ready === '1'")
    check_head_headers(page, kv)
    # GQA: the k/v receivers are the 2 key/value heads (each reaches its group's query heads)
    kv_boxes = page.locator("#pp-receivers input.pp-recv[data-input='k'][data-layer='1']")
    assert kv_boxes.count() == 2 and kv_boxes.nth(1).get_attribute("data-axis") == "kv_head"
    run_path_patch(page, "grid")
    ref = ref_path_patch(url, grid=True)
    assert ref["grid"]["head_axes"] == {"q": "head", "k": "kv_head", "v": "kv_head"}
    check_grid(page, "#pathpatch", ref, kv)
    assert page.get_attribute("#pathpatch tr.pp-head-2 th.pp-colhead[data-col='5']", "title") == \
        "key/value head 1: read by query heads 2, 3"
    # one sender -> kv head 1's k input and query head 2's q input, as separate experiments
    page.click("#pp-pick summary")
    page.check("#pp-senders input.pp-send[data-kind='head'][data-layer='0'][data-head='3']")
    page.check("#pp-receivers input.pp-recv[data-input='k'][data-layer='1'][data-head='1']")
    page.check("#pp-receivers input.pp-recv[data-input='q'][data-layer='1'][data-head='2']")
    run_path_patch(page, "pairs")
    # (columns in the pickers' order: q's query heads, then k's key/value heads)
    assert page.locator("#pathpatch tr.pp-head-1 th.pp-colhead").all_inner_texts() == ["head 2 \u00b7 kv 1", "kv 1"]
    assert page.inner_text("#pathpatch th.pp-rowhead") == "L0 head 3 \u00b7 kv 1"
    for col, r in enumerate([{"kind": "head", "layer": 1, "heads": [2], "input": "q"},
                             {"kind": "head", "layer": 1, "heads": [1], "input": "k"}]):
        want = ref_path_patch(url, senders=[{"kind": "head", "layer": 0, "head": 3}], receivers=[r])
        got = page.get_attribute(f"#pathpatch td.effcell[data-col='{col}']", "data-value")
        assert float(got) == pytest.approx(want["normalized"], rel=1e-6), (col, got, want["normalized"])
    screenshot(page, "path-patch-llama", "#panel-pathpatch")
    screenshot(page, "heads-llama-kv", "#panel-heads")


def test_planted_wrong_kv_headers_fail(llama_server, page):  # noqa: F811
    url = llama_server
    kv = [0, 0, 1, 1]
    ref = ref_path_patch(url, grid=True)
    plant(page, url, "const name = byKv ? kvHeadName(h) : headName(h, kv);", "const name = byKv ? kvHeadName(h) : headName(h);")
    open_explorer(page, url)
    run_path_patch(page, "grid")
    assert "kv" in fails(check_grid, page, "#pathpatch", ref, kv)
    page.unroute("**/static/web/views.js")
    plant(page, url, 'text: kv ? headName(h, kv) : String(h) }', 'text: String(h) }')
    open_explorer(page, url)
    page.wait_for_function("document.querySelector('#panel-heads').dataset.ready === '1'")
    assert "head 0" in fails(check_head_headers, page, kv)


# ---- the notebook view ------------------------------------------------------------------------

def nb_show(page, html: str) -> None:
    asked = []
    page.route("http://**", lambda r: (asked.append(r.request.url), r.abort()))
    page.set_content(f"<!doctype html><html><body>{html}</body></html>")
    page.wait_for_selector(".attnscope-nb[data-ready='1']")
    assert asked == []


def test_notebook_path_patch_views(live_server, llama_server, page):  # noqa: F811
    from attnscope.client import Client, notebook

    page.set_viewport_size({"width": 1400, "height": 900})
    pair = [(CLEAN, CORRUPTED)]
    with Client(live_server.url) as c:
        grid = c.path_patch(pair, grid=True, metric=METRIC)
        single = c.path_patch(pair, senders=[(0, 1), 0], receivers=[(1, "v")], metric=METRIC,
                              per_pair=True)
        equal = c.path_patch([(CLEAN, CLEAN)], grid=True, metric=METRIC)
    nb_show(page, grid._repr_html_())
    check_grid(page, ".attnscope-nb", grid.model_dump(mode="json"))
    screenshot(page, "notebook-path-patch", ".attnscope-nb")
    nb_show(page, single._repr_html_())
    assert page.inner_text("td.pp-normalized") == fmt_num(single.normalized, 4)
    assert "L0 head 1, MLP 0" in page.inner_text(".pp-what") and "L1 heads 0, 1, 2, 3 v input" in page.inner_text(".pp-what")
    nb_show(page, equal._repr_html_())
    assert "divides by zero" in page.inner_text(".pp-equal") and page.locator("table.pathgrid").count() == 0
    with Client(llama_server) as c:
        info = c.model()
        g = c.path_patch(pair, grid=True, metric=METRIC)
    kv = info.attention.kv_head_of_query_head
    nb_show(page, notebook.to_html(g, kv_heads=info))
    check_grid(page, ".attnscope-nb", g.model_dump(mode="json"), kv)
    nb_show(page, g._repr_html_())  # no model info: heads named without kv
    assert "kv" in fails(check_grid, page, ".attnscope-nb", g.model_dump(mode="json"), kv)
    with pytest.raises(ValueError, match="entries for 4 query heads"):
        notebook.to_html(g, kv_heads=[0, 1])


# ---- a 3-layer grouped-query Llama: cells with no value, kv labels in the figure ----------------

@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """An in-process client of the real app on a random 3-layer Llama (4 query heads, 2 kv)."""
    from attnscope.client import Client
    from attnscope.service.config import Settings
    from attnscope.service.runtime import Runtime
    from conftest import _client
    from families import family_checkpoint

    d = family_checkpoint("llama", tmp_path_factory.mktemp("llama3"), num_hidden_layers=3)
    rt = Runtime.load(Settings(model=str(d)))
    with _client(rt, model=str(d)) as tc:
        yield Client("http://testserver", http_client=tc, max_retries=0)


def test_three_layer_gqa_grid_in_the_notebook_and_the_figure(llama3, page):
    from attnscope.client import notebook, plots
    from test_plots import check_path_patch_figure

    info = llama3.model()
    kv = info.attention.kv_head_of_query_head
    assert kv == [0, 0, 1, 1] and info.n_layers == 3
    res = llama3.path_patch([(CLEAN, CORRUPTED)], grid=True, metric=METRIC)
    ref = res.model_dump(mode="json")
    page.set_viewport_size({"width": 1400, "height": 900})
    nb_show(page, notebook.to_html(res, kv_heads=info))
    check_grid(page, ".attnscope-nb", ref, kv)
    # sender L1 -> receiver L1: no value (hatched, said on hover and in the colour bar's key)
    na = page.locator(".attnscope-nb td.effcell.na")
    assert na.count() == 4 * (4 + 2 + 2)  # sender L1 x receiver L1's q (4 heads), k and v (2 kv heads)
    assert "not after the sender" in na.first.get_attribute("title")
    assert "n/a" in page.inner_text(".attnscope-nb .cbar-row")
    screenshot(page, "notebook-path-patch-llama3", ".attnscope-nb")
    fig = plots.path_patch_grid(res, kv_heads=info)
    check_path_patch_figure(fig, res, kv=kv)
    with pytest.raises(AssertionError):  # the same figure read as a model without GQA
        check_path_patch_figure(fig, res, kv=None)


def test_notebook_heads_kv_headers_and_a_dataset_grid(llama_server, page):  # noqa: F811
    """The heads notebook view names kv groups per column given the model; a grid over two pairs
    says the pair count and each cell's sample std over the pairs (on hover)."""
    from attnscope.client import Client, notebook

    page.set_viewport_size({"width": 1400, "height": 900})
    with Client(llama_server) as c:
        info = c.model()
        heads = c.heads(CLEAN)
        res = c.path_patch([(CLEAN, CORRUPTED), ("the cat sat on the mat and the dog sat", CORRUPTED)],
                           grid=True, metric=METRIC)
    kv = info.attention.kv_head_of_query_head
    nb_show(page, notebook.to_html(heads, kv_heads=info))
    assert page.locator(".nb-grid th.headcol").all_inner_texts() == [head_name(h, kv) for h in range(4)]
    nb_show(page, heads._repr_html_())  # no model info: plain head numbers
    assert page.locator(".nb-grid th.headcol").all_inner_texts() == ["0", "1", "2", "3"]
    ref = res.model_dump(mode="json")
    nb_show(page, notebook.to_html(res, kv_heads=info))
    check_grid(page, ".attnscope-nb", ref, kv)
    assert "over 2 pairs" in page.inner_text(".pp-head-note") and "2 prompt pairs" in page.inner_text(".attnscope-nb")
    g = ref["grid"]
    cell = page.locator(".attnscope-nb td.effcell[data-sender='0.1'][data-receiver='1.1'][data-input='k']")
    k = g["inputs"].index("k")
    assert f"\u00b1 {fmt_num(g['std'][0][1][1][1][k], 2)}" in cell.get_attribute("title")
    assert f"\u00b1 {fmt_num(ref['base']['std'], 2)}" in page.inner_text(".pp-head-note")
