"""The figures of the source documents, from a response, in one call (extra ``[plot]``).

Source: 000_1c89b6c8c2a32040.txt (heat map of one attention matrix with the masked upper
triangle left blank, "Layerwise Attention Weights" grid, "Attention Heads at Layer 2" grid,
"Layer-by-layer Token Representation Trajectories" with first/middle/last state labels, "How
Far Did Each Token Move?" bars) and 004_e7341cee07d297e4.txt (head classification: a
layer x head grid coloured by label). seaborn is not needed: matplotlib's ``imshow`` with
a masked array leaves masked cells blank, as ``sns.heatmap(mask=...)`` does.

Every function returns a :class:`matplotlib.figure.Figure` built without pyplot on the Agg
canvas (headless, no global state); save it with ``fig.savefig("x.png")``. In a notebook the
returned Figure displays itself. Token labels are ``repr(label)`` as in the source
(``' my'`` shows its leading space).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "attnscope.client.plots needs matplotlib: pip install matplotlib (the 'plot' extra of attnscope or attnscope-client)"
    ) from exc

from ._kv import kv_head_map  # noqa: F401  (public here: plots.kv_head_map)
from ._tensors import to_numpy

__all__ = [
    "attention_heatmap",
    "layer_grid",
    "head_grid",
    "trajectory_plot",
    "distance_bars",
    "head_classification_grid",
    "token_labels",
]


def _new_figure(figsize) -> Figure:
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


PATTERN_LABEL = "attention weight (post-softmax)"
MASK_HATCH = "#b0b0b0"
"""Colour of the hatching that marks masked cells (future keys of a causal model)."""
TICK_FONT = 9.0
"""Smallest tick-label size in points (readable at 100 % on a printed page or a screen)."""
MAX_TICK_LABELS = 40
"""Above this many tokens an axis labels every n-th token only (the rest would overlap)."""


def _unwrap(obj: Any, *fields: str) -> Any:
    """A response -> its single result (``attention``/``trajectories``/... or ``results[0]``)."""
    for f in fields:
        v = getattr(obj, f, None)
        if v is not None:
            return v
    results = getattr(obj, "results", None)
    if results:
        return results[0]
    return obj


def _model_id(obj: Any) -> str | None:
    """The model id a response names (``model.id``), or None for a bare result / array."""
    m = getattr(obj, "model", None)
    if m is None and isinstance(obj, dict):
        m = obj.get("model")
    if m is None:
        return None
    return str(m["id"] if isinstance(m, dict) else getattr(m, "id", m))


def _text_of(tokens: Sequence[Any]) -> str:
    """The analysed text as its non-special tokens spell it (their labels joined)."""
    parts = []
    for t in tokens:
        if isinstance(t, str):
            parts.append(t)
            continue
        get = (lambda k: t.get(k)) if isinstance(t, dict) else (lambda k: getattr(t, k, None))
        if not get("special"):
            parts.append(str(get("label")))
    return "".join(parts).strip()


def _short(text: str, n: int = 44) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "\u2026"


def _headline(model: str | None, text: str | None) -> str:
    """'model · “text”' (what every figure's title starts with), parts that are known."""
    parts = [p for p in (model, f"\u201c{_short(text)}\u201d" if text else None) if p]
    return " \u00b7 ".join(parts)


def token_labels(tokens: Sequence[Any]) -> list[str]:
    """``repr`` of each token's label (schema ``Token`` objects, dicts or strings)."""
    out = []
    for t in tokens:
        label = t if isinstance(t, str) else (t["label"] if isinstance(t, dict) else t.label)
        out.append(repr(label))
    return out


def _arr(v: Any) -> np.ndarray:
    """A tensor field (any wire form; binary refs carry their arrays) as an ndarray."""
    return v.numpy() if hasattr(v, "numpy") else to_numpy(v)


def _is_causal(m: np.ndarray) -> bool:
    """A pattern whose strict upper triangle is all zero comes from a causal model."""
    if m.shape[-1] < 2:
        return False
    return bool(np.all(np.triu(np.nan_to_num(m, neginf=0.0), k=1) == 0.0))


def _limits(mats: Sequence[np.ndarray], vmin: float | None, vmax: float | None):
    """Colour limits shared by every panel: 0..1 for attention patterns (all values in [0, 1]);
    otherwise the true finite min and max (e.g. pre-softmax scores). Never a percentile clip."""
    finite = [m[np.isfinite(m)] for m in mats]
    finite = np.concatenate([f.ravel() for f in finite]) if finite else np.zeros(0)
    is_pattern = finite.size == 0 or (finite.min() >= 0.0 and finite.max() <= 1.0)
    lo = vmin if vmin is not None else (0.0 if is_pattern else float(finite.min()))
    hi = vmax if vmax is not None else (1.0 if is_pattern else float(finite.max()))
    if hi <= lo:
        hi = lo + 1e-9
    return lo, hi, is_pattern


def _ticks(ax, labels: list[str] | None, n_q: int, n_k: int, fontsize: float):
    step = max(1, -(-max(n_q, n_k) // MAX_TICK_LABELS))
    ax.set_xticks(range(0, n_k, step))
    ax.set_yticks(range(0, n_q, step))
    if labels is not None:
        ax.set_xticklabels(labels[:n_k][::step], rotation=90, fontsize=fontsize)
        ax.set_yticklabels(labels[:n_q][::step], fontsize=fontsize)
    else:
        ax.tick_params(labelsize=fontsize)


def _draw(ax, m: np.ndarray, labels: list[str] | None, causal: bool | None, title: str | None,
          lo: float, hi: float, fontsize: float = TICK_FONT, ylabel: bool = True):
    m = np.asarray(m, dtype=np.float64)
    if causal is None:
        causal = _is_causal(m)
    mask = ~np.isfinite(m)
    if causal:
        mask |= np.triu(np.ones(m.shape, dtype=bool), k=1)
    data = np.ma.masked_array(m, mask=mask)
    im = ax.imshow(data, cmap=_blues(), vmin=lo, vmax=hi, interpolation="nearest")
    if mask.any():  # masked cells are transparent: the hatched background shows, unlike a 0
        ax.patch.set_facecolor("white")
        ax.patch.set_hatch("////")
        ax.patch.set_edgecolor(MASK_HATCH)
    n_q, n_k = m.shape
    _ticks(ax, labels, n_q, n_k, fontsize)
    ax.set_xlabel("key")
    if ylabel:
        ax.set_ylabel("query")
    if title:
        ax.set_title(title, fontsize=10)
    return im, bool(mask.any())


def _blues():
    import matplotlib

    return matplotlib.colormaps["Blues"].with_extremes(bad=(1, 1, 1, 0))  # masked: blank


def _colourbar(fig, im, axes, is_pattern: bool, masked: bool, label: str | None = None):
    cb = fig.colorbar(im, ax=axes, shrink=0.85)
    text = label or (PATTERN_LABEL if is_pattern else "value")
    if masked:
        text += "\n(hatched = masked: future key)"
    cb.set_label(text)
    cb.ax.tick_params(labelsize=TICK_FONT)
    return cb


def _pattern(result: Any):
    res = _unwrap(result, "attention")
    p = _arr(res.pattern)
    return (p, bool(res.head_mean), list(res.layers), list(res.heads), token_labels(res.tokens),
            _headline(_model_id(result), _text_of(res.tokens)))


def _kv_suffix(kv: list[int] | None, head: int) -> str:
    return "" if kv is None else f" \u00b7 kv {kv[head]}"


def attention_heatmap(result: Any, layer: int | None = None, head: int | None = None, *,
                      labels: Sequence[str] | None = None, causal: bool | None = None,
                      title: str | None = None, vmin: float | None = None,
                      vmax: float | None = None, figsize=(6.5, 6),
                      kv_heads: Any = None) -> Figure:
    """Heat map of one attention matrix ``[query_pos, key_pos]`` with one labelled tick per
    token on each axis (every n-th above 40 tokens); for a causal model the masked upper
    triangle is left blank (said on the colour bar).

    The colour scale is 0..1 for a pattern (weights are fractions of the row's attention
    mass), the true min..max otherwise (e.g. scores); ``vmin``/``vmax`` override it. Nothing
    is clipped to a percentile. The title names the model and the text (from a response).

    Args:
        result: an ``AttentionResponse``/``AttentionResult``, or a 2-D array (then give
            ``labels``).
        layer: a layer index present in ``result.layers`` (default: the first returned).
        head: a head index in ``result.heads``; None = the mean over the returned heads (or
            the head mean the server computed).
        causal: blank the strict upper triangle; None = infer (it is all zero).
        kv_heads: grouped-query attention: the model's query head -> key/value head map
            (:func:`kv_head_map`: ``client.model()``, its ``attention.kv_head_of_query_head``
            or ``n_kv_heads``); the title then says which key/value head ``head`` reads
            ("head 3 \u00b7 kv 1").

    Raises:
        ValueError: ``head`` given for a head-mean result; not a 2-D matrix.
    """
    if isinstance(result, (np.ndarray, list)):
        m = np.asarray(result, dtype=np.float64)
        lab = list(labels) if labels is not None else None
        name = title or "Attention weights"
    else:
        p, head_mean, layers, heads, lab, headline = _pattern(result)
        if labels is not None:
            lab = list(labels)
        li = layers.index(layer) if layer is not None else 0
        m = p[li]
        if head_mean or m.ndim == 2:
            if head is not None:
                raise ValueError("the result holds the head mean; request without head_mean "
                                 "to plot one head")
        elif head is None:
            m = m.mean(axis=0)
        else:
            m = m[heads.index(head)]
        kv = kv_head_map(kv_heads, _n_query_heads(kv_heads, heads)) if head is not None else None
        where = f"layer {layers[li]}" + (f", head {head}{_kv_suffix(kv, head)}" if head is not None
                                         else ", head mean")
        name = title or "\n".join(x for x in (headline, f"Attention weights ({where})") if x)
    if m.ndim != 2:
        raise ValueError(f"need a [query_pos, key_pos] matrix, got shape {list(m.shape)}")
    fig = _new_figure(figsize)
    ax = fig.add_subplot()
    lo, hi, is_pattern = _limits([m], vmin, vmax)
    im, masked = _draw(ax, m, lab, causal, name, lo, hi)
    _colourbar(fig, im, ax, is_pattern, masked)
    return fig


def _grid(mats: list[np.ndarray], titles: list[str], labels, causal, suptitle: str,
          ncols: int, vmin=None, vmax=None) -> Figure:
    """Panels on ONE colour scale with ONE colour bar; exactly len(mats) panels (no empty
    ones: the column count is the one <= ncols that leaves the fewest holes, and holes left
    are removed, not hidden)."""
    n = len(mats)
    if n == 0:
        raise ValueError("nothing to plot: the result holds no matrices")
    ncols = max(1, min(ncols, n))
    ncols = min(range(ncols, 0, -1), key=lambda c: (-(-n // c) * c - n, -c))
    nrows = -(-n // ncols)
    T = mats[0].shape[-1]
    side = 3.2 + 0.09 * min(T, MAX_TICK_LABELS)
    fig = _new_figure((side * ncols + 1.2, side * nrows + 1.6))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    flat = axes.ravel()
    lo, hi, is_pattern = _limits(mats, vmin, vmax)
    masked_any = False
    for i, (ax, m, t) in enumerate(zip(flat, mats, titles)):
        im, masked = _draw(ax, m, labels, causal, t, lo, hi, ylabel=i % ncols == 0)
        if i % ncols:
            ax.set_yticklabels([])
        if i // ncols != nrows - 1 and i + ncols < n:
            ax.set_xticklabels([])
            ax.set_xlabel("")
        masked_any |= masked
    for ax in flat[n:]:
        fig.delaxes(ax)
    _colourbar(fig, im, list(flat[:n]), is_pattern, masked_any)
    fig.suptitle(suptitle)
    return fig


def layer_grid(result: Any, head: int | None = None, *, causal: bool | None = None,
               ncols: int = 3, vmin: float | None = None, vmax: float | None = None) -> Figure:
    """One heat map per returned layer ("Layerwise attention weights"): the mean over the
    returned heads (as the source does) or one ``head``. One shared 0..1 scale, one colour bar;
    the title names the model and the text."""
    p, head_mean, layers, heads, lab, headline = _pattern(result)
    if head_mean:
        mats = [p[i] for i in range(len(layers))]
    elif head is None:
        mats = [p[i].mean(axis=0) for i in range(len(layers))]
    else:
        mats = [p[i, heads.index(head)] for i in range(len(layers))]
    what = "Layerwise attention weights" + (f" (head {head})" if head is not None
                                            else " (head mean)")
    sup = "\n".join(x for x in (headline, what) if x)
    return _grid(mats, [f"Layer {l}" for l in layers], lab, causal, sup, ncols, vmin, vmax)


def head_grid(result: Any, layer: int | None = None, *, causal: bool | None = None,
              ncols: int = 4, vmin: float | None = None, vmax: float | None = None,
              kv_heads: Any = None) -> Figure:
    """One heat map per returned head of one layer ("Attention heads at layer N"), on one
    shared 0..1 scale with one colour bar; the title names the model and the text.
    ``kv_heads`` (grouped-query attention; :func:`kv_head_map`): each panel also names the
    key/value head it reads ("Head 3 \u00b7 kv 1") and the title the grouping.

    Raises:
        ValueError: a head-mean result (no heads to show).
    """
    p, head_mean, layers, heads, lab, headline = _pattern(result)
    if head_mean:
        raise ValueError("the result holds the head mean; request without head_mean")
    li = layers.index(layer) if layer is not None else 0
    mats = [p[li, j] for j in range(len(heads))]
    kv = kv_head_map(kv_heads, _n_query_heads(kv_heads, heads))
    what = f"Attention heads at layer {layers[li]}"
    if kv is not None:
        what += f" ({len(kv) // len(set(kv))} query heads per key/value head)"
    sup = "\n".join(x for x in (headline, what) if x)
    return _grid(mats, [f"Head {h}{_kv_suffix(kv, h)}" for h in heads], lab, causal, sup, ncols,
                 vmin, vmax)


def _n_query_heads(kv_heads: Any, heads: list[int]) -> int:
    """The model's query-head count for :func:`kv_head_map`: from the model info / the list
    where given (a head subset may be plotted), else the returned heads (all of them)."""
    att = _get(kv_heads, "attention", None) if kv_heads is not None else None
    src = _get(att, "kv_head_of_query_head", None) if att is not None else kv_heads
    if src is not None and not isinstance(src, (int, np.integer)):
        return len(list(src))
    return max(heads) + 1 if heads else 0


def trajectory_plot(result: Any, positions: Sequence[int] | None = None, *,
                    figsize=(7.5, 7)) -> Figure:
    """Per-token paths through the layers in PCA space ("Layer-by-layer token representation
    trajectories"): one path per token with an arrow on every step (hidden state i -> i+1),
    the first, middle and last states labelled with their hidden-state index, the last point
    labelled with the token; each axis says how much of the (standardised) variance its
    component explains; the title names the model and the text.

    Args:
        result: a ``TrajectoriesResponse``/``TrajectoryResult`` (paths ``[token, state,
            component]``, at least 2 components).
        positions: token positions to draw (a subset of ``result.positions``); None = all.

    Raises:
        ValueError: fewer than 2 components.
    """
    from matplotlib.patches import FancyArrowPatch

    res = _unwrap(result, "trajectories")
    paths = _arr(res.paths)
    if paths.ndim != 3 or paths.shape[2] < 2:
        raise ValueError(f"need paths [token, state, >=2 components], got {list(paths.shape)}")
    lab = token_labels(res.tokens)
    order = list(res.positions)
    states = list(res.states)
    chosen = order if positions is None else list(positions)
    n_state = paths.shape[1]
    evr = list(res.explained_variance_ratio)
    fig = _new_figure(figsize)
    ax = fig.add_subplot()
    colours = [f"C{i % 10}" for i in range(len(chosen))]
    for pos, col in zip(chosen, colours):
        k = order.index(pos)
        x, y = paths[k, :, 0], paths[k, :, 1]
        ax.plot(x, y, marker="o", markersize=3, color=col, label=lab[pos], linewidth=1)
        for s in range(n_state - 1):
            ax.add_patch(FancyArrowPatch((x[s], y[s]), (x[s + 1], y[s + 1]),
                                         arrowstyle="-|>", mutation_scale=12, color=col,
                                         linewidth=1.2, shrinkA=0, shrinkB=2))
        for s in sorted({0, n_state // 2, n_state - 1}):
            ax.text(x[s], y[s], str(states[s]), ha="right", va="bottom", fontsize=8,
                    color="0.25")
        ax.text(x[-1], y[-1], lab[pos], ha="left", va="top", fontsize=TICK_FONT, color=col)
    headline = _headline(_model_id(result), _text_of(res.tokens))
    ax.set_title("\n".join(x for x in (headline, "Layer-by-layer token representation "
                                        f"trajectories (states {states[0]}..{states[-1]})") if x))
    ax.set_xlabel(f"PC 1 ({100 * evr[0]:.1f} % of variance)")
    ax.set_ylabel(f"PC 2 ({100 * evr[1]:.1f} % of variance)")
    ax.tick_params(labelsize=TICK_FONT)
    ax.legend(fontsize=8, loc="best", title="token", title_fontsize=8)
    return fig


def distance_bars(result: Any, kind: str = "projected", *, figsize=(8, 4.5)) -> Figure:
    """Start-to-end distance per token ("How far did each token move?"); the title names the
    model and the text.

    Args:
        kind: 'projected' (distance in PCA space, as the source) or 'full' (raw hidden states).
    """
    res = _unwrap(result, "trajectories")
    lab = token_labels(res.tokens)
    d = np.asarray(res.distance_projected if kind == "projected" else res.distance_full, float)
    names = [lab[p] for p in res.positions]
    fig = _new_figure(figsize)
    ax = fig.add_subplot()
    ax.bar(range(len(d)), d, color="tab:blue")
    ax.set_xticks(range(len(d)))
    ax.set_xticklabels(names, rotation=90, fontsize=TICK_FONT)
    ax.tick_params(axis="y", labelsize=TICK_FONT)
    headline = _headline(_model_id(result), _text_of(res.tokens))
    ax.set(title="\n".join(x for x in (headline, "How far did each token move?") if x),
           xlabel="Token",
           ylabel="Distance in PCA space (standardised)" if kind == "projected"
           else "Distance (model units)")
    return fig


LABEL_COLOURS = {
    "induction": "#d62728", "previous_token": "#1f77b4", "duplicate_token": "#9467bd",
    "next_token": "#17becf", "self": "#2ca02c", "sink": "#ff7f0e", "broad": "#bcbd22",
    "none": "#d9d9d9",
}
"""A fixed colour per head label (the labels of ``attnscope.schemas.heads.HeadLabel``), so
figures of different models compare at a glance; other labels get further colours."""
_SPARE = ["#8c564b", "#e377c2", "#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a"]


def head_classification_grid(result: Any = None, *, labels: Any = None,
                             figsize=None) -> Figure:
    """Layer x head grid, each cell coloured by the head's label (004_e7341cee07d297e4.txt's
    automatic head classification), the label written in the cell, a legend of labels.

    Args:
        result: a heads response/result whose ``heads`` items carry ``layer``, ``head`` and
            ``label``; or None and give ``labels``.
        labels: a ``[layer][head]`` nested list of label strings.
    """
    if labels is None:
        res = _unwrap(result, "classification", "heads_result")
        items = getattr(res, "heads", None)
        if items is None:
            raise ValueError("need a heads result (items with layer, head, label) or labels=")
        cells = {}
        for it in items:
            get = (lambda k: it[k]) if isinstance(it, dict) else (lambda k: getattr(it, k))
            cells[(int(get("layer")), int(get("head")))] = str(get("label"))
        n_l = max(l for l, _ in cells) + 1
        n_h = max(h for _, h in cells) + 1
        grid = [[cells.get((l, h), "") for h in range(n_h)] for l in range(n_l)]
    else:
        grid = [[str(x) for x in row] for row in labels]
        n_l, n_h = len(grid), max(len(r) for r in grid)
    names = sorted({x for row in grid for x in row if x}, key=lambda s: (s == "none", s))
    index = {n: i for i, n in enumerate(names)}
    codes = np.full((n_l, n_h), np.nan)
    for l in range(n_l):
        for h in range(len(grid[l])):
            if grid[l][h]:
                codes[l, h] = index[grid[l][h]]
    spare = iter(_SPARE * (1 + len(names) // len(_SPARE)))
    colours = [LABEL_COLOURS.get(n) or next(spare) for n in names]
    cmap = ListedColormap(colours or ["#ffffff"]).with_extremes(bad=(1, 1, 1, 0))
    fig = _new_figure(figsize or (max(4.0, 1.1 * n_h + 2.5), max(2.5, 0.8 * n_l + 1.5)))
    ax = fig.add_subplot()
    ax.imshow(np.ma.masked_invalid(codes), cmap=cmap, vmin=-0.5,
              vmax=max(len(names) - 0.5, 0.5), aspect="auto", interpolation="nearest")
    for l in range(n_l):
        for h in range(len(grid[l])):
            if grid[l][h]:
                ax.text(h, l, grid[l][h], ha="center", va="center", fontsize=8)
    ax.set_xticks(range(n_h))
    ax.set_xticklabels([str(h) for h in range(n_h)])
    ax.set_yticks(range(n_l))
    ax.set_yticklabels([str(l) for l in range(n_l)])
    what = "Head classification"
    n_texts = getattr(result, "n_texts", None)
    if n_texts is not None:
        n_tok = list(getattr(result, "n_tokens", []) or [])
        what += f" ({n_texts} text{'s' if n_texts != 1 else ''}, {sum(n_tok)} tokens)"
    ax.set(xlabel="head", ylabel="layer",
           title="\n".join(x for x in (_model_id(result), what) if x))
    ax.tick_params(labelsize=TICK_FONT)
    ax.legend(handles=[Patch(color=colours[i], label=n) for i, n in enumerate(names)],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="label")
    return fig


def effect_grid(grid: Any, *, title: str | None = None, label: str = "effect",
                text: str | None = None, model: str | None = None, annotate: bool | None = None,
                figsize=None) -> Figure:
    """An effect grid ``[layer, head]`` (an ablation scan's ``effect``, a patching response's
    ``heads``) as a diverging heat map centred on 0: blue below, red above, white at 0, the
    colour scale symmetric at the largest |value| (nothing clipped), a labelled colour bar,
    layer and head on the axes, the model and text in the title. ``grid`` may be nested
    lists with None (drawn blank: no scale) or an array; a ``PatchResponse`` / ``AblateResponse``
    is unwrapped (``heads`` / ``scan.effect``). ``annotate``: write the values in the cells
    (default when the grid has at most 16 x 16 cells)."""
    from matplotlib.colors import TwoSlopeNorm

    if hasattr(grid, "scan") and getattr(grid, "scan", None) is not None:
        model = model or grid.model.id
        grid = grid.scan.effect
    elif hasattr(grid, "heads") and hasattr(grid, "heads_raw"):
        model = model or grid.model.id
        if grid.clean_value == grid.corrupted_value:  # 0 / 0 everywhere: say so, draw no grid
            raise ValueError(
                f"the clean and corrupted runs give the same metric ({grid.clean_value!r}): the "
                "normalised effect (patched - corrupted) / (clean - corrupted) divides by zero, "
                "so no cell has a value; choose a corrupted prompt that changes the metric")
        grid = grid.heads
    if isinstance(grid, np.ndarray):
        a = grid.astype(float)
    else:
        a = np.array(grid, dtype=object)
        a = np.where(a == None, np.nan, a).astype(float)  # noqa: E711 (None = no value)
    if a.ndim != 2:
        raise ValueError(f"effect_grid draws a [layer, head] grid; got shape {a.shape}")
    n_l, n_h = a.shape
    finite = a[np.isfinite(a)]
    vmax = float(np.abs(finite).max()) if finite.size else 1.0
    vmax = vmax if vmax > 0 else 1.0
    fig = _new_figure(figsize or (max(4.0, 0.55 * n_h + 2.8), max(2.6, 0.45 * n_l + 1.8)))
    ax = fig.add_subplot()
    im = ax.imshow(np.ma.masked_invalid(a), cmap="RdBu_r",
                   norm=TwoSlopeNorm(vcenter=0.0, vmin=-vmax, vmax=vmax),
                   aspect="auto", interpolation="nearest")
    cb = fig.colorbar(im, ax=ax)
    cb.set_label(label)
    if annotate is None:
        annotate = n_l * n_h <= 256
    if annotate:
        for l in range(n_l):
            for h in range(n_h):
                if np.isfinite(a[l, h]):
                    ax.text(h, l, f"{a[l, h]:.2g}", ha="center", va="center", fontsize=7,
                            color="white" if abs(a[l, h]) > 0.6 * vmax else "black")
    ax.set_xticks(range(n_h))
    ax.set_xticklabels([str(h) for h in range(n_h)])
    ax.set_yticks(range(n_l))
    ax.set_yticklabels([str(l) for l in range(n_l)])
    ax.set(xlabel="head", ylabel="layer")
    parts = [p for p in (title, f"model {model}" if model else None) if p]
    if text:
        parts.append(text if len(text) <= 60 else text[:57] + "...")
    ax.set_title("\n".join(parts) or "effect grid", fontsize=9)
    return fig
__all__.append("effect_grid")


# -- contribution norms and rollout (Kobayashi et al. 2020; Abnar & Zuidema 2020) -----------
# (kept out of __all__ above so the list merges cleanly; add them there when merging)
__all__ += ["norm_heatmap", "rollout_heatmap"]

def norm_heatmap(norms: Any, attention: Any = None, layer: int | None = None,
                 head: int | None = None, *, title: str | None = None,
                 figsize=(11, 5.2)) -> Figure:
    """The contribution-norm heat map ``[query_pos, key_pos]`` of one layer, beside the
    attention-weight heat map of the same layer when ``attention`` is given (Kobayashi et al.
    2020, Fig. 1: weight vs ``||alpha f(x)||``).

    Args:
        norms: a ``NormsResponse`` / ``NormsResult`` (``/v1/attention-norms``).
        attention: an ``AttentionResponse`` / ``AttentionResult`` of the same text containing
            ``layer`` (optional): drawn on the left, the head's weights (or the head mean).
        layer: a layer in the norms' ``layers`` (default: the first returned).
        head: a head in the norms' ``heads``: its ``||alpha f(x)||``; None = ``summed``
            (``||sum_h alpha f(x)||``), beside the head mean of the weights.

    Each panel has its own colour scale (weights 0..1, norms 0..their max, in residual-stream
    units), labelled on its colour bar.

    Raises:
        ValueError: ``layer`` / ``head`` not in the result, or the needed field not returned.
    """
    res = _unwrap(norms, "norms")
    layers, heads = list(res.layers), list(res.heads)
    layer = layers[0] if layer is None else layer
    if layer not in layers:
        raise ValueError(f"layer {layer} not in the norms' layers {layers}")
    li = layers.index(layer)
    if head is None:
        if res.summed is None:
            raise ValueError("the norms response has no 'summed' (request summed=true)")
        m = _arr(res.summed)[li]
        what = "||Σ_h α f(x)||"
    else:
        if head not in heads or res.norms is None:
            raise ValueError(f"head {head} not in the norms' heads {heads} (or per_head was false)")
        m = _arr(res.norms)[li, heads.index(head)]
        what = f"head {head}: ||α f(x)||"
    labels = token_labels(res.tokens)
    panels = []
    if attention is not None:
        att = _unwrap(attention, "attention")
        p = _arr(att.pattern)
        a_layers = list(att.layers)
        if layer not in a_layers:
            raise ValueError(f"layer {layer} not in the attention's layers {a_layers}")
        w = p[a_layers.index(layer)]
        if not att.head_mean:
            a_heads = list(att.heads)
            w = w.mean(0) if head is None else w[a_heads.index(head)]
        panels.append((w, "attention weight α" + ("" if head is not None else " (head mean)"), 1.0))
    panels.append((m, what, float(np.nanmax(m)) if m.size else 1.0))
    fig = _new_figure(figsize if attention is not None else (6, 5.5))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (mat, name, vmax) in zip(axes, panels):
        im, masked = _draw(ax, mat, labels, None, f"layer {layer}, {name}", 0.0, vmax or 1.0)
        _colourbar(fig, im, ax, vmax == 1.0, masked,
                   label=name + ("" if vmax == 1.0 else " (0 .. max, residual-stream units)"))
    headline = _headline(_model_id(norms), _text_of(res.tokens))
    fig.suptitle(title or "\n".join(x for x in (
        headline, "Attention weight vs contribution norm (Kobayashi et al. 2020)") if x))
    return fig


def rollout_heatmap(result: Any, layer: int | None = None, *, flow: bool = False,
                    title: str | None = None, figsize=(6, 5.5)) -> Figure:
    """Token-by-token map of the rollout ``R_l`` (default: the last layer returned; rows =
    the token at layer l's output, columns = input tokens, colour 0..1, rows sum to 1), or of
    the attention flow with ``flow=True`` (Abnar & Zuidema 2020). A causal model's upper
    triangle is left blank.

    Raises:
        ValueError: ``layer`` not returned, or ``flow=True`` without flow in the result.
    """
    res = _unwrap(result, "rollout")
    if flow:
        if res.flow is None:
            raise ValueError("the rollout response has no flow (request flow=true)")
        layers, m = list(res.flow_layers), _arr(res.flow)
    else:
        layers, m = list(res.layers), _arr(res.rollout)
    layer = layers[-1] if layer is None else layer
    if layer not in layers:
        raise ValueError(f"layer {layer} not in the returned layers {layers}")
    fig = _new_figure(figsize)
    ax = fig.subplots()
    name = "attention flow" if flow else "attention rollout"
    headline = _headline(_model_id(result), _text_of(res.tokens))
    im, masked = _draw(ax, m[layers.index(layer)], token_labels(res.tokens), None,
                       title or "\n".join(x for x in (headline, f"{name} at layer {layer}") if x),
                       0.0, 1.0)
    _colourbar(fig, im, ax, True, masked, label="share of the input token (rows sum to 1)")
    return fig


# -- logit lens, direct logit attribution, composition, patching grids ----------------------
__all__ += ["logit_lens", "logit_attribution", "composition", "patch_per_position", "residual_grid"]


def _get(obj: Any, name: str, default: Any = None) -> Any:
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)


def _prompt(res: Any, prompt: int):
    prompts = _get(res, "prompts")
    if not prompts:
        raise ValueError("need a /v1/logit-lens or /v1/logit-attribution response (prompts)")
    if not 0 <= prompt < len(prompts):
        raise ValueError(f"prompt {prompt} is not in the response's {len(prompts)} prompts")
    return prompts[prompt]


def logit_lens(res: Any, prompt: int = 0, *, title: str | None = None, figsize=None) -> Figure:
    """The logit lens of one prompt (``/v1/logit-lens``): residual states (rows, forward order)
    x positions, each cell coloured by the probability of the state's top token (fixed 0..1,
    Blues) with that token written in it; a cell whose top token is the actual next token (or
    the request's target) is outlined. Title: model, text, normalisation."""
    p = _prompt(res, prompt)
    states = list(_get(p, "states"))
    labels = token_labels(_get(p, "tokens"))
    pos = [int(_get(x, "position")) for x in _get(states[0], "positions")]
    prob = np.array([[_get(_get(x, "top")[0], "prob") if _get(x, "top") else np.nan
                      for x in _get(s, "positions")] for s in states], float)
    fig = _new_figure(figsize or (max(6.0, 0.62 * len(pos) + 2.5), max(2.8, 0.42 * len(states) + 2.2)))
    ax = fig.add_subplot()
    im = ax.imshow(np.ma.masked_invalid(prob), cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto",
                   interpolation="nearest")
    for i, s in enumerate(states):
        for j, x in enumerate(_get(s, "positions")):
            top = _get(x, "top")
            if top:
                v = prob[i, j]
                ax.text(j, i, str(_get(top[0], "label"))[:8], ha="center", va="center",
                        fontsize=6.5, color="white" if v > 0.6 else "black")
            tg = _get(x, "target")
            if tg is not None and int(_get(tg, "rank")) == 0:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black",
                                       linewidth=1.2))
    ax.set_yticks(range(len(states)))
    ax.set_yticklabels([str(_get(s, "label")) for s in states], fontsize=TICK_FONT)
    step = max(1, -(-len(pos) // MAX_TICK_LABELS))
    ax.set_xticks(range(0, len(pos), step))
    ax.set_xticklabels([labels[q] for q in pos][::step], rotation=90, fontsize=TICK_FONT)
    ax.set(xlabel="position (input token)", ylabel="residual state")
    cb = fig.colorbar(im, ax=ax, shrink=0.9)
    cb.set_label("probability of the top token\n(outlined: it is the next token)")
    head = _headline(_model_id(res), _text_of(_get(p, "tokens")))
    ax.set_title(title or "\n".join(x for x in (head, f"logit lens (ln {_get(res, 'ln', '?')})") if x), fontsize=9)
    return fig


def logit_attribution(res: Any, prompt: int = 0, position: int = 0, *, order: str = "layer",
                      title: str | None = None, figsize=None) -> Figure:
    """Direct logit attribution (``/v1/logit-attribution``) at one of the prompt's positions: a
    horizontal bar per component (embed, pos_embed, every head, each layer's b_O and MLP),
    ``order`` 'layer' or 'value' (by |part|), red above 0 and blue below; the sum of the parts,
    ln_final's bias term and the model's logit difference in the title."""
    if order not in ("layer", "value"):
        raise ValueError(f"order is 'layer' or 'value', not {order!r}")
    p = _prompt(res, prompt)
    ps = list(_get(p, "positions"))
    if not 0 <= position < len(ps):
        raise ValueError(f"position index {position} is not in the prompt's {len(ps)} positions")
    d = ps[position]
    items = [("embed", _get(d, "embed"))]
    if _get(d, "pos_embed") is not None:  # null on the rotary families (RoPE)
        items.append(("pos_embed", _get(d, "pos_embed")))
    bias = _get(d, "attn_bias")  # null: a model without b_O
    for l, row in enumerate(_get(d, "heads")):
        items += [(f"L{l}H{h}", v) for h, v in enumerate(row)]
        if bias is not None:
            items.append((f"L{l} b_O", bias[l]))
        items.append((f"L{l} MLP", _get(d, "mlp")[l]))
    if order == "value":
        items.sort(key=lambda x: -abs(x[1]))
    names, vals = [n for n, _ in items], np.array([v for _, v in items], float)
    fig = _new_figure(figsize or (7.5, max(3.0, 0.16 * len(items) + 1.8)))
    ax = fig.add_subplot()
    ax.barh(range(len(items)), vals, color=np.where(vals >= 0, "#b2182b", "#2166ac"))
    ax.axvline(0, color="#555", linewidth=0.8)
    ax.set_yticks(range(len(items)))
    ax.set_yticklabels(names, fontsize=max(5.0, min(TICK_FONT, 600 / max(1, len(items)))))
    ax.invert_yaxis()
    m = float(np.abs(vals).max()) or 1.0
    ax.set_xlim(-1.1 * m, 1.1 * m)
    direction = "logit difference" if _get(d, "distractor") is not None else "target logit"
    ax.set_xlabel(f"contribution to the {direction}")
    head = _headline(_model_id(res), _text_of(_get(p, "tokens")))
    summary = (f"position {_get(d, 'position')}: sum of parts {_get(d, 'sum_of_parts'):.4g} + ln_final "
               f"bias {_get(d, 'ln_final_bias'):.4g} = {direction} {_get(d, 'logit_diff'):.4g} "
               f"(residual {_get(d, 'residual_error'):.1e})")
    ax.set_title(title or "\n".join(x for x in (head, "direct logit attribution", summary) if x), fontsize=9)
    return fig


def composition(res: Any, kind: str = "all", threshold: float | None = None, *,
                title: str | None = None, figsize=None) -> Figure:
    """The composition graph of ``/v1/circuits``: a column of nodes per layer (one per head),
    an edge from head a to a later head b for each Q/K/V composition score >= ``threshold``
    (default: the mean + 2 standard deviations of the drawn kinds' scores over the pairs
    layer_a < layer_b), its width growing with the score; kinds coloured Q blue, K red, V
    green."""
    from matplotlib.lines import Line2D

    comp = _get(res, "composition")
    if comp is None:
        raise ValueError("the circuits response has no composition (request composition=true)")
    kinds = ["q", "k", "v"] if kind == "all" else [kind]
    if any(k not in ("q", "k", "v") for k in kinds):
        raise ValueError(f"kind is 'q', 'k', 'v' or 'all', not {kind!r}")
    n_l, n_h = int(_get(res, "n_layers")), int(_get(res, "n_heads"))
    grids = {k: np.array(_get(comp, k), float) for k in kinds}
    iu = [(la, lb) for la in range(n_l) for lb in range(la + 1, n_l)]
    scores = np.concatenate([grids[k][la, :, lb, :].ravel() for k in kinds for la, lb in iu]) \
        if iu else np.zeros(0)
    if threshold is None:
        threshold = float(scores.mean() + 2 * scores.std()) if scores.size else 0.0
    top = float(scores.max()) if scores.size else threshold
    colours = {"q": "#1f77b4", "k": "#d62728", "v": "#2ca02c"}
    fig = _new_figure(figsize or (max(6.5, 1.4 * n_l + 3.0), max(3.5, 0.32 * n_h + 1.8)))
    ax = fig.add_subplot()
    n = 0
    for k in kinds:
        for la, lb in iu:
            for ha, hb in zip(*np.nonzero(grids[k][la, :, lb, :] >= threshold)):
                s = grids[k][la, ha, lb, hb]
                w = 0.5 + 3.5 * ((s - threshold) / (top - threshold) if top > threshold else 1.0)
                ax.plot([la, lb], [ha, hb], color=colours[k], linewidth=w, alpha=0.7, zorder=1)
                n += 1
    for l in range(n_l):
        ax.scatter([l] * n_h, range(n_h), s=120, facecolor="white", edgecolor="#555", zorder=2)
        for h in range(n_h):
            ax.text(l, h, str(h), ha="center", va="center", fontsize=6.5, zorder=3)
    ax.set_xticks(range(n_l))
    ax.set_xticklabels([f"layer {l}" for l in range(n_l)], fontsize=TICK_FONT)
    ax.set_yticks([])
    ax.set_ylabel("head")
    ax.invert_yaxis()
    ax.set_xlim(-0.4, n_l - 0.6)
    ax.legend(handles=[Line2D([0], [0], color=colours[k], label=f"{k.upper()}-composition") for k in kinds],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.set_title(title or "\n".join(x for x in (
        _model_id(res), f"composition scores >= {threshold:.3g} (weights only)",
        f"{n} edges, max score {top:.3g}") if x),
        fontsize=9)
    return fig


def _diverging(a: np.ndarray, row_title: str, col_title: str, col_labels, label: str,
               title: str, vmax: float | None = None, figsize=None) -> Figure:
    from matplotlib.colors import TwoSlopeNorm

    finite = a[np.isfinite(a)]
    vmax = vmax or (float(np.abs(finite).max()) if finite.size else 1.0) or 1.0
    n_r, n_c = a.shape
    fig = _new_figure(figsize or (max(5.0, 0.34 * n_c + 3.0), max(2.6, 0.3 * n_r + 2.0)))
    ax = fig.add_subplot()
    im = ax.imshow(np.ma.masked_invalid(a), cmap="RdBu_r", norm=TwoSlopeNorm(0.0, -vmax, vmax),
                   aspect="auto", interpolation="nearest")
    cb = fig.colorbar(im, ax=ax)
    cb.set_label(label)
    step = max(1, -(-n_c // MAX_TICK_LABELS))
    ax.set_xticks(range(0, n_c, step))
    ax.set_xticklabels(list(col_labels)[::step], rotation=90, fontsize=TICK_FONT)
    ax.set_yticks(range(n_r))
    ax.set_yticklabels([str(i) for i in range(n_r)], fontsize=TICK_FONT)
    ax.set(xlabel=col_title, ylabel=row_title)
    ax.set_title(title, fontsize=9)
    return fig


def _patch_checked(res: Any, field: str) -> np.ndarray:
    if _get(res, "clean_value") == _get(res, "corrupted_value"):
        raise ValueError(
            f"the clean and corrupted runs give the same metric ({_get(res, 'clean_value')!r}): the "
            "normalised effect (patched - corrupted) / (clean - corrupted) divides by zero, so no "
            "cell has a value; choose a corrupted prompt that changes the metric")
    v = _get(res, field)
    if v is None:
        raise ValueError(f"the patch response has no {field} (request "
                         f"{'per_position' if field == 'heads_per_position' else 'residual'}=true)")
    a = np.array(v, dtype=object)
    return np.where(a == None, np.nan, a).astype(float)  # noqa: E711


_NORM = "(patched - corrupted) / (clean - corrupted)\n0 = no change, 1 = clean restored"


def patch_per_position(res: Any, layer: int, *, title: str | None = None, figsize=None) -> Figure:
    """Per-position head patching (``/v1/patch`` ``per_position``) of one layer: head x
    position on the diverging scale centred on 0, the scale shared by every layer."""
    a = _patch_checked(res, "heads_per_position")
    if not 0 <= layer < a.shape[0]:
        raise ValueError(f"layer {layer} is not in the grid's {a.shape[0]} layers")
    vmax = float(np.nanmax(np.abs(a))) if np.isfinite(a).any() else 1.0
    labels = [f"{i} {l}" for i, l in enumerate(token_labels(_get(res, "clean_tokens")))]
    head = _headline(_model_id(res), _text_of(_get(res, "clean_tokens")))
    return _diverging(a[layer], "head", "position (clean token)", labels, _NORM,
                      title or f"{head}\nlayer {layer}: one head at one position patched", vmax, figsize)


def residual_grid(res: Any, *, title: str | None = None, figsize=None) -> Figure:
    """Residual-stream patching (``/v1/patch`` ``residual``): layer x position, diverging."""
    a = _patch_checked(res, "residual")
    labels = [f"{i} {l}" for i, l in enumerate(token_labels(_get(res, "clean_tokens")))]
    head = _headline(_model_id(res), _text_of(_get(res, "clean_tokens")))
    return _diverging(a, "layer", "position (clean token)", labels, _NORM,
                      title or f"{head}\nresidual stream (resid_pre) patched at one position", None, figsize)


__all__ += ["path_patch_grid"]


def path_patch_grid(res: Any, *, value: str = "normalized", kv_heads: Any = None,
                    title: str | None = None, figsize=None) -> Figure:
    """The grid of ``/v1/path-patch`` (``grid=True``; Wang et al. 2022): rows the sender heads
    ``(sender_layer, sender_head)`` of layers 0..L-2, columns the receiver head inputs
    ``(receiver_layer, receiver_head, input)`` of layers 1..L-1 (grouped-query models: k/v
    columns are the key/value heads, ordered layer, input, head), on the diverging scale centred
    on 0 (RdBu_r, symmetric at the largest |value|); cells whose receiver is not after the
    sender are blank (no value). ``value`` 'normalized' = ``(patched - base) / (other - base)``
    (0 = the path carries nothing, 1 = all of the other run's effect) or 'change' = ``patched -
    base`` in the metric's units. ``kv_heads`` (grouped-query models; :func:`kv_head_map`):
    tick labels name the key/value head ("L1 H2 kv 1 q"). The title names the model, the
    metric, the base and other runs' means and the pair count.

    Raises:
        ValueError: not a grid response (a single experiment is one number: ``.normalized``),
            ``value`` not 'normalized' or 'change', or 'normalized' when the base and other
            runs give the same metric (0 / 0).
    """
    if value not in ("normalized", "change"):
        raise ValueError(f"value is 'normalized' or 'change', not {value!r}")
    g = _get(res, "grid")
    if g is None:
        raise ValueError("the path-patch response has no grid (request grid=true); a single "
                         "experiment is one number: its .normalized and .patched")
    base, other = _get(_get(res, "base"), "mean"), _get(_get(res, "other"), "mean")
    if value == "normalized" and base == other:
        raise ValueError(
            f"the base and other runs give the same metric ({base!r}): the normalised effect "
            "(patched - base) / (other - base) divides by zero, so no cell has a value; plot "
            "value='change' or choose a corrupted prompt that changes the metric")
    src = np.array(_get(g, "normalized" if value == "normalized" else "raw"), dtype=object)
    a = np.where(src == None, np.nan, src).astype(float)  # noqa: E711
    if value == "change":
        a = a - float(base)
    L, H = a.shape[0], a.shape[1]
    inputs = list(_get(g, "inputs"))
    axes = _get(g, "head_axes") or {}
    n_recv = _get(g, "receiver_heads") or {}
    kv = kv_head_map(kv_heads, H)
    kvs = (lambda h: "") if kv is None else (lambda h: f" kv {kv[h]}")
    rows = [f"L{l} H{h}{kvs(h)}" for l in range(L - 1) for h in range(H)]
    if any(axes.get(x) == "kv_head" for x in inputs):
        # grouped-query attention: k/v receivers are key/value heads (layer, input, head order)
        spec = [(l, h, k, f"L{l} {'kv ' + str(h) if axes.get(x) == 'kv_head' else f'H{h}{kvs(h)}'} {x}")
                for l in range(1, L) for k, x in enumerate(inputs) for h in range(n_recv.get(x, H))]
    else:
        spec = [(l, h, k, f"L{l} H{h}{kvs(h)} {x}") for l in range(1, L) for h in range(H)
                for k, x in enumerate(inputs)]
    cols = [c[3] for c in spec]
    lr, hr, kr = (np.array([c[i] for c in spec], dtype=int) for i in range(3))
    m = a[: L - 1][:, :, lr, hr, kr].reshape((L - 1) * H, len(spec))
    label = ("(patched - base) / (other - base)\n0 = nothing, 1 = the other run's effect"
             if value == "normalized" else "patched - base (metric units)")
    n = len(_get(res, "pairs") or [])
    metric = str(_get(res, "metric"))
    head = "\n".join(x for x in (
        _model_id(res),
        "path patching: sender head -> receiver head input",
        f"{metric}: base ({_get(res, 'base_run')}) {float(base):.4g}, other ({_get(res, 'other_run')}) "
        f"{float(other):.4g}; {n} pair{'s' if n != 1 else ''}")
        if x)
    fig = _diverging(m, "sender head", "receiver head input", cols, label, title or head, None,
                     figsize or (max(7.0, 0.3 * len(cols) + 3.5), max(3.4, 0.32 * len(rows) + 2.8)))
    ax = fig.axes[0]
    ax.set_yticklabels(rows, fontsize=TICK_FONT)
    return fig
