"""The client's figures, rendered headless (Agg) to PNG from real responses of the in-process
app, checked for size and content."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from attnscope.client import Client, plots
from conftest import SENTENCE

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def api(client):
    return Client("http://testserver", http_client=client, max_retries=0)


ARTIFACTS = Path(__file__).resolve().parent / "artifacts" / "plots"  # gitignored, to look at


def _png(fig, path):
    fig.savefig(path, dpi=80)
    data = path.read_bytes()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / path.name).write_bytes(data)
    assert data[:8] == PNG and len(data) > 5_000
    w, h = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    return w, h


def _pixel(fig, ax, x, y):
    """RGBA of the rendered figure at data coordinates (x, y) of ``ax``."""
    fig.canvas.draw()
    buf = np.asarray(fig.canvas.buffer_rgba())
    px, py = ax.transData.transform((x, y))
    return buf[int(round(buf.shape[0] - py)), int(round(px))]


def test_heatmap_one_tick_per_token_and_blank_upper_triangle(api, tmp_path):
    res = api.attention(SENTENCE, layers=[0])
    tokens = res.attention.tokens
    n = len(tokens)
    fig = plots.attention_heatmap(res, layer=0, head=1)
    ax = fig.axes[0]
    xt = [t.get_text() for t in ax.get_xticklabels()]
    yt = [t.get_text() for t in ax.get_yticklabels()]
    assert xt == yt == [repr(t.label) for t in tokens] and len(xt) == n
    assert ax.images[0].get_array().mask[0, n - 1] and not ax.images[0].get_array().mask[n - 1, 0]
    w, h = _png(fig, tmp_path / "heat.png")
    assert w > 300 and h > 300
    # masked: hatched (grey lines on white), not the near-white of a zero weight
    fig.canvas.draw()
    buf = np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(int)
    (x0, y0), (x1, y1) = ax.transData.transform([(n - 1.5, 0.5), (n - 2.5, 1.5)])
    H = buf.shape[0]
    cell = buf[int(H - y0):int(H - y1), int(x1):int(x0)].reshape(-1, 3)
    assert (cell == 255).all(axis=1).any() and (np.abs(cell - 176) < 30).all(axis=1).any()
    assert tuple(_pixel(fig, ax, 0, 0)[:3]) != (255, 255, 255)  # query 0 -> key 0 is 1.0
    # the plotted matrix is the head's pattern
    np.testing.assert_allclose(ax.images[0].get_array().data, res.attention.pattern.numpy()[0, 1],
                               atol=1e-6)


def test_heatmap_of_encoder_keeps_full_matrix(bert_client, tmp_path):
    api = Client("http://testserver", http_client=bert_client, max_retries=0)
    res = api.attention("The cat sat on the mat.", layers=[0], head_mean=True)
    fig = plots.attention_heatmap(res)
    mask = np.ma.getmaskarray(fig.axes[0].images[0].get_array())
    assert not mask.any()
    _png(fig, tmp_path / "bert.png")


def test_layer_grid_and_head_grid(api, tmp_path):
    res = api.attention(SENTENCE)
    fig = plots.layer_grid(res)
    visible = [a for a in fig.axes if a.images]
    assert [a.get_title() for a in visible] == ["Layer 0", "Layer 1"]
    np.testing.assert_allclose(visible[1].images[0].get_array().data,
                               res.attention.pattern.numpy()[1].mean(0), atol=1e-6)
    _png(fig, tmp_path / "layers.png")
    fig = plots.head_grid(res, layer=1)
    assert [a.get_title() for a in fig.axes if a.images] == [f"Head {h}" for h in range(4)]
    assert fig.get_suptitle().endswith("Attention heads at layer 1")
    _png(fig, tmp_path / "heads.png")
    with pytest.raises(ValueError):
        plots.head_grid(api.attention("a b", head_mean=True))


def test_trajectory_plot_labels_first_middle_last(api, tmp_path):
    res = api.trajectories(SENTENCE, include_final=True, positions=[8, 9, 10])
    tr = res.trajectories
    fig = plots.trajectory_plot(res)
    ax = fig.axes[0]
    assert len(ax.lines) == 3
    texts = [t.get_text() for t in ax.texts]
    n_state = len(tr.states)
    expected_states = sorted({0, n_state // 2, n_state - 1})
    for pos in [8, 9, 10]:
        assert repr(tr.tokens[pos].label) in texts
    assert texts.count(str(tr.states[-1])) >= 3 and texts.count(str(tr.states[0])) >= 3
    assert len(texts) == 3 * (len(expected_states) + 1)
    np.testing.assert_allclose(ax.lines[0].get_xydata(), tr.paths.numpy()[0, :, :2], atol=1e-6)
    _png(fig, tmp_path / "paths.png")


def test_distance_bars(api, tmp_path):
    res = api.trajectories(SENTENCE)
    tr = res.trajectories
    fig = plots.distance_bars(res)
    ax = fig.axes[0]
    heights = [p.get_height() for p in ax.patches]
    np.testing.assert_allclose(heights, tr.distance_projected, rtol=1e-6)
    assert [t.get_text() for t in ax.get_xticklabels()] == [repr(t.label) for t in tr.tokens]
    _png(fig, tmp_path / "bars.png")


def test_head_classification_grid(api, tmp_path):
    res = api.heads(SENTENCE + " " + SENTENCE)
    fig = plots.head_classification_grid(res)
    ax = fig.axes[0]
    codes = ax.images[0].get_array()
    assert codes.shape == (2, 4)
    cell_text = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text()
                 for t in ax.texts}
    for h in res.heads:
        assert cell_text[(h.layer, h.head)] == h.label
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert sorted(legend) == sorted({h.label for h in res.heads})
    # same label, same colour; different labels, different colours
    rgba = ax.images[0].cmap(ax.images[0].norm(codes.data))
    by_label = {}
    for h in res.heads:
        by_label.setdefault(h.label, set()).add(tuple(np.round(rgba[h.layer, h.head], 4)))
    assert all(len(v) == 1 for v in by_label.values())
    assert len({next(iter(v)) for v in by_label.values()}) == len(by_label)
    _png(fig, tmp_path / "classes.png")


# ---- honest figures (issue 14): fixed 0..1 scale, labelled and shared colour bars, no empty
# panels, readable ticks, titles naming model and text, trajectory arrows and explained variance

MODEL = "attnscope-tiny-gpt2"


def _colourbars(fig):
    return [a for a in fig.axes if a.get_label() == "<colorbar>"]


def _panels(fig):
    return [a for a in fig.axes if a.get_label() != "<colorbar>"]


def _fonts(ax):
    return [t.get_fontsize() for t in ax.get_xticklabels() + ax.get_yticklabels()
            if t.get_text()]


def test_heatmap_colour_scale_is_0_to_1_labelled_never_a_percentile(api, tmp_path):
    res = api.attention(SENTENCE, layers=[1])
    m = res.attention.pattern.numpy()[0, 2]
    fig = plots.attention_heatmap(res, layer=1, head=2)
    ax = _panels(fig)[0]
    im = ax.images[0]
    assert (im.norm.vmin, im.norm.vmax) == (0.0, 1.0)
    (cb,) = _colourbars(fig)
    assert cb.get_ylim() == (0.0, 1.0)
    assert "attention weight (post-softmax)" in cb.get_ylabel() and "masked" in cb.get_ylabel()
    title = ax.get_title()
    assert MODEL in title and "Then I tried" in title and "layer 1, head 2" in title
    assert min(_fonts(ax)) >= 8
    # a cell below the old 98th-percentile clip is not saturated: colour = cmap(value)
    q, k = np.unravel_index(np.argmax(np.where(np.tril(np.ones_like(m)) > 0, m, -1)), m.shape)
    want = im.cmap(float(m[q, k]))
    np.testing.assert_allclose(im.cmap(im.norm(m[q, k])), want, atol=1e-9)
    _png(fig, tmp_path / "heat01.png")
    # scores are not patterns: the true min..max, no clip
    sc = api.attention(SENTENCE, layers=[0], include_scores=True).attention.scores.numpy()[0, 0]
    fig = plots.attention_heatmap(sc, labels=[repr(t.label) for t in res.attention.tokens])
    im = _panels(fig)[0].images[0]
    fin = sc[np.isfinite(sc)]
    assert (im.norm.vmin, im.norm.vmax) == (pytest.approx(fin.min()), pytest.approx(fin.max()))
    assert "value" in _colourbars(fig)[0].get_ylabel()


def test_grids_share_one_scale_and_one_colour_bar_without_empty_panels(api, tmp_path):
    res = api.attention(SENTENCE)
    for fig, n in ((plots.head_grid(res, layer=0), 4), (plots.layer_grid(res), 2),
                   (plots.head_grid(res, layer=1, ncols=3), 4)):
        panels = _panels(fig)
        assert len(panels) == n and all(a.get_visible() and a.images for a in panels)
        assert {(a.images[0].norm.vmin, a.images[0].norm.vmax) for a in panels} == {(0.0, 1.0)}
        (cb,) = _colourbars(fig)  # exactly one
        assert cb.get_ylim() == (0.0, 1.0) and "attention weight" in cb.get_ylabel()
        assert MODEL in fig.get_suptitle() and "Then I tried" in fig.get_suptitle()
        assert min(f for a in panels for f in _fonts(a) or [99]) >= 8
        w, h = _png(fig, tmp_path / f"grid{n}.png")
    # 4 heads with ncols=3 are laid out 2 x 2: no hole
    fig = plots.head_grid(res, layer=1, ncols=3)
    rows = {round(a.get_position().y0, 3) for a in _panels(fig)}
    cols = {round(a.get_position().x0, 3) for a in _panels(fig)}
    assert (len(rows), len(cols)) == (2, 2)


def test_trajectory_arrows_and_explained_variance_on_the_axes(api, tmp_path):
    from matplotlib.patches import FancyArrowPatch

    res = api.trajectories(SENTENCE, include_final=True, positions=[8, 9, 10])
    tr = res.trajectories
    fig = plots.trajectory_plot(res)
    ax = fig.axes[0]
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    assert len(arrows) == 3 * (len(tr.states) - 1)
    evr = tr.explained_variance_ratio
    assert ax.get_xlabel() == f"PC 1 ({100 * evr[0]:.1f} % of variance)"
    assert ax.get_ylabel() == f"PC 2 ({100 * evr[1]:.1f} % of variance)"
    assert MODEL in ax.get_title() and "Then I tried" in ax.get_title()
    _png(fig, tmp_path / "arrows.png")
    fig = plots.distance_bars(res)
    assert MODEL in fig.axes[0].get_title()
    assert min(_fonts(fig.axes[0])) >= 8


def test_head_classification_title_names_model_and_texts(api, tmp_path):
    res = api.heads(SENTENCE)
    fig = plots.head_classification_grid(res)
    title = fig.axes[0].get_title()
    assert MODEL in title and f"1 text, {res.n_tokens[0]} tokens" in title
    assert min(t.get_fontsize() for t in fig.axes[0].texts) >= 8


@pytest.fixture
def llama_api(make_client):
    from attnscope.service.config import Settings
    from attnscope.service.runtime.model import Runtime

    rt = Runtime.load(Settings(model="bundled-llama"))
    return Client("http://testserver", http_client=make_client(rt), max_retries=0)


def test_head_grid_labels_key_value_groups_on_the_bundled_llama(llama_api, api, tmp_path):
    """Bundled Llama: 4 query heads, 2 key/value heads; query head h reads kv head h // 2."""
    info = llama_api.model()
    res = llama_api.attention(SENTENCE)
    fig = plots.head_grid(res, layer=1, kv_heads=info)
    titles = [a.get_title() for a in fig.axes if a.images]
    assert titles == ["Head 0 \u00b7 kv 0", "Head 1 \u00b7 kv 0", "Head 2 \u00b7 kv 1",
                      "Head 3 \u00b7 kv 1"]
    assert fig.get_suptitle().endswith("(2 query heads per key/value head)")
    _png(fig, tmp_path / "llama-heads.png")
    # the same from n_kv_heads or the map itself; a head subset keeps the model's mapping
    assert [a.get_title() for a in plots.head_grid(res, layer=1, kv_heads=2).axes if a.images] == titles
    sub = llama_api.attention(SENTENCE, heads=[3])
    assert [a.get_title() for a in plots.head_grid(sub, layer=0, kv_heads=info).axes
            if a.images] == ["Head 3 \u00b7 kv 1"]
    fig = plots.attention_heatmap(res, layer=0, head=2, kv_heads=info)
    assert fig.axes[0].get_title().endswith("(layer 0, head 2 \u00b7 kv 1)")
    with pytest.raises(ValueError, match="does not divide"):
        plots.head_grid(res, layer=1, kv_heads=3)
    # GPT-2 (no GQA): nothing to label
    g = api.attention(SENTENCE)
    assert [a.get_title() for a in plots.head_grid(g, layer=1, kv_heads=api.model()).axes
            if a.images] == [f"Head {h}" for h in range(4)]


# ---- path patching (/v1/path-patch grid) ------------------------------------------------------

PP_CLEAN = "the cat sat on the mat and the cat sat"
PP_CORRUPTED = "the dog sat on the mat and the cat sat"
PP_METRIC = {"kind": "logit_diff", "terms": [{"position": -1, "target": " on", "distractor": " the"}]}


def check_path_patch_figure(fig, res, value="normalized", kv=None):
    """The figure's image is the grid: row (sender layer, head) of layers 0..L-2, column
    (receiver layer, head, input) of layers 1..L-1, each cell the response's own value (blank
    where the receiver is not after the sender); tick labels name them (kv heads on GQA)."""
    g = res.grid
    L, H, inputs = len(g.raw), len(g.raw[0]), g.inputs
    axes, n = g.head_axes or {}, g.receiver_heads or {}
    gqa = any(axes.get(x) == "kv_head" for x in inputs)
    kvs = (lambda h: "") if kv is None else (lambda h: f" kv {kv[h]}")
    if gqa:  # k/v receivers are key/value heads: columns layer, input, head
        cols = [(l, h, k, f"L{l} {'kv ' + str(h) if axes[x] == 'kv_head' else f'H{h}{kvs(h)}'} {x}")
                for l in range(1, L) for k, x in enumerate(inputs) for h in range(n[x])]
    else:
        cols = [(l, h, k, f"L{l} H{h}{kvs(h)} {x}") for l in range(1, L) for h in range(H)
                for k, x in enumerate(inputs)]
    ax = fig.axes[0]
    img = ax.images[0].get_array()
    assert img.shape == ((L - 1) * H, len(cols)), img.shape
    src = g.normalized if value == "normalized" else g.raw
    for r, (ls, hs) in enumerate((l, h) for l in range(L - 1) for h in range(H)):
        for c, (lr, hr, k, _) in enumerate(cols):
            want = src[ls][hs][lr][hr][k]
            if want is None:
                assert img.mask[r, c], (r, c)
                continue
            want = want if value == "normalized" else want - res.base.mean
            assert not img.mask[r, c] and img[r, c] == pytest.approx(want, rel=1e-6, abs=1e-9), (r, c)
    assert [t.get_text() for t in ax.get_yticklabels()] == \
        [f"L{l} H{h}{kvs(h)}" for l in range(L - 1) for h in range(H)]
    assert [t.get_text() for t in ax.get_xticklabels()] == [c[3] for c in cols]


def test_path_patch_grid_figure(api, tmp_path, monkeypatch):
    pair = [(PP_CLEAN, PP_CORRUPTED)]
    res = api.path_patch(pair, grid=True, metric=PP_METRIC)
    fig = plots.path_patch_grid(res)
    check_path_patch_figure(fig, res)
    title = fig.axes[0].get_title()
    assert "attnscope-tiny-gpt2" in title and f"{res.base.mean:.4g}" in title and "1 pair" in title
    assert "(patched - base) / (other - base)" in fig.axes[1].get_ylabel()
    w, h = _png(fig, tmp_path / "path-patch-grid.png")
    assert w > 500 and h > 250
    check_path_patch_figure(plots.path_patch_grid(res, value="change"), res, value="change")
    # a planted fault (two receiver columns swapped before drawing) fails the check
    real = plots._diverging

    def swapped(a, *args, **kw):
        a = a.copy()
        a[:, [0, 1]] = a[:, [1, 0]]
        return real(a, *args, **kw)

    monkeypatch.setattr(plots, "_diverging", swapped)
    with pytest.raises(AssertionError):
        check_path_patch_figure(plots.path_patch_grid(res), res)
    monkeypatch.undo()
    # bad input: said, never an empty figure
    single = api.path_patch(pair, senders=[(0, 1)], receivers=["logits"], metric=PP_METRIC)
    with pytest.raises(ValueError, match="no grid"):
        plots.path_patch_grid(single)
    with pytest.raises(ValueError, match="'normalized' or 'change'"):
        plots.path_patch_grid(res, value="raw")
    equal = api.path_patch([(PP_CLEAN, PP_CLEAN)], grid=True, metric=PP_METRIC)
    with pytest.raises(ValueError, match="divides by zero"):
        plots.path_patch_grid(equal)
    check_path_patch_figure(plots.path_patch_grid(equal, value="change"), equal, value="change")
    with pytest.raises(ValueError, match="does not divide"):
        plots.path_patch_grid(res, kv_heads=3)
