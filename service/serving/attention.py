"""/v1/attention: patterns (and pre-softmax scores) per layer and head."""

from __future__ import annotations

from attnscope.schemas import AttentionRequest, AttentionResponse
from ..analysis.attention import select_heads
from ..encoding import encode_tensor, estimate_encoded_bytes
from ..errors import InvalidRequest
from .core.engine import Plan
from .core.table import Endpoint
from .core.checks import check_indices
from .common import text_or_results


def check(rt, req: AttentionRequest) -> None:
    """Token-independent checks: layers/heads in range and distinct, 'tril' only for causal
    models (422)."""
    check_indices(req.layers, rt.adapter.n_layers, "layers", "layer")
    check_indices(req.heads, rt.adapter.n_heads, "heads", "head")
    if req.layout == "tril" and not rt.adapter.causal:
        raise InvalidRequest("layout 'tril' needs a causal model; this one is an encoder "
                             "(attention is not triangular)", "layout")


def plan(rt, req: AttentionRequest, items, *, binary: bool = False) -> Plan:
    """The response estimate and the job: for each text ``pattern`` ``[layer, head,
    query_pos, key_pos]`` (head axis gone with ``head_mean``) and optionally ``scores``,
    encoded as the request asks (``binary``: safetensors placeholders)."""
    encoding = "binary" if binary else req.encoding
    layers = req.layers if req.layers is not None else list(range(rt.adapter.n_layers))
    heads = req.heads if req.heads is not None else list(range(rt.adapter.n_heads))
    per_matrix = len(layers) * (1 if req.head_mean else len(heads))
    est = 0
    for it in items:
        T = len(it)
        est += estimate_encoded_bytes(per_matrix * T * T, encoding, req.dtype, req.round,
                                      req.layout, req.sparse, T)
        if req.include_scores:  # q.k per layer, stacked, masked (+ head selection), encoded
            est += 4 * T * T * (2 * len(layers) * rt.adapter.n_heads + per_matrix)
            est += estimate_encoded_bytes(per_matrix * T * T, encoding, req.dtype, req.round,
                                          req.layout, None, T)

    def job(forwards) -> dict:
        out = []
        for i, fw in enumerate(forwards):
            pfx = "attention" if req.single else f"results.{i}"
            pattern = select_heads(fw.pattern, req.layers, req.heads, req.head_mean)
            res = {
                "tokens": [t.as_dict() for t in fw.tokens.tokens],
                "layers": layers,
                "heads": heads,
                "head_mean": req.head_mean,
                "pattern": encode_tensor(pattern, encoding, req.dtype, req.round,
                                         f"{pfx}.pattern", layout=req.layout, sparse=req.sparse),
                "scores": None,
            }
            if req.include_scores:
                scores = select_heads(fw.scores(layers), None, req.heads, req.head_mean)
                res["scores"] = encode_tensor(
                    scores, encoding, req.dtype, req.round, f"{pfx}.scores",
                    allow_neg_inf=True, layout=req.layout,
                )
            out.append(res)
        body: dict = {"model": rt.model_ref()}
        return text_or_results(req, body, "attention", out)

    return Plan(items, job, est, small_ops=True)


ENDPOINTS = [
    Endpoint(
        path='/v1/attention', name='attention',
        request=AttentionRequest, response=AttentionResponse,
        summary='Attention patterns (and optionally pre-softmax scores) per layer and head',
        description="""Attention of the resident model for ``text`` (response field ``attention``) or
``texts`` (response field ``results``, in order).

``pattern``: float32 post-softmax weights ``[layer, head, query_pos, key_pos]`` (or
``[layer, query_pos, key_pos]`` with ``head_mean``), equal to Hugging Face's
``output_attentions``. ``scores`` (``include_scores``): pre-softmax ``q.k * scaling``, masked
entries null/-inf. ``layout`` 'tril' sends the lower triangle (causal models);
``sparse`` the top-k / thresholded pattern with the kept mass per row. ``Accept:
application/x-safetensors`` returns the response as one safetensors file (tensors by name,
the JSON body in ``__metadata__["attnscope"]``). Source: Vaswani et al. 2017;
000_1c89b6c8c2a32040.txt.

Errors: 422 blank text / too many tokens / layer or head out of range / batch over
``max_batch`` / 'tril' on an encoder / memory estimate over ``max_request_bytes``; 406
Accept; 413 body too large; 429 overloaded; 503 not ready.""",
        plan=plan,
        check=check,
        binary=True,
        tags=('attention',), order=30,
    ),
]
