"""The client's figures, rendered headless (Agg) to PNG from real responses of the in-process
app, checked for size and content."""

from __future__ import annotations

import numpy as np
import pytest

from attnscope.client import Client, plots
from conftest import SENTENCE

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def api(client):
    return Client("http://testserver", http_client=client, max_retries=0)


def _png(fig, path):
    fig.savefig(path, dpi=80)
    data = path.read_bytes()
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
    assert tuple(_pixel(fig, ax, n - 1, 0)[:3]) == (255, 255, 255)  # masked: blank
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
    visible = [a for a in fig.axes if a.get_visible()]
    assert [a.get_title() for a in visible] == ["Layer 0", "Layer 1"]
    np.testing.assert_allclose(visible[1].images[0].get_array().data,
                               res.attention.pattern.numpy()[1].mean(0), atol=1e-6)
    _png(fig, tmp_path / "layers.png")
    fig = plots.head_grid(res, layer=1)
    assert [a.get_title() for a in fig.axes if a.get_visible()] == [f"Head {h}" for h in range(4)]
    assert fig.get_suptitle() == "Attention Heads at Layer 1"
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
    assert texts.count(str(tr.states[-1])) == 3 and texts.count(str(tr.states[0])) == 3
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
