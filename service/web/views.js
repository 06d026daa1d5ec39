// views.js — the explorer's drawings, on plain decoded data (no fetching), so the page and
// the notebook views (attnscope.client.notebook) draw the same thing:
//   heatmap()     one attention matrix [query_pos, key_pos] on a canvas, colour scale 0..1,
//                 masked cells (future keys of a causal model) hatched grey, value on hover
//                 and keyboard focus (arrow keys)
//   lineView()    bertviz-style lines query token -> key tokens, line weight = attention
//   headGrid()    layer x head buttons coloured by label, every score in the tooltip
//   trajectoryPlot()  per-token PCA paths with arrows, explained variance on the axes
//   colourBar()   the labelled 0..1 scale

export const LABEL_COLOURS = {
  induction: "#d62728", previous_token: "#1f77b4", duplicate_token: "#9467bd",
  next_token: "#17becf", self: "#2ca02c", sink: "#ff7f0e", broad: "#bcbd22", none: "#d9d9d9",
};
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
  "#7f7f7f", "#bcbd22", "#17becf"];
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

/** The labelled colour scale: a 0..1 gradient with ticks, its title, and the masked swatch. */
export function colourBar(container, { masked = true, title = "attention weight (post-softmax)", vmax = 1 } = {}) {
  container.replaceChildren();
  const w = 220, h = 12;
  const c = el("canvas", { width: w, height: h, class: "cbar", "data-vmin": "0", "data-vmax": String(vmax) });
  const g = c.getContext("2d");
  for (let x = 0; x < w; x++) {
    const [r, gg, b] = colour(x / (w - 1));
    g.fillStyle = `rgb(${r},${gg},${b})`;
    g.fillRect(x, 0, 1, h);
  }
  const ticks = el("div", { class: "cbar-ticks" });
  for (const t of [0, 0.25, 0.5, 0.75, 1]) ticks.append(el("span", { text: vmax === 1 ? String(t) : fmt(t * vmax) }));
  const box = el("div", { class: "cbar-box" }, el("div", { class: "cbar-title", text: title }), c, ticks);
  container.append(box);
  if (masked) {
    container.append(el("div", { class: "masked-key" },
      el("span", { class: "swatch masked-swatch" }), "masked (future key: not attended)"));
  }
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
      (isMasked ? "masked (future key)" : fmt(v));
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
  });
  const wrap = el("div", { class: "heatmap-wrap" });
  if (opts.title) wrap.append(el("div", { class: "view-title", text: opts.title }));
  const stage = el("div", { class: "heatmap-stage" }, c, tip);
  wrap.append(stage);
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

export function headColour(h) { return PALETTE[h % PALETTE.length]; }

/**
 * Layer x head grid of /v1/heads: a button per head coloured by its label, every score in its
 * tooltip (title) and aria-label; `onPick(layer, head)` on click / Enter.
 */
export function headGrid(container, res, onPick, selected = null) {
  const heads = res.heads;
  const nL = 1 + Math.max(...heads.map((h) => h.layer));
  const nH = 1 + Math.max(...heads.map((h) => h.head));
  const by = new Map(heads.map((h) => [`${h.layer},${h.head}`, h]));
  const table = el("table", { class: "headgrid" });
  const hr = el("tr", {}, el("th", { text: "layer \\ head" }));
  for (let h = 0; h < nH; h++) hr.append(el("th", { text: String(h) }));
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
          title: `layer ${l}, head ${h}: ${named}\n${scores}`,
          "aria-label": `layer ${l} head ${h}, ${named}; ${scores.replace(/\n/g, ", ")}`,
          "data-layer": l, "data-head": h, "data-label": it.label,
          text: it.label === "none" ? "\u00b7" : it.label.replace("_token", "").replace("duplicate", "dup"),
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
  container.replaceChildren(table, legend);
  return table;
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
    const col = PALETTE[i % PALETTE.length];
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
