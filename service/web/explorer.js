// explorer.js — the page at / and /explorer: type a text, see what the model's attention does.
//
// State (text, layer, head, add_bos) lives in the URL (?text=...&layer=1&head=0|mean), so a
// view can be shared. Patterns come as base64 float16 (layout "tril" for causal models), one
// layer per request, cached per (text, layer, head mean); every number shown is the service's.
//
// Extra panels (ablation/patching effect grids, norms, rollout ...) plug in with
//   import { registerPanel } from "/static/web/explorer.js";
//   registerPanel({ id: "rollout", title: "Attention rollout", async render(ctx, body) { ... } });
// render() runs after every analysis with ctx = {client, model, text, addBos, layer, head,
// tokens, setStatus}; it fills `body` (a <div> in its own <section id="panel-ID">, which gets
// data-ready="1" once render resolved). `layerAware: true` also re-renders it whenever the
// layer or head changes.

import { Client, ApiError, decodeTensor } from "./attnscope.js";
import { colourBar, headColour, headGrid, heatmap, lineView, showLabel, trajectoryPlot, fmt, fmtNum, lensGrid,
  attributionBars, divergingGrid, compositionGraph, defaultThreshold, patchView, pathPatchView, pathPatchCells } from "./views.js";

const $ = (s) => document.querySelector(s);
const client = new Client("");
const panels = [];
const state = { text: "", layer: 0, head: "mean", addBos: null, view: "weight" };
let model = null;
let tokens = [];
let cache = new Map();  // `${layer}|${mean}` -> Tensor [1, H, T, T] or [1, T, T]
let heads = null;
let runId = 0;
// the latest call of each layer-aware render: an earlier call's reply is dropped (a slow reply
// for layer 1 / head mean must not overwrite the layer 1 / head 2 picked after it)
const latestCall = {};
function callTicket(name) { return (latestCall[name] = (latestCall[name] || 0) + 1); }

/** Register an extra panel (see the header). Panels registered after an analysis render at once. */
export function registerPanel(p) {
  panels.push(p);
  const sec = document.createElement("section");
  sec.className = "panel";
  sec.id = `panel-${p.id}`;
  const h = document.createElement("h2");
  h.textContent = p.title;
  const body = document.createElement("div");
  body.className = "panel-body";
  sec.append(h, body);
  $("#extra-panels").append(sec);
  p.body = body;
  if (tokens.length) renderPanel(p);
}
window.attnscope = { registerPanel, state, client };

function setStatus(msg, kind = "info") {
  const s = $("#status");
  s.textContent = msg;
  s.dataset.kind = kind;
}

function describeError(e) {
  if (e instanceof ApiError) return `${e.status} ${e.type}${e.param ? ` (${e.param})` : ""}: ${e.message}`;
  return String(e && e.message ? e.message : e);
}

const urlNotes = [];  // URL values that are not indices, said in the status line

function readUrl() {
  const u = new URLSearchParams(location.search);
  state.text = u.get("text") || "";
  const index = (name, raw, fallback) => {
    if (raw === null || raw === "") return fallback;
    if (/^\d+$/.test(raw) && Number.isSafeInteger(+raw)) return +raw;
    urlNotes.push(`${name}=${raw} is not a ${name} index: showing ${name} ${fallback}`);
    return fallback;
  };
  state.layer = index("layer", u.get("layer"), 0);
  const h = u.get("head");
  state.head = h === null || h === "mean" ? "mean" : index("head", h, "mean");
  // add_bos: "1" / "0" in the URL override the model's convention (null = the model's:
  // BOS first for GPT-2-family models, as every endpoint does; resolved once /v1/model answers)
  const bos = u.get("add_bos");
  state.addBos = bos === "1" ? true : bos === "0" ? false : null;
  state.view = ["norm", "rollout"].includes(u.get("view")) ? u.get("view") : "weight";
}

function writeUrl() {
  const u = new URLSearchParams();
  if (state.text) u.set("text", state.text);
  u.set("layer", String(state.layer));
  u.set("head", String(state.head));
  const bosDefault = !!(model && model.add_bos_default);
  if (state.addBos !== null && state.addBos !== bosDefault) u.set("add_bos", state.addBos ? "1" : "0");
  if (state.view !== "weight") u.set("view", state.view);
  history.replaceState(null, "", `${location.pathname}?${u}`);
}

function ready(id, on = true) {
  const s = $(`#panel-${id}`);
  if (s) s.dataset.ready = on ? "1" : "0";
}

const nTokens = (n) => `${n} token${n === 1 ? "" : "s"}`;

function shortText(t, n = 60) {
  return t.length > n ? `${t.slice(0, n - 1)}\u2026` : t;
}

// ---- model card ---------------------------------------------------------------------------

// grouped-query attention: query head h reads key/value head kv[h] (GET /v1/model's
// attention.kv_head_of_query_head); null without GQA (then heads are named as before)
function kvMap() {
  const kv = model && model.attention && model.attention.kv_head_of_query_head;
  return kv && new Set(kv).size < kv.length ? kv : null;
}

// "head 3" or, on a GQA model, "head 3 \u00b7 kv 1"
function headName(h) {
  const kv = kvMap();
  return kv && kv[h] !== undefined ? `head ${h} \u00b7 kv ${kv[h]}` : `head ${h}`;
}

// "; key/value groups: kv 0 = heads 0, 1; kv 1 = heads 2, 3" (GQA models; "" otherwise)
function kvGroupsNote() {
  const kv = kvMap();
  if (!kv) return "";
  const groups = [];
  for (let j = 0; j < model.attention.n_kv_heads; j++) {
    groups.push(`kv ${j} = heads ${kv.map((x, h) => (x === j ? h : -1)).filter((h) => h >= 0).join(", ")}`);
  }
  return `; key/value groups (every layer): ${groups.join("; ")}`;
}

// the family's attention facts for the model card (rotary, GQA, window, soft-caps, norm)
function attentionRows(m) {
  const a = m.attention;
  if (!a) return [];
  const rows = [];
  if (a.positions === "rotary") {
    const frac = a.rotary_fraction === 1 ? "all" : `${a.rotary_dim} of ${m.d_head}`;
    let rope = `RoPE on ${frac} dims, theta ${a.rope_theta}`;
    if (a.rope_scaling) rope += `, scaling ${a.rope_scaling.rope_type || JSON.stringify(a.rope_scaling)}`;
    rows.push(["positions", rope]);
  } else if (a.positions) {
    rows.push(["positions", a.positions.replace(/_/g, " ")]);
  }
  const kv = kvMap();
  if (kv) {
    const g = m.n_heads / a.n_kv_heads, groups = [];
    for (let j = 0; j < a.n_kv_heads; j++) {
      const hs = kv.map((x, h) => (x === j ? h : -1)).filter((h) => h >= 0);
      groups.push(`kv ${j}: heads ${hs.join(", ")}`);
    }
    rows.push(["key/value heads", `${a.n_kv_heads} (grouped-query, ${g} query heads each; ${groups.join("; ")})`]);
  }
  const wins = a.sliding_window_layers;
  if (wins) {
    const same = wins.every((w) => w === wins[0]);
    rows.push(["sliding window", same ? `${wins[0]} keys, every layer`
      : wins.map((w, l) => `L${l} ${w === null ? "full" : w}`).join(", ")]);
  } else if (m.causal) {
    rows.push(["sliding window", "none (full causal)"]);
  }
  const caps = [];
  if (a.attn_logit_softcap !== null && a.attn_logit_softcap !== undefined) caps.push(`attention ${a.attn_logit_softcap}`);
  if (a.final_logit_softcap !== null && a.final_logit_softcap !== undefined) caps.push(`final logits ${a.final_logit_softcap}`);
  rows.push(["soft-cap", caps.length ? `${caps.join(", ")} (c\u00b7tanh(x / c))` : "none"]);
  if (a.norm) {
    const norm = { layernorm: "LayerNorm", rmsnorm: "RMSNorm", rmsnorm_1p: "RMSNorm (1 + weight)" }[a.norm] || a.norm;
    rows.push(["norm", norm + (a.parallel_residual ? ", parallel attention + MLP" : "")]);
  }
  return rows;
}

function renderModel() {
  const m = model;
  const rows = [
    ["model", m.id], ["revision", m.revision], ["architecture", m.architecture],
    ["family", `${m.family} (${m.causal ? "causal" : "encoder"})`],
    ["layers x heads", `${m.n_layers} x ${m.n_heads}`], ["d_model / d_head", `${m.d_model} / ${m.d_head}`],
    ["context", `${m.n_ctx} tokens`], ["vocabulary", String(m.vocab_size)], ["device / dtype", `${m.device} / ${m.dtype}`],
    ...attentionRows(m),
  ];
  if (m.fallback) rows.push(["fallback", `requested ${m.requested}: ${m.fallback_reason || ""}`]);
  const dl = document.createElement("dl");
  for (const [k, v] of rows) {
    const dt = document.createElement("dt"); dt.textContent = k; dt.dataset.fact = k;
    const dd = document.createElement("dd"); dd.textContent = v;
    dl.append(dt, dd);
  }
  $("#model-card").replaceChildren(dl);
  $("#add-bos-row").hidden = !m.causal;
  const lsel = $("#layer");
  lsel.replaceChildren(...Array.from({ length: m.n_layers }, (_, l) => new Option(`layer ${l}`, String(l))));
  const hsel = $("#head");
  hsel.replaceChildren(new Option("head mean", "mean"),
    ...Array.from({ length: m.n_heads }, (_, h) => new Option(headName(h), String(h))));
  buildPathPickers();
  ready("model");
}

// ---- tokens ------------------------------------------------------------------------------

function renderTokens() {
  const box = $("#tokens");
  box.replaceChildren(...tokens.map((t) => {
    const s = document.createElement("span");
    s.className = "token" + (t.special ? " special" : "");
    s.textContent = showLabel(t.label);
    s.title = `position ${t.position}, id ${t.id}` + (t.start === null ? ", inserted" : `, characters ${t.start}..${t.end}`) +
      (t.special ? ", special" : "");
    s.dataset.pos = t.position;
    const i = document.createElement("sub");
    i.textContent = t.position;
    s.append(i);
    return s;
  }));
  $("#token-count").textContent = nTokens(tokens.length);
  ready("tokens");
}

// ---- attention: heat map and line view ------------------------------------------------------

async function layerPattern(layer, mean) {
  const key = `${layer}|${mean}`;
  if (!cache.has(key)) {
    const body = { text: state.text, add_bos: state.addBos, layers: [layer], encoding: "base64", dtype: "float16" };
    if (model.causal) body.layout = "tril";
    if (mean) body.head_mean = true;
    const my = runId;
    cache.set(key, client.attention(body).then((r) => {
      if (my === runId) tokens = r.attention.tokens;  // (a reply for an earlier text: not ours)
      return decodeTensor(r.attention.pattern);
    }));
  }
  return cache.get(key);
}

const maskedFn = () => (model.causal ? (q, k) => k > q : () => false);

// the heat map's view switch: contribution norms (Kobayashi et al. 2020: /v1/attention-norms,
// ||sum_h alpha f(x)|| for the head mean, ||alpha f(x)|| for one head) or the rollout R_l
// (Abnar & Zuidema 2020: /v1/rollout, heads fused by their mean), float32, cached like patterns
async function viewMatrix(view, layer, head) {
  const key = `${view}|${layer}|${head}`;
  if (!cache.has(key)) {
    const base = { text: state.text, add_bos: state.addBos, layers: [layer], encoding: "base64", dtype: "float32" };
    const req = view === "rollout"
      ? client.post("/v1/rollout", base).then((r) => decodeTensor(r.rollout.rollout).at(0))
      : client.post("/v1/attention-norms", head === "mean"
        ? { ...base, per_head: false, value_norms: false }
        : { ...base, heads: [head], summed: false, value_norms: false })
        .then((r) => (head === "mean" ? decodeTensor(r.norms.summed).at(0) : decodeTensor(r.norms.norms).at(0).at(0)));
    cache.set(key, req);
  }
  return cache.get(key);
}

async function renderAttention() {
  const my = runId, call = callTicket("attention");
  ready("attention", false);
  const mean = state.head === "mean";
  const labels = tokens.map((x) => x.label);
  const n = labels.length;
  let m, vmax = 1, what = "attention weight (post-softmax)", where;
  if (state.view === "weight") {
    const t = await layerPattern(state.layer, mean);
    if (my !== runId || call !== latestCall.attention) return;
    m = mean ? t.at(0) : t.at(0).at(state.head);
    where = `layer ${state.layer}, ${mean ? "head mean" : headName(state.head)}`;
  } else {
    m = await viewMatrix(state.view, state.layer, state.head);
    if (my !== runId || call !== latestCall.attention) return;
    if (state.view === "norm") {
      vmax = 0;
      for (let q = 0; q < n; q++) for (let k = 0; k < n; k++) vmax = Math.max(vmax, m.get(q, k));
      vmax = vmax || 1;
      what = mean ? "contribution norm \u2016\u03a3\u2095 \u03b1 f(x)\u2016 (0 .. max)" : "contribution norm \u2016\u03b1 f(x)\u2016 (0 .. max)";
      where = `layer ${state.layer}, ${mean ? "all heads, norm of the sum" : headName(state.head)}, norms`;
    } else {
      what = "rollout R (share of the input token; rows sum to 1)";
      where = `rollout to layer ${state.layer} (heads fused by their mean)`;
    }
  }
  const valueName = { weight: "weight", norm: "norm", rollout: "rollout share" }[state.view];
  $("#attn-hint").textContent = `hover a cell (or focus the map and use the arrow keys) for its ${valueName}`;
  heatmap($("#heatmap"), m, {
    labels, n, masked: maskedFn(), vmax, valueName,
    title: `${model.id} \u00b7 ${where} \u00b7 \u201c${shortText(state.text)}\u201d`,
  });
  colourBar($("#cbar"), { masked: model.causal, title: what, vmax });
  $("#layer").value = String(state.layer);
  $("#head").value = String(state.head);
  $("#view").value = state.view;
  // rollout fuses every head (their mean): the head picker does not apply to it
  $("#head").disabled = state.view === "rollout";
  $("#head").title = state.view === "rollout" ? "rollout fuses all heads (their mean)" : "";
  ready("attention");
}

async function renderLines() {
  const my = runId, call = callTicket("lines");
  ready("lines", false);
  const t = await layerPattern(state.layer, false);
  if (my !== runId || call !== latestCall.lines) return;
  const labels = tokens.map((x) => x.label);
  const nH = t.shape[1];
  const box = $("#line-heads");
  const key = `${state.text}|${state.layer}|${state.head}|${nH}`;
  if (box.dataset.key !== key) {
    box.replaceChildren(...Array.from({ length: nH }, (_, h) => {
      const lab = document.createElement("label");
      lab.className = "chk";
      const c = document.createElement("input");
      c.type = "checkbox"; c.value = String(h);
      c.checked = state.head === "mean" ? true : h === state.head;
      c.addEventListener("change", () => renderLines().catch(fail));
      const sw = document.createElement("span");
      sw.className = "swatch"; sw.style.background = headColour(h);
      lab.append(c, sw, headName(h));
      return lab;
    }));
    box.dataset.key = key;
  }
  const chosen = [...box.querySelectorAll("input:checked")].map((c) => +c.value);
  const views = chosen.map((h) => {
    const m = t.at(0).at(h);
    return { head: h, colour: headColour(h), get: (q, k) => m.get(q, k) };
  });
  lineView($("#lineview"), views, { labels, legend: false });
  ready("lines");
}

// ---- heads, links, trajectories, verification -------------------------------------------------

async function renderHeads() {
  ready("heads", false);
  const my = runId;
  const r = heads || await client.heads({ text: state.text, add_bos: state.addBos });
  if (my !== runId) return;  // a reply for an earlier text
  heads = r;
  drawHeadGrid();
  $("#heads-note").textContent = `scores averaged over ${heads.n_texts} text; induction from the probe ` +
    (heads.probe ? `(${heads.probe.segment_length} tokens x ${heads.probe.repeats})` : "(off)") + "; hover a cell for every score, click to open its pattern" +
    kvGroupsNote();
  ready("heads");
}

function pickHead(l, h) {
  state.layer = l; state.head = h;
  writeUrl();
  refreshLayerViews().then(() => $("#panel-attention").scrollIntoView({ block: "start" })).catch(fail);
}

function drawHeadGrid() {
  headGrid($("#headgrid"), heads, pickHead, state.head === "mean" ? null : [state.layer, state.head], { kv: kvMap() });
}

async function renderLinks() {
  ready("links", false);
  const body = { text: state.text, add_bos: state.addBos, layer: state.layer, top_k: 3 };
  if (state.head !== "mean") body.head = state.head;
  const my = runId, call = callTicket("links");
  const r = await client.links(body);
  if (my !== runId || call !== latestCall.links) return;
  const tb = document.createElement("table");
  tb.className = "links";
  tb.innerHTML = "<tr><th>query</th><th>strongest earlier keys (weight)</th></tr>";
  for (const q of r.links.links) {
    const tr = document.createElement("tr");
    const a = document.createElement("td");
    a.textContent = `${q.query_pos} ${showLabel(q.query)}`;
    const b = document.createElement("td");
    b.textContent = q.links.map((l) => `${l.key_pos} ${showLabel(l.key)} (${fmt(l.weight)})`).join(",  ");
    tr.append(a, b);
    tb.append(tr);
  }
  $("#links").replaceChildren(tb);
  $("#links-note").textContent = `layer ${r.layer}, ${r.head === null ? "head mean" : headName(r.head)}; ` +
    `self excluded; skipped positions: ${r.links.skipped.join(", ") || "none"}`;
  ready("links");
}

async function renderTrajectories() {
  ready("trajectories", false);
  const my = runId;
  const r = await client.trajectories({ text: state.text, add_bos: state.addBos, encoding: "base64", dtype: "float32" });
  if (my !== runId) return;
  const t = r.trajectories;
  if (t.n_components < 2 || t.tokens.length < 2) {
    $("#trajectories").textContent = "too few tokens for a 2-component PCA";
  } else {
    trajectoryPlot($("#trajectories"), {
      paths: decodeTensor(t.paths), positions: t.positions, states: t.states,
      labels: t.tokens.map((x) => x.label), evr: t.explained_variance_ratio,
    });
  }
  $("#traj-note").textContent = `states ${t.states[0]}..${t.states[t.states.length - 1]} (${t.state_names ? `${t.state_names[0]} .. ${t.state_names[t.state_names.length - 1]}` : "0 = embedding output"}), ` +
    `PCA fitted on all states x tokens; explained variance ${t.explained_variance_ratio.map((v) => (100 * v).toFixed(1) + " %").join(", ")}`;
  ready("trajectories");
}

async function renderVerify() {
  ready("verify", false);
  const my = runId;
  const r = await client.verify({ text: state.text, add_bos: state.addBos });
  if (my !== runId) return;
  const v = r.verification;
  const box = $("#verify");
  const head = document.createElement("p");
  head.className = v.passed ? "pass" : "fail";
  // the message's own leading verdict word dropped, as the CLI does (no "PASSED: passed")
  const msg = (v.message || "").trim().replace(/^(passed|failed|pass|fail|ok)\b[.:;,]?\s*/i, "");
  head.textContent = msg ? `${v.passed ? "PASSED" : "FAILED"}: ${msg}` : (v.passed ? "PASSED" : "FAILED");
  const tb = document.createElement("table");
  tb.innerHTML = "<tr><th>layer</th><th>max |\u0394 pattern|</th><th>max |\u0394 output|</th><th>passed</th></tr>";
  for (const l of v.layers) {
    const tr = document.createElement("tr");
    for (const x of [l.layer, l.pattern_max_abs_diff === null ? "NaN" : l.pattern_max_abs_diff.toExponential(2),
      l.output_max_abs_diff === null ? "NaN" : l.output_max_abs_diff.toExponential(2), l.passed ? "yes" : "NO"]) {
      const td = document.createElement("td"); td.textContent = String(x); td.className = "num"; tr.append(td);
    }
    tb.append(tr);
  }
  const note = document.createElement("p");
  note.className = "note";
  note.textContent = v.mode === "from_scratch"
    ? `the whole forward recomputed from scratch in ${v.compute_dtype} from the weights and config ` +
      `(${v.mask} mask, scale per layer ${v.layers.map((l) => l.scale.toPrecision(4)).join(", ")}), ` +
      `compared with the ${v.dtype} forward served; tolerance ${v.tolerance} (pattern), ${v.state_tolerance} (states, relative)`
    : `attention step re-run from the recorded q/k/v in ${v.dtype}; tolerance ${v.tolerance}`;
  box.replaceChildren(head, tb, note);
  ready("verify");
}

// ---- logit lens, direct logit attribution, interventions, composition (causal LMs) ----------

let lens = null;       // this text's /v1/logit-lens promise (per options)
let circuits = null;   // the model's /v1/circuits (weights only: once per page)
const causalOnly = (box) => { $(box).replaceChildren(Object.assign(document.createElement("p"), { className: "note", textContent: "causal language models only" })); };

function lensResult() {
  const ln = $("#lens-ln").value, mid = $("#lens-mid").checked;
  const key = `${runId}|${ln}|${mid}`;
  if (!lens || lens.key !== key) {
    lens = { key, p: client.logit_lens({ text: state.text, add_bos: state.addBos, top_k: 5, ln, incl_mid: mid }) };
  }
  return lens.p;
}

async function renderLens() {
  ready("lens", false);
  if (!model.causal) { causalOnly("#lens"); ready("lens"); return; }
  const my = runId;
  const r = await lensResult();
  if (my !== runId) return;
  const p = r.prompts[0];
  lensGrid($("#lens"), p, { title: `${model.id} \u00b7 logit lens (ln ${r.ln}) \u00b7 \u201c${shortText(state.text)}\u201d` });
  $("#lens-note").textContent = `${p.states.length} residual states x ${p.n_tokens} positions; colour = probability of the ` +
    `state's top token (0..1); hover a cell for the top 5 and the actual next token's rank (0 = top). ${r.ln_description}`;
  ready("lens");
}

async function renderDla() {
  ready("dla", false);
  $("#dla-note").textContent = "";  // a failed request leaves no note of the last one
  if (!model.causal) { causalOnly("#dla"); ready("dla"); return; }
  const my = runId;
  let target = $("#dla-target").value, distractor = $("#dla-distractor").value;
  let named = "", tLabel = target, dLabel = distractor;
  if (!target) {  // the model's own top two at the last position (the lens's final state)
    const r = await lensResult();
    if (my !== runId) return;
    const st = r.prompts[0].states[r.prompts[0].states.length - 1];
    const top = st.positions[st.positions.length - 1].top;
    target = top[0].id; tLabel = top[0].label;
    if (!distractor && top.length > 1) { distractor = top[1].id; dLabel = top[1].label; }
    named = `target = the top prediction \u201c${top[0].label}\u201d` +
      (top.length > 1 && !$("#dla-distractor").value ? `, distractor = the second \u201c${top[1].label}\u201d` : "");
  }
  const body = { text: state.text, add_bos: state.addBos, target };
  if (distractor !== "" && distractor !== undefined) body.distractor = distractor;
  const r = await client.logit_attribution(body);
  if (my !== runId) return;
  const p = r.prompts[0], d = p.positions[0];
  const tl = tLabel, dl = d.distractor === null ? null : dLabel;
  const q = (label) => `\u201c${label}\u201d`;  // labels are already escaped (\n shown as \\n)
  const dir = dl === null ? `logit(${q(tl)})` : `logit(${q(tl)}) \u2212 logit(${q(dl)})`;
  attributionBars($("#dla"), d, { order: $("#dla-order").value, direction: dir,
    title: `${model.id} \u00b7 ${dir} at position ${d.position} \u00b7 \u201c${shortText(state.text)}\u201d` });
  $("#dla-note").textContent = (named ? `${named}; ` : "") + `${d.heads.length} layers x ${d.heads[0].length} heads ` +
    `(darker bars: heads; lighter: MLPs, output biases, embeddings); ${r.method}`;
  ready("dla");
}

function drawComposition() {
  const kind = $("#comp-kind").value;
  const kinds = kind === "qkv" ? ["q", "k", "v"] : [kind];
  let thr = parseFloat($("#comp-thr").value);
  if (!Number.isFinite(thr)) { thr = defaultThreshold(circuits.composition, kinds); $("#comp-thr").value = String(thr); }
  compositionGraph($("#composition"), circuits, { kinds, threshold: thr,
    title: `${model.id} \u00b7 composition scores \u2265 ${fmtNum(thr)} (weights only; the default threshold is the mean + 2 sd)` });
}

async function renderComposition() {
  ready("composition", false);
  if (!model.causal) { causalOnly("#composition"); ready("composition"); return; }
  const my = runId;
  if (!circuits) {
    const r = await client.circuits({ composition: true, top_k: 1 });
    if (my !== runId) return;
    circuits = r;
  }
  drawComposition();
  ready("composition");
}

async function runScan() {
  ready("interventions", false);
  const my = runId;
  const metric = $("#scan-metric").value, method = $("#scan-method").value;
  $("#scan").textContent = "scanning every head\u2026";
  const r = await client.ablate({ text: state.text, add_bos: state.addBos, scan: true, scan_metric: metric, method });
  if (my !== runId) return;
  const label = metric === "loss" ? "change of the mean loss (nats) with the head ablated" : "KL(clean \u2016 ablated), nats";
  divergingGrid($("#scan"), r.scan.effect, { rowTitle: "layer", colTitle: "head", label,
    title: `${model.id} \u00b7 ${method}-ablating each head alone \u00b7 \u201c${shortText(state.text)}\u201d` });
  ready("interventions");
}

async function runPatch() {
  ready("interventions", false);
  const my = runId;
  const corrupted = $("#patch-corrupted").value;
  if (!corrupted.trim()) { $("#patch").textContent = "type a corrupted text (the same number of tokens as the text)"; ready("interventions"); return; }
  const target = $("#patch-target").value, distractor = $("#patch-distractor").value;
  const body = { clean_text: state.text, corrupted_text: corrupted, add_bos: state.addBos,
    per_position: $("#patch-pos").checked, residual: $("#patch-resid").checked };
  if (target) { body.metric = "logit_diff"; body.logit_diff = { target, distractor }; } else body.metric = "loss";
  $("#patch").textContent = "patching\u2026";
  let r;
  try {
    r = await client.patch(body);
  } catch (e) {
    if (!(e instanceof ApiError) || e.status === 401) throw e;
    const p = document.createElement("p"); p.className = "fail panel-error"; p.textContent = describeError(e);
    $("#patch").replaceChildren(p); ready("interventions"); return;
  }
  if (my !== runId) return;
  drawPatch(r);
  ready("interventions");
}

// ---- path patching (/v1/path-patch) ---------------------------------------------------------

const ppBox = (kind, attrs, label) => {
  const lab = document.createElement("label");
  const c = document.createElement("input");
  c.type = "checkbox"; c.className = kind;
  for (const [k, v] of Object.entries(attrs)) c.dataset[k] = v;
  lab.append(c, ` ${label}`);
  return [lab, c];
};

/** The sender and receiver checkboxes of the path-patching panel, one row per layer; on a
 * grouped-query model the k/v receivers are key/value heads (hook_k_input / hook_v_input have
 * n_kv_heads heads: patching kv head g's input reaches every query head of its group). */
function buildPathPickers() {
  const m = model, kv = kvMap(), gqa = !!kv;
  const send = document.createElement("table"), recv = document.createElement("table");
  for (let l = 0; l < m.n_layers; l++) {
    const tr = document.createElement("tr");
    const th = document.createElement("th"); th.textContent = `layer ${l}`; tr.append(th);
    const td = document.createElement("td");
    for (let h = 0; h < m.n_heads; h++) td.append(ppBox("pp-send", { kind: "head", layer: l, head: h }, headName(h))[0], " ");
    td.append(ppBox("pp-send", { kind: "mlp", layer: l }, "MLP")[0]);
    tr.append(td); send.append(tr);
    const tr2 = document.createElement("tr");
    const th2 = document.createElement("th"); th2.textContent = `layer ${l}`; tr2.append(th2);
    const td2 = document.createElement("td");
    if (!gqa) {
      for (let h = 0; h < m.n_heads; h++) {
        const span = document.createElement("span"); span.className = "pp-recv-head";
        span.append(`${headName(h)}:`);
        for (const inp of ["q", "k", "v"]) span.append(" ", ppBox("pp-recv", { kind: "head", layer: l, head: h, input: inp, axis: "head" }, inp)[0]);
        td2.append(span);
      }
    } else {
      for (const inp of ["q", "k", "v"]) {
        const span = document.createElement("span"); span.className = "pp-recv-head";
        span.append(`${inp}:`);
        const n = inp === "q" ? m.n_heads : m.attention.n_kv_heads;
        for (let h = 0; h < n; h++) {
          const axis = inp === "q" ? "head" : "kv_head";
          const [lab] = ppBox("pp-recv", { kind: "head", layer: l, head: h, input: inp, axis }, inp === "q" ? headName(h) : `kv ${h}`);
          if (axis === "kv_head") lab.title = `key/value head ${h}: read by query heads ${kv.map((x, q) => (x === h ? q : -1)).filter((q) => q >= 0).join(", ")}`;
          span.append(" ", lab);
        }
        td2.append(span);
      }
    }
    td2.append(ppBox("pp-recv", { kind: "mlp", layer: l }, "MLP input")[0]);
    tr2.append(td2); recv.append(tr2);
  }
  const tr = document.createElement("tr");
  const th = document.createElement("th"); th.textContent = "final"; tr.append(th);
  const td = document.createElement("td"); td.append(ppBox("pp-recv", { kind: "logits" }, "logits")[0]);
  tr.append(td); recv.append(tr);
  $("#pp-senders").replaceChildren(send);
  $("#pp-receivers").replaceChildren(recv);
  for (const inp of ["k", "v"]) {
    $(`#pp-grid-${inp}`).parentElement.title = gqa ? `grouped-query attention: the grid's ${inp} columns are the ${m.attention.n_kv_heads} key/value heads` : "";
  }
}

/** The metric of the path-patching panel as /v1/run's metric (one term per position). */
function ppMetric() {
  const kind = $("#pp-metric").value;
  const target = $("#pp-target").value, distractor = $("#pp-distractor").value;
  const raw = $("#pp-positions").value.split(",").map((x) => x.trim()).filter(Boolean);
  if (!raw.length || raw.some((x) => !/^-?\d+$/.test(x))) throw new Error(`positions: '${$("#pp-positions").value}' is not a comma-separated list of integers`);
  const terms = raw.map((x) => {
    const position = +x;
    if (kind === "logit_diff") return { position, target, distractor };
    if (kind === "prob" || kind === "logprob") return { position, target };
    if (kind === "kl") return { prompt: 0, reference_prompt: 1, position };
    return { position };
  });
  if ((kind === "logit_diff" || kind === "prob" || kind === "logprob") && !target) throw new Error(`${kind}: type a target token`);
  if (kind === "logit_diff" && !distractor) throw new Error("logit_diff: type a distractor token");
  return { kind, terms };
}

// whether sender s's output reaches receiver r along the residual stream (the service's rule:
// a head feeds its own layer's MLP, except under GPT-NeoX's parallel residual)
const ppPrecedes = (s, r) => r.kind === "logits" ||
  (s.kind === "head" && r.kind === "mlp" && !(model.attention && model.attention.parallel_residual) ? r.layer >= s.layer : r.layer > s.layer);
// a receiver as the request takes it (head_axis is the page's label, echoed by the service)
const ppWire = (r) => { const { head_axis: _, ...x } = r; return x; };
const ppChecked = (cls) => [...document.querySelectorAll(`.${cls}:checked`)].map((c) => {
  const d = c.dataset;
  if (d.kind === "logits") return { kind: "logits" };
  if (d.kind === "mlp") return { kind: "mlp", layer: +d.layer };
  return cls === "pp-send" ? { kind: "head", layer: +d.layer, head: +d.head }
    : { kind: "head", layer: +d.layer, heads: [+d.head], input: d.input, head_axis: d.axis };
});
const PP_MAX_CELLS = 256;

async function runPathPatch() {
  ready("pathpatch", false);
  const my = runId, box = $("#pathpatch");
  // a message in the panel; `final` (not a progress line): the panel is done
  const say = (msg, cls = "note", final = true) => {
    const p = document.createElement("p"); p.className = cls; p.textContent = msg; box.replaceChildren(p);
    if (final) ready("pathpatch");
  };
  const corrupted = $("#pp-corrupted").value;
  if (!corrupted.trim()) { say("type a corrupted text (the same number of tokens as the text)"); return; }
  let metric;
  try { metric = ppMetric(); } catch (e) { say(e.message, "fail panel-error"); return; }
  const base = { pairs: [{ clean_text: state.text, corrupted_text: corrupted }], add_bos: state.addBos,
    direction: $("#pp-direction").value, metric };
  const mode = $("#pp-mode").value, opts = { model: model.id, kv: kvMap() };
  const senders = ppChecked("pp-send"), receivers = ppChecked("pp-recv");
  try {
    if (mode === "grid") {
      const inputs = ["q", "k", "v"].filter((x) => $(`#pp-grid-${x}`).checked);
      if (!inputs.length) { say("check at least one grid input (q, k or v)"); return; }
      say("path-patching every sender head \u2192 receiver input\u2026", "note", false);
      const r = await client.path_patch({ ...base, grid: true, grid_inputs: inputs });
      if (my !== runId) return;
      pathPatchView(box, r, opts);
    } else if (!senders.length || !receivers.length) {
      say("check at least one sender and one receiver under \u201csenders and receivers\u201d");
      $("#pp-pick").open = true;
      return;
    } else if (mode === "together") {
      // head receivers of one (layer, input) go as one receiver with their heads
      const merged = [];
      for (const r of receivers) {
        const same = r.kind === "head" && merged.find((x) => x.kind === "head" && x.layer === r.layer && x.input === r.input);
        if (same) same.heads.push(...r.heads); else merged.push(r.kind === "head" ? { ...r, heads: [...r.heads] } : r);
      }
      say("path-patching\u2026", "note", false);
      const r = await client.path_patch({ ...base, senders, receivers: merged.map(ppWire) });
      if (my !== runId) return;
      pathPatchView(box, r, opts);
    } else {
      const n = senders.length * receivers.length;
      if (n > PP_MAX_CELLS) { say(`${senders.length} senders x ${receivers.length} receivers = ${n} experiments; at most ${PP_MAX_CELLS} (or use the grid mode)`); return; }
      const cells = senders.map(() => receivers.map(() => null));
      const jobs = [];
      senders.forEach((s, i) => receivers.forEach((r, j) => { if (ppPrecedes(s, r)) jobs.push([i, j]); }));
      let done = 0;
      say(`path-patching ${jobs.length} sender \u2192 receiver experiments\u2026`, "note", false);
      const worker = async () => {
        while (jobs.length) {
          const [i, j] = jobs.shift();
          cells[i][j] = await client.path_patch({ ...base, senders: [senders[i]], receivers: [ppWire(receivers[j])] });
          if (my !== runId) return;
          done++;
        }
      };
      await Promise.all([worker(), worker(), worker(), worker()]);
      if (my !== runId) return;
      pathPatchCells(box, senders, receivers, cells, { ...opts,
        title: `${model.id} \u00b7 path patching: each sender alone \u2192 each receiver alone (${done} experiments)` });
    }
  } catch (e) {
    if (!(e instanceof ApiError) || e.status === 401) throw e;
    if (my !== runId) return;
    say(describeError(e), "fail panel-error");
    return;
  }
  ready("pathpatch");
}

function drawPatch(r) {
  patchView($("#patch"), r, { model: model.id });
}

/** Run one panel's render; on an API error write it into the panel (`box`) and resolve with
 * "panel: error" (other errors propagate). Resolves with null when it rendered. */
async function guarded(id, box, render) {
  const my = runId;
  try {
    await render();
    return null;
  } catch (e) {
    if (!(e instanceof ApiError) || e.status === 401) throw e;
    if (my !== runId) return null;
    const p = document.createElement("p");
    p.className = "fail panel-error";
    p.textContent = describeError(e);
    $(box).replaceChildren(p);
    return `${id}: ${describeError(e)}`;
  }
}

async function renderPanel(p) {
  const ctx = { client, model, text: state.text, addBos: state.addBos, layer: state.layer, head: state.head, tokens, setStatus };
  try {
    await p.render(ctx, p.body);
    ready(p.id);
  } catch (e) {
    p.body.textContent = describeError(e);
  }
}

function fail(e) {
  if (e instanceof ApiError && e.status === 401) $("#key-row").hidden = false;  // api_keys set
  setStatus(describeError(e), "error");
  document.body.dataset.state = "error";
}

async function refreshLayerViews() {
  await Promise.all([renderAttention(), renderLines(), renderLinks()]);
  if (heads) drawHeadGrid();
  for (const p of panels) if (p.layerAware) await renderPanel(p);
}

async function analyse() {
  const my = ++runId;
  document.body.dataset.state = "loading";
  setStatus("analysing\u2026");
  // the last text's results go: a panel this analysis cannot fill stays empty, never showing
  // another text's numbers under this text's URL
  clearResults();
  const clamped = urlNotes.splice(0);  // URL values not indices or past the model's, said
  if (state.layer > model.n_layers - 1) {
    clamped.push(`layer ${state.layer} is past the model's ${model.n_layers} layers: showing layer ${model.n_layers - 1}`);
    state.layer = model.n_layers - 1;
  }
  if (state.head !== "mean" && state.head > model.n_heads - 1) {
    clamped.push(`head ${state.head} is past its ${model.n_heads} heads: showing head ${model.n_heads - 1}`);
    state.head = model.n_heads - 1;
  }
  writeUrl();
  try {
    await layerPattern(state.layer, state.head === "mean");
    if (my !== runId) return;
    renderTokens();
    // a panel that fails shows its own error; the others stand (e.g. head scores need 2 tokens)
    const failed = (await Promise.all([
      guarded("attention", "#heatmap", renderAttention), guarded("lines", "#lineview", renderLines),
      guarded("heads", "#headgrid", renderHeads), guarded("links", "#links", renderLinks),
      guarded("trajectories", "#trajectories", renderTrajectories), guarded("verify", "#verify", renderVerify),
      guarded("lens", "#lens", renderLens), guarded("dla", "#dla", renderDla),
      guarded("composition", "#composition", renderComposition),
      ...panels.map(renderPanel)])).filter(Boolean);
    if (my !== runId) return;
    const notes = clamped.concat(failed);
    setStatus(`${nTokens(tokens.length)} analysed by ${model.id}` + (notes.length ? ` (${notes.join("; ")})` : ""),
      failed.length ? "error" : "info");
    document.body.dataset.state = "ready";
  } catch (e) {
    if (my === runId) fail(e);
  }
}

/** Empty every result panel and forget the last text's patterns and head scores. */
function clearResults() {
  tokens = [];
  cache = new Map();
  heads = null;
  lens = null;
  for (const id of ["tokens", "heatmap", "cbar", "line-heads", "lineview", "headgrid", "links", "trajectories", "verify",
    "lens", "dla", "scan", "patch", "pathpatch", "composition"]) {
    const box = $(`#${id}`);
    box.replaceChildren();
    delete box.dataset.key;
  }
  for (const id of ["token-count", "heads-note", "links-note", "traj-note", "lens-note", "dla-note"]) $(`#${id}`).textContent = "";
  for (const p of panels) p.body.replaceChildren();
  for (const s of document.querySelectorAll("section.panel[data-ready]")) {
    if (s.id !== "panel-model") s.dataset.ready = "0";
  }
}

/** /v1/model once (again after a key is typed); false (and the error said) when it fails. */
async function ensureModel() {
  if (model) return true;
  try {
    model = await client.model();
  } catch (e) {
    fail(e);
    return false;
  }
  renderModel();
  $("#key-row").hidden = true;
  if (state.addBos === null) state.addBos = !!model.add_bos_default;
  $("#add-bos").checked = state.addBos;
  $("#view").value = state.view;
  return true;
}

async function main() {
  readUrl();
  // the form works before the model answers: with api_keys set, /v1/model is a 401 until a
  // key is typed, and typing it then pressing Analyse must keep the text and the URL
  $("#text").value = state.text;
  // with the service's api_keys set: a key typed once, kept for this tab only
  client.apiKey = sessionStorage.getItem("attnscope-api-key");
  const takeKey = () => {
    const k = $("#api-key").value.trim();
    sessionStorage.setItem("attnscope-api-key", k);
    client.apiKey = k || null;
  };
  $("#api-key").addEventListener("change", takeKey);
  $("#api-key").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter") { ev.preventDefault(); takeKey(); $("#form").requestSubmit(); }
  });
  $("#form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    state.text = $("#text").value;
    if (model) state.addBos = $("#add-bos").checked;
    if (!state.text.trim()) { setStatus("type a text first", "error"); writeUrl(); return; }
    writeUrl();
    if (!await ensureModel()) return;
    analyse();
  });
  $("#text").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) { ev.preventDefault(); $("#form").requestSubmit(); }
  });
  const onPick = () => {
    state.layer = +$("#layer").value;
    state.head = $("#head").value === "mean" ? "mean" : +$("#head").value;
    writeUrl();
    if (tokens.length) refreshLayerViews().catch(fail);
  };
  $("#view").value = state.view;
  $("#view").addEventListener("change", () => {
    state.view = $("#view").value;
    writeUrl();
    if (tokens.length) renderAttention().catch(fail);
  });
  const rerun = (id, box, fn) => () => { if (tokens.length) guarded(id, box, fn).catch(fail); };
  $("#lens-ln").addEventListener("change", rerun("lens", "#lens", renderLens));
  $("#lens-mid").addEventListener("change", rerun("lens", "#lens", renderLens));
  $("#dla-run").addEventListener("click", rerun("dla", "#dla", renderDla));
  $("#dla-order").addEventListener("change", rerun("dla", "#dla", renderDla));
  $("#scan-run").addEventListener("click", rerun("interventions", "#scan", runScan));
  $("#patch-run").addEventListener("click", rerun("interventions", "#patch", runPatch));
  $("#pp-run").addEventListener("click", rerun("pathpatch", "#pathpatch", runPathPatch));
  $("#comp-kind").addEventListener("change", () => { $("#comp-thr").value = ""; if (circuits) drawComposition(); });
  $("#comp-thr").addEventListener("change", () => { if (circuits) drawComposition(); });
  $("#layer").addEventListener("change", onPick);
  $("#head").addEventListener("change", onPick);
  if (!await ensureModel()) return;
  if (state.text.trim()) analyse();
  else { setStatus("type or paste a text and press Analyse (Ctrl+Enter)"); document.body.dataset.state = "idle"; }
}

main();
