"""attnscope.js (the ES module of decoders) in headless Chromium against every wire form the
service produces, equal to the numpy decoders of clients/python/attnscope/client/wire.py on
the same responses: JSON lists (null = masked), rounded JSON, JSON tril, base64 float16/float32
full and tril, sparse flat/coo with JSON and base64 parts, binary (safetensors) responses."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from attnscope.client.wire import SAFETENSORS, decode_tensor, read_safetensors, sparse_parts
from conftest import SENTENCE
from web_browser import browser, page  # noqa: F401  (fixtures)

CASES = {
    "json": {"include_scores": True},
    "json_round": {"round": 3, "include_scores": True},
    "json_tril": {"layout": "tril", "include_scores": True},
    "b64_f32": {"encoding": "base64", "include_scores": True},
    "b64_f16": {"encoding": "base64", "dtype": "float16", "include_scores": True},
    "b64_f32_tril": {"encoding": "base64", "layout": "tril", "include_scores": True},
    "b64_f16_tril": {"encoding": "base64", "dtype": "float16", "layout": "tril",
                     "include_scores": True},
    "b64_f16_tril_mean": {"encoding": "base64", "dtype": "float16", "layout": "tril",
                          "head_mean": True, "layers": [1]},
    "sparse_flat_json": {"sparse": {"top_k": 3}},
    "sparse_coo_json": {"sparse": {"top_k": 3, "format": "coo"}, "include_scores": True},
    "sparse_flat_b64": {"sparse": {"threshold": 0.05}, "encoding": "base64", "dtype": "float16"},
    "sparse_coo_b64": {"sparse": {"top_k": 2, "threshold": 0.1, "format": "coo"},
                       "encoding": "base64"},
    "bin_f32": {"encoding": "base64", "include_scores": True, "_binary": True},
    "bin_f16_tril": {"encoding": "base64", "dtype": "float16", "layout": "tril",
                     "include_scores": True, "_binary": True},
    "bin_sparse_coo": {"sparse": {"top_k": 4, "format": "coo"}, "encoding": "base64",
                       "_binary": True},
    "bin_sparse_flat": {"sparse": {"top_k": 4}, "encoding": "base64", "_binary": True},
}

JS = """async ([cases, text]) => {
  const m = await import('/static/web/attnscope.js');
  const c = new m.Client('');
  const b64 = (t) => {
    const u = new Uint8Array(Float32Array.from(t.data).buffer);
    let s = ''; for (let i = 0; i < u.length; i += 32768) s += String.fromCharCode(...u.subarray(i, i + 32768));
    return {shape: t.shape, data: btoa(s)};
  };
  const out = {};
  for (const [name, opts] of Object.entries(cases)) {
    const {_binary, ...rest} = opts;
    const body = {text, ...rest};
    const r = await c.attention(body, {binary: !!_binary});
    const a = r.attention;
    const pat = _binary ? a.pattern : m.decodeTensor(a.pattern);
    const res = {pattern: b64(pat)};
    if (a.scores) res.scores = b64(_binary ? a.scores : m.decodeTensor(a.scores));
    if (!_binary && a.pattern.encoding === 'sparse') {
      const p = m.sparseParts(a.pattern);
      res.row_mass = b64({data: p.row_mass, shape: [p.row_mass.length]});
      res.indices = b64({data: p.indices, shape: [p.indices.length]});
    }
    out[name] = res;
  }
  return out;
}"""


def _arr(x):
    return np.frombuffer(base64.b64decode(x["data"]), "<f4").reshape(x["shape"])


@pytest.fixture(scope="module")
def decoded(live_server, browser):  # noqa: F811
    ctx = browser.new_context()
    p = ctx.new_page()
    errors = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    p.goto(live_server.url + "/healthz")
    out = p.evaluate(JS, [CASES, SENTENCE])
    ctx.close()
    assert not errors
    return out


def _numpy(url, opts):
    opts = dict(opts)
    binary = opts.pop("_binary", False)
    r = httpx.post(url + "/v1/attention", json={"text": SENTENCE, **opts},
                   headers={"accept": SAFETENSORS} if binary else {}, timeout=60)
    assert r.status_code == 200, r.text
    if binary:
        body, arrays = read_safetensors(r.content)
    else:
        body, arrays = r.json(), None
    return body["attention"], arrays


@pytest.mark.parametrize("name", list(CASES))
def test_js_decoders_equal_numpy_decoders(live_server, decoded, name):
    att, arrays = _numpy(live_server.url, CASES[name])
    js = decoded[name]
    want = decode_tensor(att["pattern"], arrays).astype(np.float32)
    got = _arr(js["pattern"])
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)  # bit for bit (float16 widened exactly)
    if "scores" in js:
        ws = decode_tensor(att["scores"], arrays).astype(np.float32)
        gs = _arr(js["scores"])
        np.testing.assert_array_equal(gs, ws)
        assert np.isneginf(gs).sum() > 0  # the masked future keys came through as -inf
    if "row_mass" in js:
        parts = sparse_parts(att["pattern"])
        np.testing.assert_array_equal(_arr(js["row_mass"]),
                                      parts["row_mass"].astype(np.float32).reshape(-1))
        np.testing.assert_array_equal(_arr(js["indices"]),
                                      parts["indices"].astype(np.float32).reshape(-1))
    # what the forms mean: a causal pattern with rows summing to 1 (dense forms)
    if not (isinstance(att["pattern"], dict) and att["pattern"].get("encoding") == "sparse"):
        tol = 2e-3 if CASES[name].get("dtype") == "float16" or "round" in CASES[name] else 1e-5
        np.testing.assert_allclose(got.sum(-1), 1.0, atol=tol * got.shape[-1])
        assert np.all(np.triu(got, 1) == 0)


def test_float16_table_is_exact_for_every_bit_pattern(live_server, page):  # noqa: F811
    page.goto(live_server.url + "/healthz")
    got = page.evaluate("""async () => {
      const m = await import('/static/web/attnscope.js');
      const bits = new Uint16Array(65536); for (let i = 0; i < 65536; i++) bits[i] = i;
      const f = m.float16ToFloat32(bits);
      const u = new Uint8Array(f.buffer); let s = '';
      for (let i = 0; i < u.length; i += 32768) s += String.fromCharCode(...u.subarray(i, i + 32768));
      return btoa(s);
    }""")
    got = np.frombuffer(base64.b64decode(got), "<f4")
    want = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got, want)  # NaNs at the same places too


def test_decoders_refuse_malformed_tensors_like_wire_py(live_server, page):  # noqa: F811
    page.goto(live_server.url + "/healthz")
    bad = [
        {"encoding": "base64", "dtype": "float32", "shape": [2, 2], "data": "AAAAAA=="},
        {"encoding": "base64", "dtype": "float32", "shape": [1, 3, 3], "layout": "tril",
         "data": base64.b64encode(np.zeros(5, "<f4").tobytes()).decode()},
        {"encoding": "base64", "dtype": "bfloat16", "shape": [1], "data": "AAA="},
        {"encoding": "zip", "shape": [1]},
    ]
    msgs = page.evaluate("""async (bad) => {
      const m = await import('/static/web/attnscope.js');
      return bad.map((b) => { try { m.decodeTensor(b); return null; } catch (e) { return e.message; } });
    }""", bad)
    for b, msg in zip(bad, msgs):
        assert msg, b
        with pytest.raises(ValueError):
            decode_tensor(b)
    assert "needs 4" in msgs[0] and "needs 6" in msgs[1] and "bfloat16" in msgs[2]
