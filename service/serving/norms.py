"""POST /v1/attention-norms: checks, memory estimate and the job (runs on the device thread).

Turns recorded forwards into the response body by calling service.analysis.norms layer by layer
with the adapter's output projection (``Runtime.adapter.attention_params``)."""

from __future__ import annotations

import torch

from attnscope.schemas import NormsRequest, NormsResponse
from ..analysis import norms as N
from ..analysis.verify_recorded import AttentionParams
from ..encoding import encode_tensor, estimate_encoded_bytes
from ..errors import InvalidRequest, NonFiniteValues
from .core.engine import Plan
from .core.table import Endpoint
from .core.checks import check_indices
from .common import text_or_results


def check(rt, req) -> None:
    """Token-independent checks (422, before tokenizing; the engine runs them once): layer/head
    indices in range and distinct, 'tril' on an encoder."""
    check_indices(req.layers, rt.adapter.n_layers, "layers", "layer")
    check_indices(req.heads, rt.adapter.n_heads, "heads", "head")
    if req.layout == "tril" and not rt.adapter.causal:
        raise InvalidRequest("layout 'tril' needs a causal model; this one is an encoder "
                             "(the norms are not triangular)", "layout")


def selection(rt, req) -> tuple[list[int], list[int]]:
    """The layers and heads analysed (the request's, else all); checked by :func:`check`."""
    layers = req.layers if req.layers is not None else list(range(rt.adapter.n_layers))
    heads = req.heads if req.heads is not None else list(range(rt.adapter.n_heads))
    return layers, heads


def estimate(rt, req, lengths: list[int], encoding: str) -> int:
    """Bytes the job allocates beyond the recorded forwards, for texts of ``lengths`` tokens:
    the results (float32 ``norms`` L*h*T^2, ``summed`` L*T^2, ``value_norms`` L*h*T), their
    encoded forms (:func:`estimate_encoded_bytes`), and one layer's work arrays at a time
    (float32/float64 copies of the pattern and coefficients ~20*H*T^2, f and its norms
    ~12*H*T*D, the Gram matrices and the query chunk of :func:`norms.summed_norms`)."""
    a = rt.adapter
    L = len(req.layers) if req.layers is not None else a.n_layers
    h = len(req.heads) if req.heads is not None else a.n_heads
    H, D = a.n_heads, a.d_model
    total = 0
    for T in lengths:
        n_head, n_sum, n_val = L * h * T * T, L * T * T, L * h * T
        if req.per_head:
            total += 4 * n_head + estimate_encoded_bytes(n_head, encoding, req.dtype, req.round,
                                                         req.layout, req.sparse, T)
        if req.summed:
            total += 4 * n_sum + estimate_encoded_bytes(n_sum, encoding, req.dtype, req.round,
                                                        req.layout, req.sparse, T)
        if req.value_norms:
            total += 4 * n_val + estimate_encoded_bytes(n_val, encoding, req.dtype, req.round,
                                                        "full", None, T)
        work = 20 * (H + 1) * T * T + 12 * H * T * D + 8 * T * (H + 1) ** 2 + 24 * T * T
        total += work + 3 * 8 * min(N.CHUNK_ELEMENTS, T * T * (H + 1))
    return total


def plan(rt, req, items, *, binary: bool = False) -> Plan:
    """The memory estimate of the new tensors (:func:`estimate`, counted with the forwards
    before any runs) and the job (:func:`build`), on the device thread."""
    encoding = "binary" if binary else req.encoding
    est = estimate(rt, req, [len(it) for it in items], encoding)
    return Plan(items, lambda forwards: build(rt, req, forwards, encoding), est)


def build(rt, req, forwards, encoding: str) -> dict:
    """The response body (tensors through encode_tensor)."""
    layers, heads = selection(rt, req)
    sel = None if req.heads is None else heads
    params = {lyr: AttentionParams.of(rt.adapter, lyr) for lyr in layers}
    out = []
    for i, fw in enumerate(forwards):
        pfx = "norms" if req.single else f"results.{i}"
        per_head, summed, value = [], [], []
        for lyr in layers:
            p = params[lyr]
            dev = fw.tensors.v.device  # recorded on the CPU; the weights on the model's device
            res = N.layer_norms(fw.pattern[lyr], fw.tensors.v[lyr], p.W_o.to(dev),
                                None if p.b_v is None else p.b_v.to(dev),
                                None if p.b_o is None else p.b_o.to(dev),
                                req.value_bias, req.output_bias, sel, req.per_head, req.summed)
            if not torch.isfinite(res.value).all():
                raise NonFiniteValues(f"layer {lyr}'s value vectors hold NaN/inf; refusing "
                                      "to send their norms")
            per_head.append(res.head)
            summed.append(res.summed)
            value.append(res.value)

        def enc(ts, name, layout, sparse):
            return encode_tensor(torch.stack(ts), encoding, req.dtype, req.round,
                                 f"{pfx}.{name}", layout=layout, sparse=sparse)

        out.append({
            "tokens": [t.as_dict() for t in fw.tokens.tokens],
            "layers": layers,
            "heads": heads,
            "norms": enc(per_head, "norms", req.layout, req.sparse) if req.per_head else None,
            "summed": enc(summed, "summed", req.layout, req.sparse) if req.summed else None,
            "value_norms": enc(value, "value_norms", "full", None) if req.value_norms else None,
        })
    a = rt.adapter
    body: dict = {"model": rt.model_ref(), "value_bias": req.value_bias,
                  "output_bias": req.output_bias,
                  "kv_head_of_query_head": ([a.kv_head(h) for h in range(a.n_heads)]
                                            if a.n_kv_heads != a.n_heads else None)}
    return text_or_results(req, body, "norms", out)


ENDPOINTS = [
    Endpoint(
        path='/v1/attention-norms', name='attention_norms',
        request=NormsRequest, response=NormsResponse,
        summary='Value-weighted contribution norms ||alpha f(x)|| per layer and head (Kobayashi et al. 2020)',
        description="""What each key position contributes to each query, beyond its attention weight
(Kobayashi et al. 2020, "Attention is Not Only a Weight"; S004): with ``f_h(x) = (x W_V^h
+ b_V^h) W_O^h`` and ``x`` the attention input (the LayerNorm output entering attention),

* ``norms``: ``||alpha^h_ij f_h(x_j)||`` float32 ``[layer, head, query_pos, key_pos]``;
* ``summed``: ``||sum_h alpha^h_ij f_h(x_j)||`` ``[layer, query_pos, key_pos]`` (over the
  selected heads);
* ``value_norms``: ``||f_h(x_j)||`` ``[layer, head, key_pos]``.

Norms are Euclidean, in the residual stream's units, >= 0. Biases: by default (the
paper's) b_V is inside f and the output projection's bias b_O is in no key's contribution
(the contributions sum to the attention output minus b_O); ``value_bias`` /
``output_bias`` change that. Every wire form of /v1/attention: json, base64, 'tril'
(causal), sparse, and ``Accept: application/x-safetensors``.

Errors: 422 blank text / too many tokens / layer or head out of range or repeated / empty
heads or layers / nothing asked for / 'tril' on an encoder / memory estimate over
``max_request_bytes``; 406 Accept; 413; 429; 503.""",
        plan=plan,
        check=check,
        binary=True,
        tags=('norms',), order=100,
    ),
]
