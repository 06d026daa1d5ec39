// views.js — the explorer's drawings, on plain decoded data (no fetching), so the page and
// the notebook views (attnscope.client.notebook) draw the same thing:
//   heatmap()     one attention matrix [query_pos, key_pos] on a canvas, colour scale 0..1,
//                 masked cells (future keys of a causal model) hatched grey, value on hover
//                 and keyboard focus (arrow keys; the cell under the keyboard outlined),
//                 "query" / "key" axis titles
//   lineView()    bertviz-style lines query token -> key tokens, line weight = attention
//   headGrid()    layer x head buttons coloured by label, every score in the tooltip
//   trajectoryPlot()  per-token PCA paths with arrows, explained variance on the axes
//   colourBar()   the labelled 0..1 scale
//   lensGrid()    logit lens: residual state x position, the top token in each cell coloured
//                 by its probability, top-k and the next token's rank in the tooltip
//   attributionBars()  direct logit attribution: a bar per head, MLP, embedding and bias
//   divergingGrid()    an effect grid (ablation scan, patching: [layer][head], [layer][pos],
//                 [head][pos]) on a diverging scale centred on 0, labelled, n/a hatched
//   compositionGraph() heads by layer, edges weighted by Q/K/V composition above a threshold

export const LABEL_COLOURS = {
  induction: "#d62728", previous_token: "#1f77b4", duplicate_token: "#9467bd",
  next_token: "#17becf", self: "#2ca02c", sink: "#ff7f0e", broad: "#bcbd22", none: "#d9d9d9",
};
// tab10 then tab20's light tones: 20 distinct colours, so a legend of 12 heads or 20 tokens
// never gives two series one colour; past 20, hues by the golden angle (seriesColour)
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
  "#7f7f7f", "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5",
  "#c49c94", "#f7b6d2", "#393b79", "#dbdb8d", "#9edae5"];

/** The colour of series i (a head, a token): distinct for every i (20 fixed, then hues). */
export function seriesColour(i) {
  if (i < PALETTE.length) return PALETTE[i];
  const hue = ((i - PALETTE.length) * 137.508 + 17) % 360;
  return `hsl(${hue.toFixed(1)}, 62%, ${i % 2 ? 38 : 55}%)`;
}
export const MASKED_COLOUR = "#9e9e9e";
export const DIGITS = 3;  // float16 on the wire: ~3 significant digits; shown to 3 decimals

// matplotlib's "Blues" stops: 0 -> #f7fbff (near white), 1 -> #08306b (dark blue)
const BLUES = [[247, 251, 255], [222, 235, 247], [198, 219, 239], [158, 202, 225],
  [107, 174, 214], [66, 146, 198], [33, 113, 181], [8, 81, 156], [8, 48, 107]];

/** RGB of weight v on the fixed 0..1 scale (values outside are clamped; never rescaled). */
export function colour(v) {
  const x = Math.min(1, Math.max(0, v)) * (BLUES.length - 1);
  const i = Math.min(BLUES.length - 2, Math.floor(x));
  const f = x - i;
  const a = BLUES[i], b = BLUES[i + 1];
  return [0, 1, 2].map((c) => Math.round(a[c] + f * (b[c] - a[c])));
}

export function fmt(v) {
  if (v === -Infinity) return "masked";
  return Number(v).toFixed(DIGITS);
}

/** A number for reading (not a float16 weight): 3 significant digits, exponent form outside
 * 1e-3..1e5; minus as U+2212. Put it in an element of class "num" (white-space: nowrap), so
 * "1.2e-5" never breaks inside its exponent. */
export function fmtNum(v, digits = 3) {
  if (v === null || v === undefined || Number.isNaN(v)) return "n/a";
  const x = Number(v);
  if (x === 0) return "0";
  const a = Math.abs(x);
  const s = a >= 1e-3 && a < 1e5 ? String(Number(x.toPrecision(digits))) : x.toExponential(digits - 1);
  return s.replace(/^-/, "\u2212").replace("e-", "e\u2212");
}

// matplotlib's "RdBu_r" stops: -1 -> dark blue, 0 -> near white, +1 -> dark red
const RDBU = [[5, 48, 97], [33, 102, 172], [67, 147, 195], [146, 197, 222], [209, 229, 240],
  [247, 247, 247], [253, 219, 199], [244, 165, 130], [214, 96, 77], [178, 24, 43], [103, 0, 31]];

/** RGB of v on the diverging scale -vmax..vmax (white at 0; clamped at the ends). */
export function divergingColour(v, vmax = 1) {
  const t = (Math.min(1, Math.max(-1, v / (vmax || 1))) + 1) / 2 * (RDBU.length - 1);
  const i = Math.min(RDBU.length - 2, Math.floor(t));
  const f = t - i;
  return [0, 1, 2].map((c) => Math.round(RDBU[i][c] + f * (RDBU[i + 1][c] - RDBU[i][c])));
}

const rgb = (c) => `rgb(${c[0]},${c[1]},${c[2]})`;
const ink = (c) => (0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2] < 140 ? "#fff" : "#111");

function el(tag, attrs = {}, ...kids) {
  const svg = ["svg", "line", "path", "text", "g", "defs", "marker", "circle", "rect", "polyline", "title"].includes(tag);
  const e = svg ? document.createElementNS("http://www.w3.org/2000/svg", tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null) continue;
    if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const k of kids) e.append(k);
  return e;
}

/** Token label as shown: visible spaces and newlines (' my' -> '␣my'). */
export function showLabel(s) {
  return String(s).replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
}

/** The labelled colour scale: a gradient with ticks, its title, and the masked swatch.
 * `vmin`/`vmax` the ends, `colourOf(v)` the colour (default Blues over 0..vmax), `na` a
 * swatch for cells without a value. The box is as wide as its labels need (never cut). */
export function colourBar(container, { masked = true, title = "attention weight (post-softmax)", vmax = 1,
  vmin = 0, colourOf = null, na = null } = {}) {
  container.replaceChildren();
  const w = 220, h = 12;
  const c = el("canvas", { width: w, height: h, class: "cbar", "data-vmin": String(vmin), "data-vmax": String(vmax) });
  const g = c.getContext("2d");
  const col = colourOf || ((v) => colour(v / (vmax || 1)));
  for (let x = 0; x < w; x++) {
    g.fillStyle = rgb(col(vmin + (x / (w - 1)) * (vmax - vmin)));
    g.fillRect(x, 0, 1, h);
  }
  const ticks = el("div", { class: "cbar-ticks" });
  const plain = vmin === 0 && vmax === 1;
  for (const t of [0, 0.25, 0.5, 0.75, 1]) {
    const v = vmin + t * (vmax - vmin);
    ticks.append(el("span", { class: "num", text: plain ? String(t) : vmin === 0 ? fmt(v) : fmtNum(v) }));
  }
  const box = el("div", { class: "cbar-box" }, el("div", { class: "cbar-title", text: title }), c, ticks);
  container.append(box);
  if (masked) {
    container.append(el("div", { class: "masked-key" },
      el("span", { class: "swatch masked-swatch" }), "masked (future key: not attended)"));
  }
  if (na) container.append(el("div", { class: "masked-key" }, el("span", { class: "swatch na-swatch" }), na));
}

/**
 * One attention matrix as a heat map.
 * @param container  element to fill
 * @param m          {get(q, k)} or Float32Array of n*n (row-major), weights in [0, 1];
 *                   -Infinity or `masked(q, k)` true = masked cell
 * @param opts       {labels, masked(q,k), title, onCell(q,k)}
 * The canvas carries data-n, data-cell, data-x0, data-y0 (its cell geometry, CSS pixels).
 */
export function heatmap(container, m, opts = {}) {
  const labels = opts.labels || [];
  const n = opts.n ?? labels.length;
  const value = typeof m.get === "function" ? (q, k) => m.get(q, k) : (q, k) => m[q * n + k];
  const masked = opts.masked || (() => false);
  const cell = Math.max(2, Math.min(28, Math.floor(560 / Math.max(1, n))));
  const showLabels = cell >= 9;
  const margin = showLabels ? Math.min(130, 8 + 7 * Math.max(0, ...labels.map((s) => showLabel(s).length))) : 8;
  const x0 = margin, y0 = margin, size = n * cell;
  const W = x0 + size + 8, H = y0 + size + 8;
  const dpr = window.devicePixelRatio || 1;
  const c = el("canvas", {
    class: "heatmap", tabindex: "0", role: "img",
    "aria-label": `${opts.title || "attention"}: ${n} x ${n} heat map; arrow keys move the cell`,
    "data-n": n, "data-cell": cell, "data-x0": x0, "data-y0": y0,
  });
  c.width = W * dpr; c.height = H * dpr;
  c.style.width = `${W}px`; c.style.height = `${H}px`;
  const g = c.getContext("2d");
  g.scale(dpr, dpr);
  g.fillStyle = "#fff"; g.fillRect(0, 0, W, H);
  // hatch for masked cells: grey with diagonal lines, unlike the near-white of a 0 weight
  const hatch = document.createElement("canvas");
  hatch.width = hatch.height = 6;
  const hg = hatch.getContext("2d");
  hg.fillStyle = MASKED_COLOUR; hg.fillRect(0, 0, 6, 6);
  hg.strokeStyle = "#6d6d6d"; hg.lineWidth = 1;
  hg.beginPath(); hg.moveTo(0, 6); hg.lineTo(6, 0); hg.stroke();
  const hatchFill = g.createPattern(hatch, "repeat");
  // one pixel per cell on an n x n canvas, scaled up without smoothing (fast at n = 1024);
  // masked cells grey, then hatched where cells are big enough to show it
  const small = document.createElement("canvas");
  small.width = small.height = Math.max(1, n);
  const sg = small.getContext("2d");
  const img = sg.createImageData(Math.max(1, n), Math.max(1, n));
  const mask = new Uint8Array(n * n);
  for (let q = 0; q < n; q++) {
    for (let k = 0; k < n; k++) {
      const v = value(q, k);
      const o = 4 * (q * n + k);
      let rgb;
      if (masked(q, k) || v === -Infinity) { mask[q * n + k] = 1; rgb = [158, 158, 158]; }
      else rgb = colour(v / (opts.vmax || 1));  // opts.vmax: the scale's top (norms), default 1
      img.data[o] = rgb[0]; img.data[o + 1] = rgb[1]; img.data[o + 2] = rgb[2]; img.data[o + 3] = 255;
    }
  }
  sg.putImageData(img, 0, 0);
  g.imageSmoothingEnabled = false;
  g.drawImage(small, x0, y0, size, size);
  if (cell >= 6) {
    g.fillStyle = hatchFill;
    for (let i = 0; i < n * n; i++) if (mask[i]) g.fillRect(x0 + (i % n) * cell, y0 + Math.floor(i / n) * cell, cell, cell);
  }
  g.strokeStyle = "#444"; g.lineWidth = 1;
  g.strokeRect(x0 - 0.5, y0 - 0.5, size + 1, size + 1);
  if (showLabels) {
    g.fillStyle = "#222";
    g.font = `${Math.min(12, cell - 1)}px system-ui, sans-serif`;
    g.textAlign = "right"; g.textBaseline = "middle";
    labels.forEach((s, q) => g.fillText(showLabel(s), x0 - 4, y0 + (q + 0.5) * cell, margin - 6));
    g.save();
    labels.forEach((s, k) => {
      g.setTransform(dpr, 0, 0, dpr, 0, 0);
      g.translate(x0 + (k + 0.5) * cell, y0 - 4);
      g.rotate(-Math.PI / 2);
      g.textAlign = "left";
      g.fillText(showLabel(s), 0, 0, margin - 6);
    });
    g.restore();
  }
  const tip = el("div", { class: "tip", role: "status", "aria-live": "polite" });
  const describe = (q, k) => {
    const v = value(q, k);
    const isMasked = masked(q, k) || v === -Infinity;
    const txt = `query ${q} ${JSON.stringify(labels[q] ?? "")} \u2192 key ${k} ${JSON.stringify(labels[k] ?? "")}: ` +
      (isMasked ? "masked (future key)" : `${opts.valueName ? `${opts.valueName} ` : ""}${fmt(v)}`);
    tip.textContent = txt;
    tip.dataset.q = q; tip.dataset.k = k;
    tip.dataset.value = isMasked ? "masked" : fmt(v);
    if (opts.onCell) opts.onCell(q, k);
  };
  let cur = [0, 0];
  const where = (ev) => {
    const r = c.getBoundingClientRect();
    const k = Math.floor((ev.clientX - r.left - x0) / cell);
    const q = Math.floor((ev.clientY - r.top - y0) / cell);
    return q >= 0 && k >= 0 && q < n && k < n ? [q, k] : null;
  };
  c.addEventListener("mousemove", (ev) => {
    const p = where(ev);
    if (!p) return;
    cur = p;
    tip.style.left = `${ev.clientX - c.getBoundingClientRect().left + 14}px`;
    tip.style.top = `${ev.clientY - c.getBoundingClientRect().top + 14}px`;
    tip.classList.add("show");
    describe(...p);
  });
  c.addEventListener("mouseleave", () => tip.classList.remove("show"));
  c.addEventListener("keydown", (ev) => {
    const d = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] }[ev.key];
    if (!d) return;
    ev.preventDefault();
    cur = [Math.min(n - 1, Math.max(0, cur[0] + d[0])), Math.min(n - 1, Math.max(0, cur[1] + d[1]))];
    tip.style.left = `${x0 + (cur[1] + 1) * cell + 6}px`;
    tip.style.top = `${y0 + (cur[0] + 1) * cell + 6}px`;
    tip.classList.add("show");
    describe(...cur);
    showCursor();
  });
  // the keyboard cursor: the focused cell outlined (dark and amber, visible on any colour)
  const cursor = el("div", { class: "heatmap-cursor", "aria-hidden": "true" });
  const showCursor = () => {
    cursor.style.left = `${x0 + cur[1] * cell - 1}px`;
    cursor.style.top = `${y0 + cur[0] * cell - 1}px`;
    cursor.style.width = cursor.style.height = `${cell + 2}px`;
    cursor.dataset.q = cur[0]; cursor.dataset.k = cur[1];
    cursor.classList.add("show");
  };
  c.addEventListener("focus", () => { showCursor(); describe(...cur); tip.style.left = `${x0 + (cur[1] + 1) * cell + 6}px`; tip.style.top = `${y0 + (cur[0] + 1) * cell + 6}px`; tip.classList.add("show"); });
  c.addEventListener("blur", () => { cursor.classList.remove("show"); tip.classList.remove("show"); });
  const wrap = el("div", { class: "heatmap-wrap" });
  if (opts.title) wrap.append(el("div", { class: "view-title", text: opts.title }));
  const stage = el("div", { class: "heatmap-stage" }, c, cursor, tip);
  // axis titles: keys along the top (columns), queries down the side (rows)
  const grid = el("div", { class: "heatmap-axes" },
    el("div", { class: "axis-title axis-x", text: "key position \u2192 (attended to)" }),
    el("div", { class: "axis-title axis-y", text: "query position \u2192 (attending)" }), stage);
  wrap.append(grid);
  container.replaceChildren(wrap);
  return c;
}

/**
 * bertviz-style line view: tokens on the left (queries) and right (keys), a line from query q
 * to key k for each selected head with opacity and width proportional to the weight.
 * @param heads  [{head, colour, get(q, k)}]; @param opts {labels, minWeight}
 * Hovering (or focusing) a query token shows only its lines.
 */
export function lineView(container, heads, opts = {}) {
  const labels = opts.labels || [];
  const n = labels.length;
  const minW = opts.minWeight ?? 0.01;
  const row = n > 60 ? 12 : 20;
  const W = 460, H = Math.max(60, n * row + 30);
  const xl = 150, xr = W - 150;
  const svg = el("svg", { width: W, height: H, class: "lineview", role: "img",
    "aria-label": "line view: query tokens (left) to key tokens (right), line weight = attention" });
  const gLines = el("g", { class: "lines" });
  svg.append(el("text", { x: xl, y: 12, "text-anchor": "end", class: "axis", text: "query" }),
    el("text", { x: xr, y: 12, "text-anchor": "start", class: "axis", text: "key" }), gLines);
  const y = (i) => 26 + i * row + row / 2;
  // candidate lines: every weight >= minWeight of every selected head; over maxLines (long
  // texts, many heads) only the strongest are drawn, and the legend says so
  const cand = [];
  for (const h of heads) {
    for (let q = 0; q < n; q++) {
      for (let k = 0; k < n; k++) {
        const v = h.get(q, k);
        if (v >= minW) cand.push([v, q, k, h]);
      }
    }
  }
  const maxLines = opts.maxLines ?? 4000;
  const total = cand.length;
  if (total > maxLines) { cand.sort((a, b) => b[0] - a[0]); cand.length = maxLines; }
  for (const [v, q, k, h] of cand) {
    gLines.append(el("line", {
      x1: xl + 4, y1: y(q), x2: xr - 4, y2: y(k), stroke: h.colour,
      "stroke-opacity": Math.min(1, v).toFixed(3), "stroke-width": (0.5 + 3 * v).toFixed(2),
      "data-q": q, "data-k": k, "data-head": h.head, "data-weight": v.toFixed(6),
    }));
  }
  const count = cand.length;
  const focus = (q) => {
    for (const l of gLines.children) l.style.display = q === null || +l.dataset.q === q ? "" : "none";
    svg.querySelectorAll(".qtok").forEach((t) => t.classList.toggle("active", +t.dataset.pos === q));
  };
  labels.forEach((s, i) => {
    const t = el("text", { x: xl, y: y(i), "text-anchor": "end", "dominant-baseline": "middle",
      class: "tok qtok", tabindex: "0", "data-pos": i, text: showLabel(s) });
    t.addEventListener("mouseenter", () => focus(i));
    t.addEventListener("focus", () => focus(i));
    t.addEventListener("mouseleave", () => focus(null));
    t.addEventListener("blur", () => focus(null));
    svg.append(t, el("text", { x: xr, y: y(i), "text-anchor": "start", "dominant-baseline": "middle",
      class: "tok ktok", "data-pos": i, text: showLabel(s) }));
  });
  const legend = el("div", { class: "legend" });
  if (opts.legend !== false) {  // (the explorer's head checkboxes carry the swatches)
    for (const h of heads) {
      legend.append(el("span", { class: "legend-item" }, el("span", { class: "swatch", style: `background:${h.colour}` }),
        h.head === "mean" ? "head mean" : `head ${h.head}`));
    }
  }
  legend.append(el("span", { class: "note", text: total > count
    ? `the strongest ${count} of ${total} lines (weights \u2265 ${minW})` : `${count} lines (weights \u2265 ${minW})` }));
  container.replaceChildren(legend, svg);
  return svg;
}

export function headColour(h) { return seriesColour(h); }

/** "head 3", or on a grouped-query model (`kv` = query head -> key/value head, GET /v1/model's
 * attention.kv_head_of_query_head; null without GQA) "head 3 \u00b7 kv 1". */
export function headName(h, kv = null) {
  return kv && kv[h] !== undefined && kv[h] !== null ? `head ${h} \u00b7 kv ${kv[h]}` : `head ${h}`;
}

/** `kv` as given when some query heads share a key/value head, else null (nothing to label). */
export function gqaMap(kv) {
  return Array.isArray(kv) && new Set(kv).size < kv.length ? kv : null;
}

/**
 * Layer x head grid of /v1/heads: a button per head coloured by its label, every score in its
 * tooltip (title) and aria-label; `onPick(layer, head)` on click / Enter. `opts.kv` (query head
 * -> key/value head, grouped-query models): each head column's header says "head h \u00b7 kv g".
 */
export function headGrid(container, res, onPick, selected = null, opts = {}) {
  const heads = res.heads;
  const nL = 1 + Math.max(...heads.map((h) => h.layer));
  const nH = 1 + Math.max(...heads.map((h) => h.head));
  const kv = gqaMap(opts.kv);
  const by = new Map(heads.map((h) => [`${h.layer},${h.head}`, h]));
  const table = el("table", { class: "headgrid" + (kv ? " gqa" : "") });
  const hr = el("tr", {}, el("th", { text: "layer \\ head" }));
  for (let h = 0; h < nH; h++) hr.append(el("th", { class: "headcol", "data-head": h, text: kv ? headName(h, kv) : String(h) }));
  table.append(hr);
  for (let l = 0; l < nL; l++) {
    const tr = el("tr", {}, el("th", { text: String(l) }));
    for (let h = 0; h < nH; h++) {
      const it = by.get(`${l},${h}`);
      const td = el("td");
      if (it) {
        const scores = Object.entries(it.scores).map(([k, v]) => `${k}: ${v === null ? "n/a" : Number(v).toFixed(3)}`).join("\n");
        const others = (it.labels || []).filter((x) => x !== it.label);  // every label it earns
        const named = others.length ? `${it.label} (also ${others.join(", ")})` : it.label;
        const b = el("button", {
          class: "headcell" + (selected && selected[0] === l && selected[1] === h ? " selected" : ""),
          style: `background:${LABEL_COLOURS[it.label] || "#ccc"}`,
          title: `layer ${l}, ${headName(h, kv)}: ${named}\n${scores}`,
          "aria-label": `layer ${l} ${headName(h, kv)}, ${named}; ${scores.replace(/\n/g, ", ")}`,
          "data-layer": l, "data-head": h, "data-label": it.label,
          text: SHORT_LABEL[it.label] || it.label.slice(0, 5),
        });
        b.addEventListener("click", () => onPick(l, h));
        td.append(b);
      }
      tr.append(td);
    }
    table.append(tr);
  }
  const legend = el("div", { class: "legend" });
  for (const lab of [...new Set(res.label_order.concat(["none"]))]) {
    legend.append(el("span", { class: "legend-item" },
      el("span", { class: "swatch", style: `background:${LABEL_COLOURS[lab] || "#ccc"}` }), lab));
  }
  container.replaceChildren(scroller(table, `${nH} heads`), legend);
  return table;
}

// short cell texts: 12 heads fit a 480 px panel (the full label is in the tooltip and legend)
const SHORT_LABEL = { none: "\u00b7", induction: "ind", previous_token: "prev", duplicate_token: "dup",
  next_token: "next", self: "self", sink: "sink", broad: "broad" };

/** `inner` in a horizontally scrolling box with a visible scroll bar; when it is wider than
 * the box a note says so ("scroll for all 25 heads \u2192"), checked again on resize. */
export function scroller(inner, what) {
  const box = el("div", { class: "grid-scroll" }, inner);
  const note = el("div", { class: "note scroll-note", text: `\u2194 scroll sideways for all ${what}` });
  note.hidden = true;
  const wrap = el("div", { class: "grid-scroll-wrap" }, box, note);
  const check = () => { note.hidden = box.scrollWidth <= box.clientWidth + 1; wrap.dataset.scrolls = note.hidden ? "0" : "1"; };
  if (typeof ResizeObserver !== "undefined") new ResizeObserver(check).observe(box);
  requestAnimationFrame(check);
  return wrap;
}

/**
 * Hidden-state trajectories in PCA space: one path per selected token, an arrow on every step
 * (state i -> i+1), first and last states labelled with their index, the token at the end;
 * axes "PC 1 (x % of variance)".
 * @param t  {paths: Tensor [token, state, component], positions, states, labels, evr}
 */
export function trajectoryPlot(container, t) {
  const W = 620, H = 460, pad = 56;
  const nT = t.paths.shape[0], nS = t.paths.shape[1];
  let xs = [], ys = [];
  for (let i = 0; i < nT; i++) for (let s = 0; s < nS; s++) { xs.push(t.paths.get(i, s, 0)); ys.push(t.paths.get(i, s, 1)); }
  const [xmin, xmax] = [Math.min(...xs), Math.max(...xs)], [ymin, ymax] = [Math.min(...ys), Math.max(...ys)];
  const sx = (x) => pad + ((x - xmin) / (xmax - xmin || 1)) * (W - 2 * pad);
  const sy = (y) => H - pad - ((y - ymin) / (ymax - ymin || 1)) * (H - 2 * pad);
  const svg = el("svg", { width: W, height: H, class: "trajectories", role: "img",
    "aria-label": "hidden-state trajectories in PCA space" });
  const defs = el("defs");
  svg.append(defs);
  const pct = (v) => `${(100 * v).toFixed(1)} % of variance`;
  svg.append(
    el("line", { x1: pad, y1: H - pad, x2: W - pad, y2: H - pad, class: "axisline" }),
    el("line", { x1: pad, y1: pad, x2: pad, y2: H - pad, class: "axisline" }),
    el("text", { x: W / 2, y: H - 14, "text-anchor": "middle", class: "axis xlabel", text: `PC 1 (${pct(t.evr[0])})` }),
    el("text", { x: 16, y: H / 2, "text-anchor": "middle", class: "axis ylabel", transform: `rotate(-90 16 ${H / 2})`,
      text: `PC 2 (${pct(t.evr[1])})` }));
  for (const [v, x] of [[xmin, pad], [xmax, W - pad]]) svg.append(el("text", { x, y: H - pad + 16, "text-anchor": "middle", class: "tick", text: v.toFixed(1) }));
  for (const [v, y] of [[ymin, H - pad], [ymax, pad]]) svg.append(el("text", { x: pad - 6, y, "text-anchor": "end", class: "tick", text: v.toFixed(1) }));
  const placed = [];  // boxes of the token labels drawn so far
  let hidden = 0;
  for (let i = 0; i < nT; i++) {
    const col = seriesColour(i);
    const id = `arrow-${i}-${Math.random().toString(36).slice(2, 8)}`;
    defs.append(el("marker", { id, viewBox: "0 0 10 10", refX: "9", refY: "5", markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse" },
      el("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: col })));
    const g = el("g", { class: "path", "data-pos": t.positions[i] });
    for (let s = 0; s + 1 < nS; s++) {
      g.append(el("line", { x1: sx(t.paths.get(i, s, 0)), y1: sy(t.paths.get(i, s, 1)),
        x2: sx(t.paths.get(i, s + 1, 0)), y2: sy(t.paths.get(i, s + 1, 1)), stroke: col, "stroke-width": 1.6,
        "marker-end": `url(#${id})`, class: "step" }));
    }
    for (const s of [0, nS - 1]) {
      g.append(el("text", { x: sx(t.paths.get(i, s, 0)) + 3, y: sy(t.paths.get(i, s, 1)) - 3, class: "state", text: String(t.states[s]) }));
    }
    const word = showLabel(t.labels[t.positions[i]]);
    g.append(el("title", { text: `position ${t.positions[i]}: ${word}` }));
    const spot = labelSpot(placed, sx(t.paths.get(i, nS - 1, 0)), sy(t.paths.get(i, nS - 1, 1)), word.length, W, H);
    if (spot) {
      g.append(el("text", { x: spot.x, y: spot.y, "text-anchor": spot.anchor, fill: col, class: "toklabel",
        "data-pos": t.positions[i], text: word }));
    } else {
      hidden++;
    }
    svg.append(g);
  }
  const parts = [svg];
  if (hidden) parts.push(el("p", { class: "note", text: `${hidden} token label(s) not drawn where they would overlap another; hover a path for its token` }));
  container.replaceChildren(...parts);
  return svg;
}

/**
 * Where a token label of `len` characters goes next to its path's end (x, y): below right,
 * above right, then to the left of it, inside the W x H plot and clear of every label in
 * `placed` (boxes of ~7.8 px per character, 14 px high; the chosen box is added). Null when
 * every spot overlaps (the label is left out; the path's tooltip names the token).
 */
function labelSpot(placed, x, y, len, W, H) {
  const w = 7.8 * Math.max(1, len) + 2, h = 14;
  const tries = [[x + 6, y + 12, "start"], [x + 6, y - 6, "start"], [x - 6, y + 12, "end"], [x - 6, y - 6, "end"],
    [x + 6, y + 26, "start"], [x + 6, y - 20, "start"]];
  for (const [tx, ty, anchor] of tries) {
    const x0 = anchor === "start" ? tx : tx - w;
    const box = [x0, ty - h + 3, x0 + w, ty + 3];
    if (box[0] < 0 || box[2] > W || box[1] < 0 || box[3] > H) continue;
    if (placed.some((b) => box[0] < b[2] && b[0] < box[2] && box[1] < b[3] && b[1] < box[3])) continue;
    placed.push(box);
    return { x: tx, y: ty, anchor };
  }
  return null;
}

// ---- logit lens, direct logit attribution, effect grids, composition ------------------------

/**
 * Logit lens of one prompt (/v1/logit-lens `prompts[i]`): a table of residual states (rows,
 * forward order) x positions (columns), each cell the state's top token at that position,
 * coloured by its probability on the fixed 0..1 scale; the tooltip lists the top-k and the
 * rank / probability of the actual next token (or the request's target).
 * @param p     {tokens, states: [{label, loss, positions: [{position, top, target}]}]}
 * @param opts  {title, targetName ("next token" | "target")}
 */
export function lensGrid(container, p, opts = {}) {
  const labels = p.tokens.map((t) => t.label);
  const cols = p.states[0] ? p.states[0].positions.map((x) => x.position) : [];
  const what = opts.targetName || "next token";
  const table = el("table", { class: "lensgrid" });
  const hr = el("tr", {}, el("th", { class: "corner", text: "state \\ position" }));
  for (const c of cols) hr.append(el("th", { class: "tokhead", title: `position ${c}`, text: `${c} ${showLabel(labels[c] ?? "")}` }));
  hr.append(el("th", { text: "loss (nats)" }));
  table.append(hr);
  for (const st of p.states) {
    const tr = el("tr", {}, el("th", { text: st.label }));
    st.positions.forEach((x) => {
      const top = x.top[0];
      const prob = top ? top.prob : 0;
      const c = colour(prob);
      const tg = x.target;
      const tips = [`state ${st.label}, position ${x.position} (${JSON.stringify(labels[x.position] ?? "")})`,
        "top: " + x.top.map((t) => `${JSON.stringify(t.label)} ${fmt(t.prob)}`).join(", ")];
      if (tg) tips.push(`${what} ${JSON.stringify(tg.label)}: rank ${tg.rank} (0 = top), p ${fmtNum(tg.prob)}, log-prob ${fmtNum(tg.logprob)} nats`);
      else tips.push(`${what}: none (last position)`);
      const td = el("td", {
        class: "lenscell" + (tg && tg.rank === 0 ? " hit" : ""), title: tips.join("\n"),
        style: `background:${rgb(c)};color:${ink(c)}`, tabindex: "0",
        "data-state": st.label, "data-pos": x.position, "data-prob": String(prob),
        "data-rank": tg ? String(tg.rank) : "", text: top ? showLabel(top.label) : "",
      });
      tr.append(td);
    });
    tr.append(el("td", { class: "num", text: st.loss === null || st.loss === undefined ? "n/a" : fmtNum(st.loss) }));
    table.append(tr);
  }
  const parts = [];
  if (opts.title) parts.push(el("div", { class: "view-title", text: opts.title }));
  parts.push(scroller(table, `${cols.length} positions`));
  const bar = el("div", { class: "cbar-row" });
  colourBar(bar, { masked: false, title: "probability of the state's top token (0..1)" });
  bar.append(el("div", { class: "masked-key" }, el("span", { class: "swatch hit-swatch" }), `outlined: the top token is the ${what}`));
  parts.push(bar);
  container.replaceChildren(...parts);
  return table;
}

/**
 * Direct logit attribution at one position (/v1/logit-attribution `prompts[i].positions[j]`):
 * a horizontal bar per component (embed, pos_embed, every head, each layer's b_O and MLP) on a
 * scale symmetric around 0, ordered by layer or by |value|; below, the sum of the parts,
 * ln_final's bias term and the model's own logit difference (their residual is rounding).
 * @param d     the position entry; @param opts {order: "layer" | "value", title, direction}
 */
export function attributionBars(container, d, opts = {}) {
  const items = [["embed", d.embed, "embedding"]];
  // rotary families: no pos_embed, and no b_O where the model has none (null fields)
  if (d.pos_embed != null) items.push(["pos_embed", d.pos_embed, "embedding"]);
  d.heads.forEach((row, l) => {
    row.forEach((v, h) => items.push([`L${l}H${h}`, v, "head"]));
    if (d.attn_bias != null) items.push([`L${l} b_O`, d.attn_bias[l], "bias"]);
    items.push([`L${l} MLP`, d.mlp[l], "mlp"]);
  });
  if (opts.order === "value") items.sort((a, b) => Math.abs(b[1]) - Math.abs(a[1]));
  const vmax = Math.max(1e-12, ...items.map((x) => Math.abs(x[1])));
  const row = 15, lw = 86, bw = 420, vw = 64, top = 8;
  // a value column on each side of the bars: a negative bar's label never reaches the names
  const W = lw + 2 * vw + bw, H = top + items.length * row + 34;
  const x = (v) => lw + vw + bw / 2 + (v / vmax) * (bw / 2 - 4);
  const svg = el("svg", { width: W, height: H, class: "dla", role: "img",
    "aria-label": `direct logit attribution, ${items.length} components` });
  svg.append(el("line", { x1: x(0), y1: top - 4, x2: x(0), y2: top + items.length * row, class: "axisline" }));
  items.forEach(([name, v, kind], i) => {
    const y = top + i * row;
    const g = el("g", { class: `bar ${kind}`, "data-name": name, "data-value": String(v) });
    const x1 = Math.min(x(0), x(v)), w = Math.abs(x(v) - x(0));
    g.append(el("title", { text: `${name}: ${fmtNum(v, 4)}` }),
      el("text", { x: lw - 6, y: y + row / 2, "text-anchor": "end", "dominant-baseline": "middle", class: "tick", text: name }),
      el("rect", { x: x1, y: y + 2, width: Math.max(0.5, w), height: row - 4,
        fill: v >= 0 ? "#b2182b" : "#2166ac", "fill-opacity": kind === "head" ? 0.85 : 0.55 }),
      el("text", { x: v >= 0 ? x(v) + 3 : x(v) - 3, y: y + row / 2, "text-anchor": v >= 0 ? "start" : "end",
        "dominant-baseline": "middle", class: "tick num", text: fmtNum(v) }));
    svg.append(g);
  });
  const yb = top + items.length * row + 14;
  svg.append(el("text", { x: x(-vmax), y: yb, "text-anchor": "start", class: "tick", text: fmtNum(-vmax) }),
    el("text", { x: x(0), y: yb, "text-anchor": "middle", class: "tick", text: "0" }),
    el("text", { x: x(vmax), y: yb, "text-anchor": "end", class: "tick", text: fmtNum(vmax) }),
    el("text", { x: x(0), y: yb + 14, "text-anchor": "middle", class: "axis xlabel",
      text: `contribution to ${opts.direction || "the logit difference"}` }));
  const sum = el("table", { class: "dla-sum" });
  for (const [k, v, note] of [["sum of the parts", d.sum_of_parts, "embed + pos_embed + heads + b_O + MLP"],
    ["ln_final bias b \u00b7 d", d.ln_final_bias, "no component's: the final LayerNorm's bias"],
    ...(d.pre_softcap_logit_diff != null ? [["before the soft-cap", d.pre_softcap_logit_diff,
      "what the parts sum to (Gemma 2's final soft-cap is not additive)"]] : []),
    ["logit difference (model)", d.logit_diff, "the served logits"],
    ["residual error", d.residual_error, "float rounding"]]) {
    sum.append(el("tr", { "data-name": k }, el("th", { text: k }), el("td", { class: "num", text: fmtNum(v, 4) }),
      el("td", { class: "note", text: note })));
  }
  const parts = [];
  if (opts.title) parts.push(el("div", { class: "view-title", text: opts.title }));
  parts.push(scroller(svg, "bars"), sum);
  container.replaceChildren(...parts);
  return svg;
}

/**
 * An effect grid on a diverging scale centred on 0 (blue below, white at 0, red above),
 * symmetric at the largest |value| (nothing clipped), with its labelled colour bar; null
 * cells hatched ("n/a"). `grid` [row][col]; opts {rowLabels, colLabels, rowTitle, colTitle,
 * title, label (the colour bar's title), vmax, onCell(r, c)}.
 */
export function divergingGrid(container, grid, opts = {}) {
  const nR = grid.length, nC = nR ? grid[0].length : 0;
  const rowL = opts.rowLabels || Array.from({ length: nR }, (_, i) => String(i));
  const colL = opts.colLabels || Array.from({ length: nC }, (_, i) => String(i));
  const rowT = opts.rowTitle || "layer", colT = opts.colTitle || "head";
  let vmax = 0, na = 0;
  for (const r of grid) for (const v of r) { if (v === null || !Number.isFinite(v)) na++; else vmax = Math.max(vmax, Math.abs(v)); }
  const allZero = vmax === 0;
  vmax = opts.vmax || vmax || 1;
  const table = el("table", { class: "effectgrid" });
  const hr = el("tr", {}, el("th", { class: "corner", text: `${rowT} \\ ${colT}` }));
  for (const c of colL) hr.append(el("th", { text: c }));
  table.append(hr);
  const writeValues = nC <= 16;
  grid.forEach((r, i) => {
    const tr = el("tr", {}, el("th", { text: rowL[i] }));
    r.forEach((v, j) => {
      const ok = v !== null && Number.isFinite(v);
      const c = ok ? divergingColour(v, vmax) : null;
      const td = el("td", {
        class: "effcell" + (ok ? "" : " na"), tabindex: "0",
        title: `${rowT} ${rowL[i]}, ${colT} ${colL[j]}: ${ok ? fmtNum(v, 4) : "n/a"}`,
        style: ok ? `background:${rgb(c)};color:${ink(c)}` : null,
        "data-row": i, "data-col": j, "data-value": ok ? String(v) : "null",
        text: ok && writeValues ? fmtNum(v, 2) : "",
      });
      if (opts.onCell) td.addEventListener("click", () => opts.onCell(i, j));
      tr.append(td);
    });
    table.append(tr);
  });
  const parts = [];
  if (opts.title) parts.push(el("div", { class: "view-title", text: opts.title }));
  parts.push(scroller(table, `${nC} ${colT}s`));
  const bar = el("div", { class: "cbar-row" });
  colourBar(bar, { masked: false, title: `${opts.label || "effect"} (0 = white, scale \u00b1max |value|)`,
    vmin: -vmax, vmax, colourOf: (v) => divergingColour(v, vmax), na: na ? "n/a: no value" : null });
  parts.push(bar);
  if (allZero && na < nR * nC) parts.push(el("p", { class: "note all-zero", text: "every value is exactly 0" }));
  container.replaceChildren(...parts);
  return table;
}

export const COMPOSITION_COLOURS = { q: "#1f77b4", k: "#d62728", v: "#2ca02c" };

/** Scores of one composition kind over the pairs layer_a < layer_b: [[la, ha, lb, hb, s]]. */
export function compositionEdges(comp, kind) {
  const out = [];
  const g = comp[kind];
  for (let la = 0; la < g.length; la++) for (let ha = 0; ha < g[la].length; ha++) {
    for (let lb = la + 1; lb < g[la][ha].length; lb++) for (let hb = 0; hb < g[la][ha][lb].length; hb++) {
      out.push([la, ha, lb, hb, g[la][ha][lb][hb]]);
    }
  }
  return out;
}

/** A threshold for the graph: the mean + 2 standard deviations of the kinds' scores. */
export function defaultThreshold(comp, kinds) {
  const s = kinds.flatMap((k) => compositionEdges(comp, k).map((e) => e[4]));
  if (!s.length) return 0;
  const m = s.reduce((a, b) => a + b, 0) / s.length;
  const sd = Math.sqrt(s.reduce((a, b) => a + (b - m) ** 2, 0) / s.length);
  return Number((m + 2 * sd).toPrecision(3));
}

/**
 * Layer-ordered head graph of /v1/circuits: a column of nodes per layer (one per head), an
 * edge a -> b (layer_a < layer_b) for each Q/K/V composition score at or above `threshold`,
 * its width growing with the score, its colour the kind; every edge's score in its tooltip.
 * @param c     {n_layers, n_heads, composition: {q, k, v}}
 * @param opts  {kinds: ["q","k","v"], threshold, title, maxEdges}
 */
export function compositionGraph(container, c, opts = {}) {
  const kinds = opts.kinds || ["q", "k", "v"];
  const thr = opts.threshold ?? defaultThreshold(c.composition, kinds);
  const nL = c.n_layers, nH = c.n_heads;
  const dx = Math.max(90, Math.min(160, 900 / Math.max(1, nL))), dy = 25, left = 56, topY = 34;
  const W = left + (nL - 1) * dx + 50, H = topY + nH * dy + 10;
  const X = (l) => left + l * dx, Y = (h) => topY + h * dy + dy / 2;
  let edges = [];
  let total = 0;
  for (const k of kinds) {
    const all = compositionEdges(c.composition, k);
    total += all.length;
    for (const e of all) if (e[4] >= thr) edges.push([...e, k]);
  }
  const found = edges.length;
  const maxEdges = opts.maxEdges ?? 1500;
  edges.sort((a, b) => b[4] - a[4]);
  if (edges.length > maxEdges) edges.length = maxEdges;
  const smax = edges.length ? edges[0][4] : thr;
  const svg = el("svg", { width: W, height: H, class: "compgraph", role: "img",
    "aria-label": `composition graph: ${nL} layers x ${nH} heads, ${edges.length} edges` });
  for (let l = 0; l < nL; l++) svg.append(el("text", { x: X(l), y: 14, "text-anchor": "middle", class: "axis", text: `layer ${l}` }));
  svg.append(el("text", { x: 12, y: topY + (nH * dy) / 2, "text-anchor": "middle", class: "axis",
    transform: `rotate(-90 12 ${topY + (nH * dy) / 2})`, text: "head" }));
  const gE = el("g", { class: "edges" });
  for (const [la, ha, lb, hb, s, k] of [...edges].reverse()) {  // strongest drawn last (on top)
    const w = 0.6 + 4 * (smax > thr ? (s - thr) / (smax - thr) : 1);
    const mid = (X(la) + X(lb)) / 2;
    gE.append(el("path", { d: `M ${X(la) + 10} ${Y(ha)} C ${mid} ${Y(ha)}, ${mid} ${Y(hb)}, ${X(lb) - 10} ${Y(hb)}`,
      fill: "none", stroke: COMPOSITION_COLOURS[k], "stroke-width": w.toFixed(2), "stroke-opacity": 0.75,
      class: `edge edge-${k}`, "data-kind": k, "data-from": `${la}.${ha}`, "data-to": `${lb}.${hb}`, "data-score": String(s) },
      el("title", { text: `L${la}H${ha} \u2192 L${lb}H${hb}: ${k.toUpperCase()}-composition ${fmtNum(s, 4)}` })));
  }
  svg.append(gE);
  for (let l = 0; l < nL; l++) for (let h = 0; h < nH; h++) {
    svg.append(el("g", { class: "node", "data-layer": l, "data-head": h },
      el("circle", { cx: X(l), cy: Y(h), r: 10, fill: "#fff", stroke: "#555" }),
      el("text", { x: X(l), y: Y(h) + 0.5, "text-anchor": "middle", "dominant-baseline": "middle", class: "tick", text: String(h) }),
      el("title", { text: `layer ${l}, head ${h}` })));
  }
  const legend = el("div", { class: "legend" });
  for (const k of kinds) legend.append(el("span", { class: "legend-item" },
    el("span", { class: "swatch", style: `background:${COMPOSITION_COLOURS[k]}` }), `${k.toUpperCase()}-composition`));
  legend.append(el("span", { class: "note comp-count", text: (found > edges.length
    ? `the strongest ${edges.length} of ${found} edges` : `${found} edges`) +
    ` with score \u2265 ${fmtNum(thr)} (of ${total} head pairs x kinds; width grows with the score up to ${fmtNum(smax)})` }));
  const parts = [];
  if (opts.title) parts.push(el("div", { class: "view-title", text: opts.title }));
  parts.push(legend, scroller(svg, `${nL} layers`));
  container.replaceChildren(...parts);
  return svg;
}

/**
 * The views of a /v1/patch response: the metric's clean and corrupted values, the [layer][head]
 * grid, the [head][position] grid of a chosen layer (per_position; one scale for every layer)
 * and the residual [layer][position] grid. When clean and corrupted give the same metric the
 * normalised effect has no value (0 / 0): it says so and draws the raw change instead.
 */
export function patchView(box, r, opts = {}) {
  box.replaceChildren();
  const add = (cls) => { const d = document.createElement("div"); d.className = cls; box.append(d); return d; };
  const metricName = r.logit_diff ? `logit difference ${JSON.stringify(r.logit_diff.target.label)} \u2212 ${JSON.stringify(r.logit_diff.distractor.label)}`
    : r.metric === "loss" ? "loss (nats)" : `declared metric ${r.metric}`;
  const head = add("note");
  head.textContent = `${metricName}: clean ${fmtNum(r.clean_value, 4)}, corrupted ${fmtNum(r.corrupted_value, 4)}` +
    (r.approximation ? `; ${r.approximation}` : "");
  const labels = r.clean_tokens.map((t, i) => `${i} ${showLabel(t.label)}`);
  const equal = r.clean_value === r.corrupted_value;
  let norm = "(patched \u2212 corrupted) / (clean \u2212 corrupted): 0 = no change, 1 = restores the clean run";
  let heads = r.heads;
  let perPos = r.heads_per_position, resid = r.residual;
  if (equal) {  // 0 / 0: no grid at all (a symmetric scale would paint float noise dark red)
    let raw = 0;
    const flat = (a) => Array.isArray(a) ? a.flatMap(flat) : [a];
    for (const v of flat(r.grid ? r.grid.raw : r.heads_raw)) if (v !== null) raw = Math.max(raw, Math.abs(v - r.corrupted_value));
    const msg = add("panel-msg patch-equal");
    msg.textContent = `The clean and corrupted runs give the same ${metricName} (${fmtNum(r.clean_value, 6)}): the normalised ` +
      "effect (patched \u2212 corrupted) / (clean \u2212 corrupted) divides by zero, so no cell has a value and no grid is drawn. " +
      `The largest raw change any patched head makes is ${fmtNum(raw, 2)}. Choose a corrupted text that changes the metric.`;
    return;
  }
  if (r.grid) {  // /v1/patch hook: TransformerLens' get_act_patch_* grid at that hook
    const g = r.grid, isPos = (a) => a === "pos" || a === "dest_pos";
    const opt = (ax) => ({ rowTitle: ax[0], colTitle: ax[1], label: norm, colLabels: isPos(ax[1]) ? labels : undefined,
      rowLabels: isPos(ax[0]) ? labels : undefined });
    const title = `${opts.model || r.model.id} \u00b7 ${g.hook_name} patched (${g.function})`;
    if (g.axes.length === 2) {
      divergingGrid(add("patch-grid"), g.normalized, { ...opt(g.axes), title });
    } else {
      let vmax = 0;
      for (const L of g.normalized) for (const row of L) for (const v of row) if (v !== null) vmax = Math.max(vmax, Math.abs(v));
      const ctl = add("ctrl");
      const sel = document.createElement("select");
      sel.className = "patch-layer";
      g.normalized.forEach((_, l) => sel.append(new Option(`layer ${l}`, String(l))));
      const lab = document.createElement("label"); lab.append("layer: ", sel); ctl.append(lab);
      const box2 = add("patch-grid");
      const draw = () => divergingGrid(box2, g.normalized[+sel.value], { ...opt(g.axes.slice(1)), vmax: vmax || 1,
        title: `${title}, layer ${sel.value} (scale shared by every layer)` });
      sel.addEventListener("change", draw);
      draw();
    }
    return;
  }
  divergingGrid(add("patch-heads"), heads, { rowTitle: "layer", colTitle: "head", label: norm,
    title: `${opts.model || r.model.id} \u00b7 patching each head's output (all positions)` });
  if (perPos) {
    let vmax = 0;
    for (const L of perPos) for (const row of L) for (const v of row) if (v !== null) vmax = Math.max(vmax, Math.abs(v));
    const ctl = add("ctrl");
    const sel = document.createElement("select");
    sel.className = "patch-layer";
    perPos.forEach((_, l) => sel.append(new Option(`layer ${l}`, String(l))));
    const lab = document.createElement("label"); lab.append("per position: ", sel); ctl.append(lab);
    const grid = add("patch-perpos");
    const draw = () => divergingGrid(grid, perPos[+sel.value], { rowTitle: "head", colTitle: "position", colLabels: labels,
      label: norm, vmax: vmax || 1, title: `layer ${sel.value}: one head at one position patched (scale shared by every layer)` });
    sel.addEventListener("change", draw);
    draw();
  }
  if (resid) {
    divergingGrid(add("patch-resid"), resid, { rowTitle: "layer", colTitle: "position", colLabels: labels, label: norm,
      title: "residual stream (resid_pre of each layer) patched at one position" });
  }
}


// ---- path patching (/v1/path-patch) ----------------------------------------------------------

/** The metric of a /v1/path-patch response (or request) in words. */
function ppMetricName(r) {
  const m = { logit_diff: "logit difference", prob: "probability", logprob: "log-probability (nats)",
    loss: "loss (nats)", kl: "KL to the base run (nats)" }[r.metric] || `metric ${r.metric}`;
  return r.reduce && r.reduce !== "mean" ? `${m} (${r.reduce} of the terms)` : m;
}

const ppStat = (s) => s ? `${fmtNum(s.mean, 4)}${s.std !== null && s.std !== undefined ? ` \u00b1 ${fmtNum(s.std, 2)}` : ""}` : "n/a";

/** A sender or receiver ({kind, layer, head | heads, input, head_axis}) in words, with kv
 * labels; a k/v receiver of a grouped-query model (head_axis "kv_head") names key/value heads. */
export function componentName(c, kv = null) {
  if (c.kind === "logits") return "the logits";
  if (c.kind === "mlp") return `MLP ${c.layer}`;
  if (c.head !== undefined) return `L${c.layer} ${headName(c.head, kv)}`;
  const hs = c.heads || [];
  if (c.head_axis === "kv_head") return `L${c.layer} ${hs.length === 1 ? `kv ${hs[0]}` : `kv heads ${hs.join(", ")}`} ${c.input} input`;
  return `L${c.layer} ${hs.length === 1 ? headName(hs[0], kv) : `heads ${hs.join(", ")}`} ${c.input} input`;
}

/** "kv 1" with the query heads that read it ("kv 1 (heads 2, 3)" as a title). */
const kvHeadName = (g) => `kv ${g}`;
const kvHeadTitle = (g, kv) => kv ? `key/value head ${g}: read by query heads ${kv.map((x, h) => (x === g ? h : -1)).filter((h) => h >= 0).join(", ")}` : `key/value head ${g}`;

/**
 * A sender x receiver table of path-patching results on the diverging scale of the normalised
 * effect (patched - base) / (other - base) (0 = the path carries nothing, 1 = all of the other
 * run's effect), n/a hatched. `rows` [{label, sender}], `cols` [{groups: [level0, level1, ...],
 * receiver}] (adjacent equal groups merged into one header cell), `cell(i, j)` -> {raw, std,
 * normalized} | null. Each td carries data-row/col, data-sender, data-receiver, data-input,
 * data-value (normalised), data-raw; hovering or focusing a cell writes its raw metric, change
 * and normalised value into the readout (.pp-readout) and its title.
 */
function pathGrid(container, rows, cols, cell, opts = {}) {
  let vmax = 0, na = 0;
  const vals = rows.map((_, i) => cols.map((_, j) => {
    const c = cell(i, j);
    const ok = c && c.normalized !== null && c.normalized !== undefined && Number.isFinite(c.normalized);
    if (ok) vmax = Math.max(vmax, Math.abs(c.normalized)); else na++;
    return ok ? c : null;
  }));
  vmax = vmax || 1;
  const table = el("table", { class: "effectgrid pathgrid" });
  const levels = Math.max(1, ...cols.map((c) => c.groups.length));
  for (let lv = 0; lv < levels; lv++) {
    const tr = el("tr", { class: `pp-head pp-head-${lv}` });
    tr.append(el("th", { class: "corner", text: lv === levels - 1 ? "sender \\ receiver" : "" }));
    for (let j = 0; j < cols.length;) {
      const key = (k) => cols[k].groups.slice(0, lv + 1).join("\u0000");
      let n = 1;
      while (j + n < cols.length && key(j + n) === key(j)) n++;
      tr.append(el("th", { class: "pp-colhead", colspan: n > 1 ? n : null, "data-col": j, "data-level": lv,
        title: lv === levels - 1 || n === 1 ? cols[j].title || null : null, text: cols[j].groups[lv] ?? "" }));
      j += n;
    }
    table.append(tr);
  }
  const readout = el("div", { class: "note pp-readout", role: "status", "aria-live": "polite",
    text: "hover or focus a cell for its values" });
  const base = opts.base, other = opts.other;
  vals.forEach((r, i) => {
    const tr = el("tr", {}, el("th", { class: "pp-rowhead", "data-row": i, text: rows[i].label }));
    r.forEach((c, j) => {
      const raw = cell(i, j);
      const where = `sender ${rows[i].label} \u2192 receiver ${cols[j].label}`;
      const txt = !raw ? `${where}: n/a (the receiver is not after the sender)`
        : `${where}: patched ${ppStat({ mean: raw.raw, std: raw.std })}` +
          (base ? ` (base ${fmtNum(base.mean, 4)}, other ${fmtNum(other.mean, 4)}; change ${fmtNum(raw.raw - base.mean, 4)})` : "") +
          `; normalised ${c ? fmtNum(c.normalized, 4) : "n/a"}`;
      const col = c ? divergingColour(c.normalized, vmax) : null;
      const td = el("td", {
        class: "effcell" + (c ? "" : " na"), tabindex: "0", title: txt,
        style: c ? `background:${rgb(col)};color:${ink(col)}` : null,
        "data-row": i, "data-col": j, "data-sender": rows[i].key, "data-receiver": cols[j].key,
        "data-input": cols[j].input ?? "", "data-value": c ? String(c.normalized) : "null",
        "data-raw": raw && raw.raw !== null && raw.raw !== undefined ? String(raw.raw) : "null",
        text: c && cols.length <= 16 ? fmtNum(c.normalized, 2) : "",
      });
      const show = () => { readout.textContent = txt; readout.dataset.row = i; readout.dataset.col = j; };
      td.addEventListener("mouseenter", show);
      td.addEventListener("focus", show);
      tr.append(td);
    });
    table.append(tr);
  });
  const parts = [];
  if (opts.title) parts.push(el("div", { class: "view-title", text: opts.title }));
  parts.push(scroller(table, `${cols.length} receivers`), readout);
  const bar = el("div", { class: "cbar-row" });
  colourBar(bar, { masked: false, title: "normalised (patched \u2212 base) / (other \u2212 base): 0 = nothing, 1 = the other run's whole effect (scale \u00b1max |value|)",
    vmin: -vmax, vmax, colourOf: (v) => divergingColour(v, vmax), na: na ? "n/a: the receiver is not after the sender" : null });
  parts.push(bar);
  container.replaceChildren(...parts);
  return table;
}

/** The runs' statistics of a /v1/path-patch response (base, other, patched) as a table. */
function ppSummary(r) {
  const t = el("table", { class: "pp-summary" });
  const rows = [[`base run (${r.base_run})`, r.base, "everything but the senders' direct path frozen here"],
    [`other run (${r.other_run})`, r.other, "the senders' outputs come from here"]];
  if (r.patched) rows.push(["path-patched", r.patched, r.receivers ? `senders \u2192 receivers` : ""]);
  for (const [k, s, note] of rows) {
    t.append(el("tr", { "data-name": k.split(" ")[0] }, el("th", { text: k }), el("td", { class: "num", text: ppStat(s) }),
      el("td", { class: "note", text: note })));
  }
  if (r.patched) {
    t.append(el("tr", { "data-name": "normalized" }, el("th", { text: "normalised" }),
      el("td", { class: "num pp-normalized", text: fmtNum(r.normalized, 4) }),
      el("td", { class: "note", text: "(patched \u2212 base) / (other \u2212 base): 0 = the path carries nothing, 1 = all of the other run's effect" })));
  }
  return t;
}

/**
 * The views of a /v1/path-patch response (Wang et al. 2022): the metric on the base and other
 * runs (mean +- sample std over the pairs, n); with `grid` a sender head x receiver head input
 * table ([sender_layer][sender_head] rows, [receiver_layer][receiver_head][input] columns with
 * a three-level header: layer, "head h \u00b7 kv g" on grouped-query models, input); otherwise the
 * single experiment's patched value and normalised effect. Equal base and other metrics: the
 * normalised effect divides by zero, so it says so and draws no grid.
 * @param opts {model, kv (query head -> key/value head, or null), title}
 */
export function pathPatchView(box, r, opts = {}) {
  const kv = gqaMap(opts.kv);
  const n = r.base.n;
  const head = el("p", { class: "note pp-head-note" });
  head.textContent = `${ppMetricName(r)} over ${n} pair${n === 1 ? "" : "s"}: base (${r.base_run}) ${ppStat(r.base)}, ` +
    `other (${r.other_run}) ${ppStat(r.other)}; direction ${r.direction}`;
  const parts = [head];
  if (!r.grid) {
    const what = el("p", { class: "pp-what", text: `senders ${(r.senders || []).map((c) => componentName(c, kv)).join(", ")} ` +
      `\u2192 receivers ${(r.receivers || []).map((c) => componentName(c, kv)).join(", ")}` });
    parts.push(what, ppSummary(r));
    box.replaceChildren(...parts);
    return;
  }
  if (r.base.mean === r.other.mean) {
    parts.push(el("div", { class: "panel-msg pp-equal", text: `The base and other runs give the same ${ppMetricName(r)} ` +
      `(${fmtNum(r.base.mean, 6)}): the normalised effect (patched \u2212 base) / (other \u2212 base) divides by zero, so no ` +
      "cell has a value and no grid is drawn. Choose a corrupted text that changes the metric." }));
    box.replaceChildren(...parts);
    return;
  }
  const g = r.grid, L = g.raw.length, H = L ? g.raw[0].length : 0;
  const axes = g.head_axes || {}, nRecv = g.receiver_heads || {};
  const rows = [], cols = [];
  for (let l = 0; l + 1 < L; l++) for (let h = 0; h < H; h++) rows.push({ l, h, key: `${l}.${h}`, label: `L${l} ${headName(h, kv)}` });
  if (g.inputs.some((inp) => axes[inp] === "kv_head")) {
    // grouped-query attention: k/v receivers are key/value heads, so columns go layer / input / head
    for (let l = 1; l < L; l++) g.inputs.forEach((inp, k) => {
      const byKv = axes[inp] === "kv_head";
      for (let h = 0; h < (nRecv[inp] ?? H); h++) {
        const name = byKv ? kvHeadName(h) : headName(h, kv);
        cols.push({ l, h, k, input: inp, key: `${l}.${h}`, groups: [`layer ${l}`, inp, name],
          title: byKv ? kvHeadTitle(h, kv) : null, label: `L${l} ${name} ${inp} input` });
      }
    });
  } else {
    for (let l = 1; l < L; l++) for (let h = 0; h < H; h++) g.inputs.forEach((inp, k) => cols.push({ l, h, k, input: inp,
      key: `${l}.${h}`, groups: [`layer ${l}`, headName(h, kv), inp], label: `L${l} ${headName(h, kv)} ${inp} input` }));
  }
  const grid = el("div", { class: "pp-grid" });
  parts.push(grid);
  box.replaceChildren(...parts);
  pathGrid(grid, rows, cols, (i, j) => {
    const s = rows[i], c = cols[j];
    const raw = g.raw[s.l][s.h][c.l][c.h][c.k];
    if (raw === null) return null;
    return { raw, std: g.std[s.l][s.h][c.l][c.h][c.k], normalized: g.normalized[s.l][s.h][c.l][c.h][c.k] };
  }, { base: r.base, other: r.other, title: opts.title ||
    `${opts.model || r.model.id} \u00b7 path patching every sender head \u2192 every later head's ${g.inputs.join("/")} input` });
}

/**
 * A grid of separate path-patching experiments, one per (sender, receiver) cell (the explorer's
 * "each pair" mode): `cells[i][j]` a /v1/path-patch response of senders [senders[i]] ->
 * receivers [receivers[j]], or null where the receiver is not after the sender.
 * @param opts {model, kv, title}
 */
export function pathPatchCells(box, senders, receivers, cells, opts = {}) {
  const kv = gqaMap(opts.kv);
  const any = cells.flat().find((c) => c);
  const parts = [];
  if (any) {
    parts.push(el("p", { class: "note pp-head-note", text: `${ppMetricName(any)} over ${any.base.n} pair${any.base.n === 1 ? "" : "s"}: ` +
      `base (${any.base_run}) ${ppStat(any.base)}, other (${any.other_run}) ${ppStat(any.other)}; one experiment per cell` }));
  }
  const grid = el("div", { class: "pp-grid" });
  parts.push(grid);
  box.replaceChildren(...parts);
  const rows = senders.map((s) => ({ key: s.kind === "mlp" ? `mlp.${s.layer}` : `${s.layer}.${s.head}`, label: componentName(s, kv) }));
  const cols = receivers.map((r) => {
    if (r.kind === "logits") return { key: "logits", input: "", groups: ["logits", "", ""], label: "the logits" };
    if (r.kind === "mlp") return { key: `mlp.${r.layer}`, input: "mlp", groups: [`layer ${r.layer}`, "MLP", "input"], label: `MLP ${r.layer} input` };
    const h = r.heads[0], name = r.head_axis === "kv_head" ? kvHeadName(h) : headName(h, kv);
    return { key: `${r.layer}.${h}`, input: r.input, groups: [`layer ${r.layer}`, name, r.input],
      title: r.head_axis === "kv_head" ? kvHeadTitle(h, kv) : null, label: `L${r.layer} ${name} ${r.input} input` };
  });
  pathGrid(grid, rows, cols, (i, j) => {
    const c = cells[i][j];
    return c ? { raw: c.patched.mean, std: c.patched.std, normalized: c.normalized } : null;
  }, { base: any ? any.base : null, other: any ? any.other : null, title: opts.title });
}
