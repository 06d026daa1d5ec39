// attnscope.js — call the attnscope API and decode every tensor form it sends into typed arrays.
//
// An ES module with no dependencies, served by the service at /static/web/attnscope.js and
// importable by any front end:
//
//   import { Client, decodeTensor } from "http://127.0.0.1:8000/static/web/attnscope.js";
//   const c = new Client();                       // same origin; new Client(url, {apiKey})
//   const r = await c.attention({ text: "The cat sat.", layers: [0],
//                                 encoding: "base64", dtype: "float16", layout: "tril" });
//   const p = decodeTensor(r.attention.pattern); // Tensor {shape: [1, H, T, T], data: Float32Array}
//   p.get(0, 1, 3, 2);                            // layer 0, head 1, query_pos 3, key_pos 2
//
// Wire forms (README "Tensors on the wire"; the numpy twin is clients/python/attnscope/client/wire.py):
//   nested JSON lists            null = a masked score, decoded as -Infinity
//   {encoding: "base64", dtype, shape, data, layout, fill}
//                                little-endian float16/float32/int32/int64; layout "tril" packs
//                                the lower triangle of the last two axes row by row
//   {encoding: "tril", shape, data, fill}   JSON ragged rows (row q holds q + 1 values)
//   {encoding: "sparse", format: "flat"|"coo", shape, indices, values, row_mass, ...}
//   {encoding: "binary", name, ...}         a tensor of a safetensors response (decodeSafetensors)
//
// float16 becomes Float32Array (exact), float32 Float32Array, int32 Int32Array, int64
// Float64Array (exact below 2^53). Dense results are row-major (C order).

const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

/** A dense row-major tensor: `shape` (array of ints) and `data` (a typed array). */
export class Tensor {
  constructor(data, shape) {
    const n = shape.reduce((a, b) => a * b, 1);
    if (data.length !== n) {
      throw new Error(`tensor holds ${data.length} elements; shape [${shape}] needs ${n}`);
    }
    this.data = data;
    this.shape = shape.slice();
    this.strides = [];
    let s = 1;
    for (let i = shape.length - 1; i >= 0; i--) { this.strides[i] = s; s *= shape[i]; }
  }
  /** The element at the given indices (one per axis). */
  get(...idx) {
    let o = 0;
    for (let i = 0; i < idx.length; i++) {
      if (idx[i] < 0 || idx[i] >= this.shape[i]) {
        throw new RangeError(`index ${idx[i]} out of range for axis ${i} of size ${this.shape[i]}`);
      }
      o += idx[i] * this.strides[i];
    }
    return this.data[o];
  }
  /** A view (no copy) of the sub-tensor at index i of the first axis. */
  at(i) {
    const step = this.strides[0];
    return new Tensor(this.data.subarray(i * step, (i + 1) * step), this.shape.slice(1));
  }
  /** Nested plain arrays (for small tensors and tests). */
  toArray() {
    const rec = (off, d) => {
      if (d === this.shape.length) return this.data[off];
      const out = [];
      for (let i = 0; i < this.shape[d]; i++) out.push(rec(off + i * this.strides[d], d + 1));
      return out;
    };
    return rec(0, 0);
  }
}

// ---- base64 and float16 ------------------------------------------------------------------

/** Standard base64 -> Uint8Array. */
export function base64ToBytes(s) {
  if (typeof Uint8Array.fromBase64 === "function") return Uint8Array.fromBase64(s);
  const bin = atob(s);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

let F16 = null;  // 65536-entry table: float16 bit pattern -> float32 value (exact)
function f16Table() {
  if (F16) return F16;
  F16 = new Float32Array(65536);
  for (let h = 0; h < 65536; h++) {
    const sign = h & 0x8000 ? -1 : 1;
    const e = (h >> 10) & 0x1f;
    const m = h & 0x3ff;
    let v;
    if (e === 0) v = m * 2 ** -24;                         // subnormal (and zero)
    else if (e === 31) v = m ? NaN : Infinity;             // inf / NaN
    else v = (1 + m / 1024) * 2 ** (e - 15);
    F16[h] = sign * v;
  }
  return F16;
}

/** Uint16 float16 bit patterns -> Float32Array of the same values. */
export function float16ToFloat32(bits) {
  const t = f16Table();
  const out = new Float32Array(bits.length);
  for (let i = 0; i < bits.length; i++) out[i] = t[bits[i]];
  return out;
}

const SIZES = { float16: 2, float32: 4, int32: 4, int64: 8, F16: 2, F32: 4, I32: 4, I64: 8 };

/** Little-endian bytes of `dtype` -> a typed array of their values (copies as needed). */
export function fromBytes(bytes, dtype) {
  const size = SIZES[dtype];
  if (!size) throw new Error(`unknown tensor dtype ${JSON.stringify(dtype)}`);
  if (bytes.byteLength % size) {
    throw new Error(`${bytes.byteLength} bytes is not a whole number of ${dtype} elements`);
  }
  const n = bytes.byteLength / size;
  // an aligned copy (the typed-array views below need byteOffset % size == 0)
  const buf = bytes.byteOffset % 8 === 0 ? bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength)
    : bytes.slice().buffer;
  if (!LITTLE_ENDIAN) return fromBytesBE(new DataView(buf), n, dtype);
  switch (dtype) {
    case "float16": case "F16": return float16ToFloat32(new Uint16Array(buf));
    case "float32": case "F32": return new Float32Array(buf);
    case "int32": case "I32": return new Int32Array(buf);
    default: {  // int64 -> Float64Array (exact below 2^53)
      const b = new BigInt64Array(buf);
      const out = new Float64Array(n);
      for (let i = 0; i < n; i++) out[i] = Number(b[i]);
      return out;
    }
  }
}

function fromBytesBE(dv, n, dtype) {  // a big-endian host (rare): read element by element
  const k = dtype[0].toLowerCase() + String(SIZES[dtype] * 8);
  const out = k === "f16" || k === "f32" ? new Float32Array(n) : k === "i32" ? new Int32Array(n) : new Float64Array(n);
  const t = k === "f16" ? f16Table() : null;
  for (let i = 0; i < n; i++) {
    if (k === "f16") out[i] = t[dv.getUint16(2 * i, true)];
    else if (k === "f32") out[i] = dv.getFloat32(4 * i, true);
    else if (k === "i32") out[i] = dv.getInt32(4 * i, true);
    else out[i] = Number(dv.getBigInt64(8 * i, true));
  }
  return out;
}

// ---- layouts ------------------------------------------------------------------------------

/** Packed lower triangles (row by row, `prod(shape[:-2]) * T(T+1)/2` values) -> dense. */
export function unpackTril(packed, shape, fill = 0) {
  const T = shape[shape.length - 1];
  const lead = shape.slice(0, -2).reduce((a, b) => a * b, 1);
  const tri = (T * (T + 1)) / 2;
  if (packed.length !== lead * tri) {
    throw new Error(`tril tensor holds ${packed.length} elements; shape [${shape}] needs ${lead * tri}`);
  }
  const out = new packed.constructor(lead * T * T);
  if (fill !== 0) out.fill(fill);
  let src = 0;
  for (let b = 0; b < lead; b++) {
    const base = b * T * T;
    for (let q = 0; q < T; q++) {
      out.set(packed.subarray(src, src + q + 1), base + q * T);
      src += q + 1;
    }
  }
  return new Tensor(out, shape);
}

function fillOf(value, fill) {
  if (fill !== undefined && fill !== null) return fill;
  return value && value.fill === "-inf" ? -Infinity : 0;
}

function flattenJSON(x) {  // nested lists -> {data: Float32Array, shape}; null -> -Infinity
  const shape = [];
  for (let y = x; Array.isArray(y); y = y[0]) shape.push(y.length);
  const n = shape.reduce((a, b) => a * b, 1);
  const out = new Float32Array(n);
  let i = 0;
  const walk = (y, d) => {
    if (d === shape.length) { out[i++] = y === null ? -Infinity : y; return; }
    if (!Array.isArray(y) || y.length !== shape[d]) throw new Error("ragged nested lists: not a tensor");
    for (const z of y) walk(z, d + 1);
  };
  walk(x, 0);
  return new Tensor(out, shape);
}

/**
 * One wire tensor -> a dense Tensor of its logical shape.
 * @param value  nested lists or one of the dict forms above
 * @param opts   {arrays}: the named arrays of a safetensors response (for "binary" refs);
 *               {fill}: value of entries not sent (default: the tensor's `fill`, 0 for sparse)
 */
export function decodeTensor(value, opts = {}) {
  if (Array.isArray(value) || typeof value === "number") return flattenJSON(value);
  if (!value || typeof value !== "object") throw new Error("not a tensor");
  const shape = (value.shape || []).map(Number);
  switch (value.encoding) {
    case "base64": {
      const a = fromBytes(base64ToBytes(value.data), value.dtype);
      return logical(a, value, opts.fill);
    }
    case "binary": {
      const a = opts.arrays && opts.arrays[value.name];
      if (!a) throw new Error(`binary tensor ${value.name}: pass the arrays of the safetensors response`);
      return logical(a.data, value, opts.fill);
    }
    case "tril": {
      const T = shape[shape.length - 1];
      const lead = shape.slice(0, -2).reduce((a, b) => a * b, 1);
      const packed = new Float32Array((lead * T * (T + 1)) / 2);
      let i = 0;
      const walk = (y, d) => {
        if (d === shape.length - 2) {
          for (let q = 0; q < T; q++) {
            if (y[q].length !== q + 1) throw new Error(`tril row ${q} holds ${y[q].length} values, not ${q + 1}`);
            for (const v of y[q]) packed[i++] = v === null ? -Infinity : v;
          }
          return;
        }
        for (const z of y) walk(z, d + 1);
      };
      walk(value.data, 0);
      return unpackTril(packed, shape, fillOf(value, opts.fill));
    }
    case "sparse":
      return sparseToDense(value, opts.arrays, opts.fill ?? 0);
    default:
      throw new Error(`unknown tensor encoding ${JSON.stringify(value.encoding)}`);
  }
}

function logical(a, value, fill) {
  const shape = value.shape.map(Number);
  if ((value.layout || "full") === "tril") return unpackTril(a, shape, fillOf(value, fill));
  return new Tensor(a, shape);
}

function part(v, arrays) {  // a sparse part: JSON list, base64 tensor or binary ref -> typed array
  if (Array.isArray(v)) return flattenJSON(v).data;
  return decodeTensor(v, { arrays }).data;
}

/** The parts of a SparseTensor as typed arrays: {indices ([nnz] flat or [nnz*ndim] coo),
 *  values, row_mass, shape, format, nnz, min_row_mass}. */
export function sparseParts(value, arrays) {
  return {
    ...value,
    indices: Array.isArray(value.indices) ? Float64Array.from(value.indices.flat()) : part(value.indices, arrays),
    values: part(value.values, arrays),
    row_mass: part(value.row_mass, arrays),
  };
}

/** A SparseTensor -> dense Float32 Tensor (dropped entries = fill, default 0). */
export function sparseToDense(value, arrays, fill = 0) {
  const p = sparseParts(value, arrays);
  const shape = value.shape.map(Number);
  const n = shape.reduce((a, b) => a * b, 1);
  const out = new Float32Array(n);
  if (fill !== 0) out.fill(fill);
  const nnz = p.values.length;
  if (value.format === "coo") {
    const nd = shape.length;
    const strides = [];
    let s = 1;
    for (let i = nd - 1; i >= 0; i--) { strides[i] = s; s *= shape[i]; }
    for (let e = 0; e < nnz; e++) {
      let o = 0;
      for (let d = 0; d < nd; d++) o += p.indices[e * nd + d] * strides[d];
      out[o] = p.values[e];
    }
  } else {
    for (let e = 0; e < nnz; e++) out[p.indices[e]] = p.values[e];
  }
  return new Tensor(out, shape);
}

// ---- binary (safetensors) responses ------------------------------------------------------

/** A safetensors file (ArrayBuffer or Uint8Array) -> {body, arrays}: `body` is the JSON
 *  response from __metadata__.attnscope (tensors as {encoding: "binary", name} refs), `arrays`
 *  maps names to Tensors in their stored shape. */
export function decodeSafetensors(buffer) {
  const bytes = buffer instanceof Uint8Array ? buffer : new Uint8Array(buffer);
  if (bytes.length < 8) throw new Error("not a safetensors file: shorter than 8 bytes");
  const n = Number(new DataView(bytes.buffer, bytes.byteOffset, 8).getBigUint64(0, true));
  if (n > bytes.length - 8) throw new Error(`not a safetensors file: header length ${n}`);
  const header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + n)));
  const meta = header.__metadata__ || {};
  delete header.__metadata__;
  const base = 8 + n;
  const arrays = {};
  for (const [name, info] of Object.entries(header)) {
    const [b, e] = info.data_offsets;
    if (!(0 <= b && b <= e && e <= bytes.length - base)) throw new Error(`tensor ${name}: offsets outside the data`);
    arrays[name] = new Tensor(fromBytes(bytes.subarray(base + b, base + e), info.dtype), info.shape);
  }
  return { body: meta.attnscope ? JSON.parse(meta.attnscope) : {}, arrays };
}

/** A safetensors response -> its JSON body with every tensor (binary refs, and the parts of
 *  sparse tensors, which are decoded to dense) replaced by a dense Tensor. */
export function decodeBinaryResponse(buffer) {
  const { body, arrays } = decodeSafetensors(buffer);
  const walk = (x) => {
    if (Array.isArray(x)) return x.map(walk);
    if (x && typeof x === "object") {
      if (x.encoding === "binary" || x.encoding === "sparse") return decodeTensor(x, { arrays });
      return Object.fromEntries(Object.entries(x).map(([k, v]) => [k, walk(v)]));
    }
    return x;
  };
  return walk(body);
}

// ---- the API -----------------------------------------------------------------------------

/** An error response: `type`, `message`, `param` of the envelope, and the HTTP `status`. */
export class ApiError extends Error {
  constructor(status, type, message, param) {
    super(message);
    this.name = "ApiError";
    this.status = status; this.type = type; this.param = param;
  }
}

export const SAFETENSORS = "application/x-safetensors";

/** A small client: one method per endpoint (ENDPOINTS below), each resolving to the parsed
 *  JSON response (or, with `{binary: true}` where the endpoint offers it, the decoded
 *  safetensors body). */
export class Client {
  /** @param baseUrl "" = same origin; @param opts {apiKey} sent as Authorization: Bearer */
  constructor(baseUrl = "", opts = {}) {
    this.baseUrl = baseUrl.replace(/\/$/, "");
    this.apiKey = opts.apiKey || null;
  }
  headers(extra = {}) {
    const h = { "content-type": "application/json", ...extra };
    if (this.apiKey) h.authorization = `Bearer ${this.apiKey}`;
    return h;
  }
  async request(method, path, body, { binary = false, signal } = {}) {
    const r = await fetch(this.baseUrl + path, {
      method, signal,
      headers: this.headers(binary ? { accept: SAFETENSORS } : {}),
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (!r.ok) {
      let e = {};
      try { e = (await r.json()).error || {}; } catch (_) { /* not an envelope */ }
      throw new ApiError(r.status, e.type || "http_error", e.message || `HTTP ${r.status}`, e.param ?? null);
    }
    if (binary) return decodeBinaryResponse(await r.arrayBuffer());
    return r.json();
  }
  post(path, body, opts) { return this.request("POST", path, body, opts); }
}

// One method per endpoint of the service's endpoint table: `client.attention(body, {binary})`,
// `client.model()`; the server sends this module with its own table's list.
// ---- endpoints: generated from the endpoint table (scripts/gen-clients); do not edit
export const ENDPOINTS = [
  {"name": "model", "method": "GET", "path": "/v1/model", "binary": false},
  {"name": "tokenize", "method": "POST", "path": "/v1/tokenize", "binary": false},
  {"name": "attention", "method": "POST", "path": "/v1/attention", "binary": true},
  {"name": "heads", "method": "POST", "path": "/v1/heads", "binary": false},
  {"name": "links", "method": "POST", "path": "/v1/links", "binary": false},
  {"name": "trajectories", "method": "POST", "path": "/v1/trajectories", "binary": false},
  {"name": "verify", "method": "POST", "path": "/v1/verify", "binary": false},
  {"name": "scratch_attention", "method": "POST", "path": "/v1/scratch-attention", "binary": false},
  {"name": "predictions", "method": "POST", "path": "/v1/predictions", "binary": false},
  {"name": "ablate", "method": "POST", "path": "/v1/ablate", "binary": true},
  {"name": "patch", "method": "POST", "path": "/v1/patch", "binary": false},
  {"name": "path_patch", "method": "POST", "path": "/v1/path-patch", "binary": false},
  {"name": "attention_norms", "method": "POST", "path": "/v1/attention-norms", "binary": true},
  {"name": "rollout", "method": "POST", "path": "/v1/rollout", "binary": true},
  {"name": "hooks", "method": "GET", "path": "/v1/hooks", "binary": false},
  {"name": "run", "method": "POST", "path": "/v1/run", "binary": true},
  {"name": "logit_lens", "method": "POST", "path": "/v1/logit-lens", "binary": false},
  {"name": "logit_attribution", "method": "POST", "path": "/v1/logit-attribution", "binary": false},
  {"name": "circuits", "method": "POST", "path": "/v1/circuits", "binary": false},
];
// ---- end of the generated endpoints
for (const ep of ENDPOINTS) {
  Client.prototype[ep.name] = ep.method === "GET"
    ? function () { return this.request("GET", ep.path); }
    : function (body, opts = {}) {
      return this.request("POST", ep.path, body, { ...opts, binary: ep.binary && !!opts.binary });
    };
}
