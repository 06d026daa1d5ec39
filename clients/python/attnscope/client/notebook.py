"""Notebook views: client responses render in Jupyter as the explorer's interactive views.

Every response the client returns has ``_repr_html_`` (the way CircuitsVis' views do), so a
cell ending in ``c.attention(text)`` shows the heat map with layer/head pickers, value on
hover, the 0..1 colour scale and the line view; ``c.heads(text)`` the head grid (scores on
hover); ``c.path_patch(...)`` the sender x receiver grid (normalised effect, raw values on
hover); ``c.trajectories(text)`` the PCA paths with arrows and explained variance; tokenize,
links and verify responses small tables. The HTML is self-contained: the explorer's
``views.js`` and ``attnscope.js`` (shipped in the package) are inlined as ES modules loaded
from blob URLs, the tensors inlined as base64 float32; nothing is fetched from a network.

    from . import Client, notebook
    res = Client().attention("The cat sat on the mat.")
    res                                   # in Jupyter: the interactive view
    notebook.to_html(res)                 # the same HTML as a string (e.g. to save a page)

Responses with ``texts`` show their first result (and say how many there are).
"""

from __future__ import annotations

import base64
import html
import json
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from ._kv import kv_head_map
from ._tensors import to_numpy

_WEB = Path(__file__).resolve().parent / "_web"

__all__ = ["to_html", "NotebookView", "view_class"]


@lru_cache(maxsize=None)
def _module(name: str) -> str:
    return (_WEB / name).read_text(encoding="utf-8")


_CSS = """
.attnscope-nb { font: 14px/1.4 system-ui, sans-serif; color: #1b1f23; }
.attnscope-nb .row { display: flex; gap: 12px; align-items: center; flex-wrap: wrap; margin: 4px 0; }
.attnscope-nb .view-title { font-weight: 600; margin: 4px 0; }
.attnscope-nb .heatmap-stage { position: relative; display: inline-block; }
.attnscope-nb .tip { position: absolute; pointer-events: none; background: #222; color: #fff; padding: 2px 6px; border-radius: 3px; font-size: 12px; white-space: nowrap; opacity: 0; }
.attnscope-nb .tip.show { opacity: .95; }
.attnscope-nb .cbar-row { display: flex; gap: 18px; align-items: flex-end; margin: 6px 0; }
.attnscope-nb .cbar-box { width: 220px; } .attnscope-nb canvas.cbar { display: block; border: 1px solid #999; }
.attnscope-nb .cbar-ticks { display: flex; justify-content: space-between; font-size: 11px; }
.attnscope-nb .swatch { display: inline-block; width: 13px; height: 13px; border: 1px solid #888; margin-right: 4px; vertical-align: middle; }
.attnscope-nb .masked-swatch { background: repeating-linear-gradient(135deg, #9e9e9e 0 3px, #6d6d6d 3px 4px); }
.attnscope-nb .legend { display: flex; flex-wrap: wrap; gap: 10px; font-size: 12px; margin: 4px 0; }
.attnscope-nb .note { color: #5a6270; font-size: 12px; }
.attnscope-nb table { border-collapse: collapse; font-size: 12px; }
.attnscope-nb th, .attnscope-nb td { padding: 1px 6px; border-bottom: 1px solid #eee; text-align: left; }
.attnscope-nb .headcell { min-width: 52px; height: 28px; border: 2px solid transparent; border-radius: 3px; font-size: 11px; color: #111; cursor: pointer; }
.attnscope-nb svg text { font: 12px system-ui, sans-serif; }
.attnscope-nb svg .tok, .attnscope-nb svg .toklabel { font: 12px monospace; white-space: pre; }
.attnscope-nb svg .qtok.active { font-weight: 700; fill: #08519c; }
.attnscope-nb svg .axisline { stroke: #888; } .attnscope-nb svg .tick, .attnscope-nb svg .state { font-size: 10px; fill: #5a6270; }
.attnscope-nb .pass { color: #1b7d2f; font-weight: 600; } .attnscope-nb .fail { color: #b00020; font-weight: 600; }
.attnscope-nb .num { white-space: nowrap; } .attnscope-nb td.num { text-align: right; }
.attnscope-nb .grid-scroll { overflow-x: auto; max-width: 100%; scrollbar-color: #8a94a3 #eceff3; }
.attnscope-nb .cbar-box { min-width: 220px; width: max-content; max-width: 100%; } .attnscope-nb .cbar-box canvas.cbar { width: 100%; height: 12px; }
.attnscope-nb table.lensgrid, .attnscope-nb table.effectgrid { border-collapse: separate; border-spacing: 1px; }
.attnscope-nb table.lensgrid th, .attnscope-nb table.effectgrid th { white-space: nowrap; border: none; padding: 1px 4px; }
.attnscope-nb th.tokhead, .attnscope-nb td.lenscell { font: 11px monospace; white-space: pre; }
.attnscope-nb td.lenscell { min-width: 40px; max-width: 90px; overflow: hidden; padding: 2px 4px; border: 2px solid transparent; }
.attnscope-nb td.lenscell.hit { border-color: #111; } .attnscope-nb .hit-swatch { border: 2px solid #111; background: #fff; }
.attnscope-nb td.effcell { min-width: 34px; height: 22px; font-size: 11px; text-align: center; white-space: nowrap; border: none; }
.attnscope-nb td.effcell.na, .attnscope-nb .na-swatch { background: repeating-linear-gradient(135deg, #e0e0e0 0 3px, #b5b5b5 3px 4px); }
.attnscope-nb .masked-key { font-size: 12px; display: flex; align-items: center; gap: 6px; }
.attnscope-nb .panel-msg { color: #8a4b00; background: #fff7e6; border: 1px solid #f0c27b; border-radius: 4px; padding: 6px 8px; }
.attnscope-nb .heatmap-axes { display: grid; grid-template-columns: auto auto; justify-content: start; }
.attnscope-nb .heatmap-axes .axis-x { grid-column: 2; grid-row: 1; font-size: 11px; color: #5a6270; }
.attnscope-nb .heatmap-axes .axis-y { grid-column: 1; grid-row: 2; font-size: 11px; color: #5a6270; writing-mode: vertical-rl; transform: rotate(180deg); text-align: right; }
.attnscope-nb .heatmap-axes .heatmap-stage { grid-column: 2; grid-row: 2; }
.attnscope-nb .heatmap-cursor { position: absolute; pointer-events: none; border: 2px solid #f0a500; outline: 1px solid #111; display: none; }
.attnscope-nb .heatmap-cursor.show { display: block; }
.attnscope-nb svg .axis { fill: #5a6270; }
.attnscope-nb table.pathgrid th.pp-colhead { text-align: center; font-weight: 500; font-size: 11px; }
.attnscope-nb table.pathgrid th.pp-rowhead { text-align: right; font-size: 11px; }
.attnscope-nb table.pp-summary td.num { text-align: right; } .attnscope-nb .pp-readout { min-height: 1.4em; }
.attnscope-nb table.headgrid th.headcol { white-space: nowrap; font-size: 11px; }
"""

# The page-side script: imports the two modules from blob URLs, then draws `kind` from DATA.
_SCRIPT = r"""
const root = document.getElementById(ROOT_ID);
const load = (src) => import(URL.createObjectURL(new Blob([src], {type: "text/javascript"})));
const [v, w] = await Promise.all([load(VIEWS_SRC), load(WIRE_SRC)]);
const D = DATA;
const $ = (s) => root.querySelector(s);
const labels = D.tokens.map((t) => t.label);
if (D.kind === "attention") {
  const P = w.decodeTensor(D.pattern);            // [layer, head, T, T] or [layer, T, T]
  const masked = D.causal ? (q, k) => k > q : () => false;
  const draw = () => {
    const li = +$(".nb-layer").value, hv = $(".nb-head").value;
    const L = P.at(li);
    let m, heads = [];
    if (D.head_mean) { m = L; heads = [{head: "mean", colour: "#08519c", get: (q, k) => L.get(q, k)}]; }
    else if (hv === "mean") {
      const n = labels.length, H = L.shape[0], a = new Float32Array(n * n);
      for (let h = 0; h < H; h++) { const x = L.at(h).data; for (let i = 0; i < a.length; i++) a[i] += x[i] / H; }
      m = new w.Tensor(a, [n, n]);
      heads = D.heads.map((h, j) => ({head: h, colour: v.headColour(h), get: (q, k) => L.get(j, q, k)}));
    } else {
      const j = +hv; m = L.at(j);
      heads = [{head: D.heads[j], colour: v.headColour(D.heads[j]), get: (q, k) => m.get(q, k)}];
    }
    const where = `layer ${D.layers[li]}, ` + (D.head_mean || hv === "mean" ? "head mean" : `head ${D.heads[+hv]}`);
    v.heatmap($(".nb-heatmap"), m, {labels, n: labels.length, masked, title: `${D.model} \u00b7 ${where} \u00b7 \u201c${D.text}\u201d`});
    v.colourBar($(".nb-cbar"), {masked: D.causal});
    v.lineView($(".nb-lines"), heads, {labels});
  };
  const ls = $(".nb-layer"), hs = $(".nb-head");
  D.layers.forEach((l, i) => ls.append(new Option(`layer ${l}`, String(i))));
  if (!D.head_mean) { hs.append(new Option("head mean", "mean")); D.heads.forEach((h, j) => hs.append(new Option(`head ${h}`, String(j)))); }
  else { hs.append(new Option("head mean (server)", "mean")); }
  ls.onchange = hs.onchange = draw;
  draw();
} else if (D.kind === "heads") {
  const show = (l, h) => {
    const it = D.result.heads.find((x) => x.layer === l && x.head === h);
    $(".nb-picked").textContent = `layer ${l}, head ${h}: ${it.label}; ` +
      Object.entries(it.scores).map(([k, x]) => `${k} ${x === null ? "n/a" : Number(x).toFixed(3)}`).join(", ");
  };
  v.headGrid($(".nb-grid"), D.result, show, null, {kv: D.kv});
} else if (D.kind === "lens") {
  v.lensGrid($(".nb-view"), D.prompt, {title: D.title});
} else if (D.kind === "dla") {
  const ps = $(".nb-pos"), os = $(".nb-order");
  D.prompt.positions.forEach((x, i) => ps.append(new Option(`position ${x.position}`, String(i))));
  const draw = () => v.attributionBars($(".nb-view"), D.prompt.positions[+ps.value], {order: os.value, title: D.title, direction: D.direction});
  ps.onchange = os.onchange = draw;
  draw();
} else if (D.kind === "circuits") {
  v.divergingGrid($(".nb-copy"), D.copying, {rowTitle: "layer", colTitle: "head", vmax: 1,
    label: "copying score Σλ / Σ|λ| of the OV circuit (−1..1)", title: "copying score per head"});
  if (D.composition) {
    const ks = $(".nb-kind"), ts = $(".nb-thr");
    const draw = () => {
      const kinds = ks.value === "qkv" ? ["q", "k", "v"] : [ks.value];
      let t = parseFloat(ts.value);
      if (!Number.isFinite(t)) { t = v.defaultThreshold(D.composition, kinds); ts.value = String(t); }
      v.compositionGraph($(".nb-view"), {n_layers: D.n_layers, n_heads: D.n_heads, composition: D.composition},
        {kinds, threshold: t, title: "composition scores ≥ threshold (the default: mean + 2 sd)"});
    };
    ks.onchange = () => { ts.value = ""; draw(); };
    ts.onchange = draw;
    draw();
  }
} else if (D.kind === "ablate") {
  v.divergingGrid($(".nb-view"), D.effect, {rowTitle: "layer", colTitle: "head", label: D.label, title: D.title});
} else if (D.kind === "patch") {
  v.patchView($(".nb-view"), D.result, {model: D.model});
} else if (D.kind === "path_patch") {
  v.pathPatchView($(".nb-view"), D.result, {model: D.model, kv: D.kv});
} else if (D.kind === "trajectories") {
  v.trajectoryPlot($(".nb-traj"), {paths: w.decodeTensor(D.paths), positions: D.positions, states: D.states,
    labels, evr: D.evr});
}
root.dataset.ready = "1";
"""


def _b64(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(np.asarray(a, dtype="<f4"))
    return {"encoding": "base64", "dtype": "float32", "shape": list(a.shape),
            "data": base64.b64encode(a.tobytes()).decode("ascii")}


def _dump(obj: Any) -> dict:
    return obj.model_dump(mode="json") if hasattr(obj, "model_dump") else dict(obj)


def _first(resp: Any, field: str):
    one = getattr(resp, field, None)
    if one is not None:
        return one, 1
    results = getattr(resp, "results", None) or []
    return (results[0] if results else None), len(results)


def _text(tokens) -> str:
    s = "".join(t.label for t in tokens if not t.special).strip()
    return s if len(s) <= 60 else s[:59] + "\u2026"


def _interactive(kind: str, data: dict, body: str, note: str = "") -> str:
    rid = f"attnscope-{uuid.uuid4().hex[:12]}"
    script = (_SCRIPT.replace("ROOT_ID", json.dumps(rid))
              .replace("VIEWS_SRC", json.dumps(_module("views.js")))
              .replace("WIRE_SRC", json.dumps(_module("attnscope.js")))
              .replace("DATA", json.dumps({"kind": kind, **data})))
    script = script.replace("</", "<\\/")  # never close the <script> element early
    return (f'<div class="attnscope-nb" id="{rid}" data-kind="{kind}"><style>{_CSS}</style>'
            f'{body}{f"<p class=note>{html.escape(note)}</p>" if note else ""}'
            f'<script type="module">{script}</script></div>')


def _attention(resp) -> str:
    res, n = _first(resp, "attention")
    p = to_numpy(res.pattern) if not hasattr(res.pattern, "numpy") else res.pattern.numpy()
    causal = bool(p.shape[-1] > 1 and np.all(np.triu(p.astype(np.float32), 1) == 0))
    data = {"model": resp.model.id, "text": _text(res.tokens), "tokens": [_dump(t) for t in res.tokens],
            "layers": list(res.layers), "heads": list(res.heads), "head_mean": bool(res.head_mean),
            "causal": causal, "pattern": _b64(p)}
    body = ('<div class="row"><label>Layer <select class="nb-layer"></select></label>'
            '<label>Head <select class="nb-head"></select></label>'
            '<span class="note">hover a cell for its weight</span></div>'
            '<div class="nb-heatmap"></div><div class="nb-cbar cbar-row"></div>'
            '<div class="nb-lines"></div>')
    return _interactive("attention", data, body, f"result 1 of {n}" if n > 1 else "")


def _heads(resp, kv_heads=None) -> str:
    n_heads = 1 + max((h.head for h in resp.heads), default=0)
    data = {"model": resp.model.id, "tokens": [], "result": _dump(resp),
            "kv": kv_head_map(kv_heads, n_heads)}
    body = (f'<div class="view-title">{html.escape(resp.model.id)} \u00b7 head classification '
            f'({resp.n_texts} text{"s" if resp.n_texts != 1 else ""})</div>'
            '<div class="nb-grid"></div><p class="nb-picked note">click a head for its scores</p>')
    return _interactive("heads", data, body)


def _trajectories(resp) -> str:
    res, n = _first(resp, "trajectories")
    paths = res.paths.numpy() if hasattr(res.paths, "numpy") else to_numpy(res.paths)
    data = {"model": resp.model.id, "tokens": [_dump(t) for t in res.tokens], "paths": _b64(paths),
            "positions": list(res.positions), "states": list(res.states),
            "evr": list(res.explained_variance_ratio)}
    body = (f'<div class="view-title">{html.escape(resp.model.id)} \u00b7 hidden-state '
            f'trajectories \u00b7 \u201c{html.escape(_text(res.tokens))}\u201d</div><div class="nb-traj"></div>')
    return _interactive("trajectories", data, body, f"result 1 of {n}" if n > 1 else "")


def _table(head: list[str], rows: list[list[Any]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{trs}</table>"


def _static(title: str, inner: str) -> str:
    return (f'<div class="attnscope-nb" data-kind="static"><style>{_CSS}</style>'
            f'<div class="view-title">{html.escape(title)}</div>{inner}</div>')


def _tokens(resp) -> str:
    res, _ = _first(resp, "tokens")
    rows = [[t.position, repr(t.label), t.id, t.start, t.end, "yes" if t.special else ""]
            for t in res.tokens]
    return _static(f"{resp.model.id} \u00b7 {res.n_tokens} tokens",
                   _table(["position", "label", "id", "start", "end", "special"], rows))


def _links(resp) -> str:
    res, _ = _first(resp, "links")
    rows = [[f"{q.query_pos} {q.query!r}",
             ", ".join(f"{l.key_pos} {l.key!r} ({l.weight:.3f})" for l in q.links)] for q in res.links]
    where = f"layer {resp.layer}, " + ("head mean" if resp.head is None else f"head {resp.head}")
    return _static(f"{resp.model.id} \u00b7 strongest links \u00b7 {where}",
                   _table(["query", "keys (weight)"], rows))


def _verify(resp) -> str:
    v, _ = _first(resp, "verification")
    rows = [[l.layer, l.pattern_max_abs_diff, l.output_max_abs_diff, "yes" if l.passed else "NO"]
            for l in v.layers]
    verdict = f'<p class="{"pass" if v.passed else "fail"}">{"PASSED" if v.passed else "FAILED"}: {html.escape(v.message)}</p>'
    return _static(f"{resp.model.id} \u00b7 verification", verdict + _table(
        ["layer", "max |Δ pattern|", "max |Δ output|", "passed"], rows))


def _lens(resp) -> str:
    p = resp.prompts[0]
    title = f"{resp.model.id} \u00b7 logit lens (ln {resp.ln}) \u00b7 \u201c{_text(p.tokens)}\u201d"
    data = {"tokens": [], "prompt": _dump(p), "title": title}
    n = len(resp.prompts)
    return _interactive("lens", data, '<div class="nb-view"></div>', f"prompt 1 of {n}" if n > 1 else "")


def _dla(resp) -> str:
    p = resp.prompts[0]
    d = p.positions[0]
    direction = "the target logit" if d.distractor is None else "the logit difference target \u2212 distractor"
    title = f"{resp.model.id} \u00b7 direct logit attribution \u00b7 \u201c{_text(p.tokens)}\u201d"
    data = {"tokens": [], "prompt": _dump(p), "title": title, "direction": direction}
    body = ('<div class="row"><label>Position <select class="nb-pos"></select></label>'
            '<label>Order <select class="nb-order"><option value="layer">by layer</option>'
            '<option value="value">by |value|</option></select></label></div><div class="nb-view"></div>')
    n = len(resp.prompts)
    return _interactive("dla", data, body, f"prompt 1 of {n}" if n > 1 else "")


def _circuits(resp) -> str:
    copying = [[None] * resp.n_heads for _ in range(resp.n_layers)]
    for h in resp.heads:
        copying[h.layer][h.head] = h.copying_score
    comp = _dump(resp.composition) if resp.composition is not None else None
    data = {"tokens": [], "n_layers": resp.n_layers, "n_heads": resp.n_heads, "copying": copying,
            "composition": comp}
    body = (f'<div class="view-title">{html.escape(resp.model.id)} \u00b7 circuits (weights only)</div>'
            '<div class="nb-copy"></div>')
    if comp is not None:
        body += ('<div class="row"><label>Kind <select class="nb-kind"><option value="qkv">Q, K and V'
                 '</option><option value="q">Q</option><option value="k">K</option><option value="v">V'
                 '</option></select></label><label>Threshold <input class="nb-thr" type="number" '
                 'step="0.01"></label></div><div class="nb-view"></div>')
    return _interactive("circuits", data, body)


def _ablate(resp) -> str:
    text = _text(resp.tokens)
    if resp.scan is not None:
        label = {"loss": "change of the mean loss (nats), head ablated", "kl": "KL(clean \u2016 ablated), nats",
                 "logit_diff": "change of the logit difference"}.get(resp.scan.metric, resp.scan.metric)
        data = {"tokens": [], "effect": resp.scan.effect, "label": label,
                "title": f"{resp.model.id} \u00b7 {resp.method}-ablating each head alone \u00b7 \u201c{text}\u201d"}
        return _interactive("ablate", data, '<div class="nb-view"></div>')
    rows = [[p.position, repr(p.token), repr(p.next_token.label) if p.next_token else "",
             _num(p.loss_clean), _num(p.loss_ablated), _num(p.delta_loss), _num(p.kl)]
            for p in (resp.positions or [])]
    heads = ", ".join(f"L{l}H{h}" for l, h in (resp.heads or []))
    summary = (f"<p>mean loss {_num(resp.mean_loss_clean)} \u2192 {_num(resp.mean_loss_ablated)} nats; "
               f"mean KL {_num(resp.mean_kl)} nats</p>")
    if resp.logit_diff is not None:
        ld = resp.logit_diff
        summary += (f"<p>logit difference {html.escape(repr(ld.target.label))} \u2212 "
                    f"{html.escape(repr(ld.distractor.label))} at {ld.position}: {_num(ld.clean)} "
                    f"\u2192 {_num(ld.ablated)}</p>")
    return _static(f"{resp.model.id} \u00b7 {resp.method}-ablating {heads} \u00b7 \u201c{text}\u201d",
                   summary + _table(["position", "token", "next", "loss clean", "loss ablated",
                                     "\u0394 loss", "KL"], rows))


def _num(v) -> str:
    return "n/a" if v is None else f"{v:.4g}"


def _patch(resp) -> str:
    data = {"tokens": [], "model": resp.model.id, "result": _dump(resp)}
    return _interactive("patch", data, '<div class="nb-view"></div>')


def _path_patch(resp, kv_heads=None) -> str:
    """PathPatchResponse: the grid (sender head x receiver head input, normalised effect on the
    diverging scale, raw values on hover) or the single experiment's statistics."""
    n_heads = len(resp.grid.raw[0]) if resp.grid is not None and resp.grid.raw else None
    if n_heads is None:
        heads = [s.get("head") for s in (resp.senders or []) if s.get("kind") == "head"]
        heads += [h for r in (resp.receivers or []) for h in (r.get("heads") or [])]
        n_heads = len(_kv_list(kv_heads) or []) or (1 + max(heads, default=0))
    data = {"tokens": [], "model": resp.model.id, "result": _dump(resp),
            "kv": kv_head_map(kv_heads, n_heads)}
    n = len(resp.pairs)
    return _interactive("path_patch", data, '<div class="nb-view"></div>',
                        f"{n} prompt pairs" if n > 1 else "")


def _kv_list(kv_heads):
    """The query head -> key/value head list ``kv_heads`` names (a list, or a ModelInfo / its
    dict), None for an int or nothing (then the head count comes from the response)."""
    if kv_heads is None or isinstance(kv_heads, (int, np.integer)):
        return None
    att = kv_heads.get("attention") if isinstance(kv_heads, dict) else getattr(kv_heads, "attention", None)
    if att is not None:
        return att.get("kv_head_of_query_head") if isinstance(att, dict) else getattr(att, "kv_head_of_query_head", None)
    return list(kv_heads)


def _run(out) -> str:
    """RunOutput (client.run): a table of the cached hooks with their shapes, the metrics."""
    rows = [[name, " x ".join(map(str, a.shape)), str(a.dtype)] for name, a in out.cache.items()]
    rows += [[f"grad {name}", " x ".join(map(str, a.shape)), str(a.dtype)] for name, a in out.grads.items()]
    inner = _table(["hook", "shape", "dtype"], rows) if rows else "<p class=note>no hooks cached</p>"
    if out.metrics:
        inner += _table(["metric", "value"], [[k, _num(v)] for k, v in out.metrics.items()])
    extra = []
    if out.logits is not None:
        extra.append(f"logits {' x '.join(map(str, out.logits.shape))}")
    if out.loss is not None:
        extra.append(f"loss {' x '.join(map(str, out.loss.shape))}, mean {float(np.mean(out.loss)):.4g} nats")
    if extra:
        inner += f"<p class=note>{html.escape('; '.join(extra))}</p>"
    shape = f"{len(out.tokens)} prompt{'s' if len(out.tokens) != 1 else ''} x {len(out.tokens[0]) if out.tokens else 0} tokens"
    model = (out.body.get("model") or {}).get("id", "") if isinstance(out.body, dict) else ""
    title = " \u00b7 ".join(x for x in (model, "hooked run", shape, f"{len(out.cache)} cached hooks") if x)
    return _static(title, inner)


_RENDER = {
    "LogitLensResponse": _lens, "LogitAttributionResponse": _dla, "CircuitsResponse": _circuits,
    "AblateResponse": _ablate, "PatchResponse": _patch, "RunOutput": _run,
    "PathPatchResponse": _path_patch,
    "AttentionResponse": _attention, "HeadsResponse": _heads,
    "TrajectoriesResponse": _trajectories, "TokenizeResponse": _tokens,
    "LinksResponse": _links, "VerifyResponse": _verify,
}


def _kind(obj: Any) -> str | None:
    for cls in type(obj).__mro__:
        if cls.__name__ in _RENDER:
            return cls.__name__
    return None


_KV_AWARE = {"HeadsResponse", "PathPatchResponse"}


def to_html(resp: Any, *, kv_heads: Any = None) -> str:
    """The notebook view of a client response as one self-contained HTML string.

    ``kv_heads`` (grouped-query models; the heads and path-patch views): ``client.model()``, its
    ``attention.kv_head_of_query_head`` or ``n_kv_heads``; head headers then read
    "head h \u00b7 kv g" (``_repr_html_`` has no model info, so names heads only).

    Raises:
        TypeError: not a response this module draws (attention, heads, trajectories,
            tokenize, links, verify, logit lens, logit attribution, circuits, ablate, patch,
            path patch, run).
        ValueError: ``kv_heads`` that does not fit the model's heads (see
            ``plots.kv_head_map``).
    """
    kind = _kind(resp)
    if kind is None:
        raise TypeError(f"no notebook view for {type(resp).__name__}")
    if kind in _KV_AWARE:
        return _RENDER[kind](resp, kv_heads)
    return _RENDER[kind](resp)


class NotebookView:
    """Mixin: ``_repr_html_`` for Jupyter (the client's response classes get it)."""

    def _repr_html_(self) -> str:
        return to_html(self)


@lru_cache(maxsize=None)
def view_class(cls: type) -> type:
    """``cls`` with :class:`NotebookView` mixed in, for the response classes this module draws
    (others are returned unchanged). Instances are still instances of ``cls``."""
    if cls.__name__ not in _RENDER or issubclass(cls, NotebookView):
        return cls
    return type(cls.__name__, (cls, NotebookView), {"__module__": cls.__module__,
                                                     "__doc__": cls.__doc__})


def _attach_run_view() -> None:
    from .run import RunOutput

    if not hasattr(RunOutput, "_repr_html_"):
        RunOutput._repr_html_ = NotebookView._repr_html_


_attach_run_view()
