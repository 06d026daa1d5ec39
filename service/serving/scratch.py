"""/v1/scratch-attention: the textbook attention on given matrices or token embeddings."""

from __future__ import annotations

import torch

from attnscope.schemas.scratch import MAX_WEIGHTS
from attnscope.schemas import ScratchAttentionRequest, ScratchAttentionResponse
from ..analysis.scratch import as_matrix, embedding_qkv, scratch_attention
from ..encoding import encode_tensor
from .core.estimates import scratch_bytes
from ..errors import InvalidRequest
from .core.engine import Plan
from .core.inputs import tokenized
from .core.table import Endpoint


def check_wire_range(r: dict, dtype: str) -> None:
    """422 (param ``dtype``) when a finite float64 result would not fit the wire dtype (float32
    max ~3.4e38, float16 max 65504): the cast would send inf silently. Masked scores (-inf)
    are exempt."""
    limit = float(torch.finfo(getattr(torch, dtype)).max)
    for name in ("scores", "output", "weights"):
        t = r[name]
        finite = t[torch.isfinite(t)]
        if finite.numel() == 0:
            continue
        big = float(finite.abs().max())
        if big > limit:
            raise InvalidRequest(
                f"{name} holds a value of magnitude {big:.4g}, beyond {dtype}'s largest finite "
                f"number ({limit:.4g}): it would be sent as inf. Use dtype 'float32' (if it fits), "
                "encoding 'json' (full float64), or scale the inputs down", "dtype",
            )


def plan(rt, req: ScratchAttentionRequest, items) -> Plan:
    """The job (on the device thread): Q, K, V from the request's matrices (no model needed:
    ``rt`` may be None) or from ``text``'s static token embeddings, then
    :func:`~attnscope.service.analysis.scratch.scratch_attention`; the body with ``weights``,
    ``scores`` ``[head, query_pos, key_pos]`` and ``output`` ``[query_pos, d_v]``."""
    text_source = req.text is not None or req.tokens is not None
    if text_source and rt is None:
        from ..errors import NotReady

        raise NotReady("the model is not loaded yet; retry shortly (the matrices source needs no model)")

    def job(_forwards) -> dict:
        body: dict = {"model": None, "source": "embeddings" if text_source else "matrices",
                      "tokens": None, "query_tokens": None}
        if not text_source:
            q, k, v = as_matrix(req.q), as_matrix(req.k), as_matrix(req.v)
            r = scratch_attention(q, k, v, req.variant, req.n_heads, req.scale,
                                  max_weights=MAX_WEIGHTS)
        else:
            body["model"] = rt.model_ref()
            key_tt = tokenized(rt, req, "text")
            query_tt = tokenized(rt, req, "query_text")
            body["tokens"] = [t.as_dict() for t in key_tt.tokens]
            if req.variant != "cross":
                body["query_tokens"] = body["tokens"]
            elif query_tt is not None:
                body["query_tokens"] = [t.as_dict() for t in query_tt.tokens]
            q, k, v = embedding_qkv(
                rt.adapter.embed_matrix(), list(key_tt.input_ids),
                None if query_tt is None else list(query_tt.input_ids),
                req.variant, req.project, req.seed,
            )
            key_name = "text" if req.text is not None else "tokens"
            query_name = "query_text" if req.query_text is not None else "query_tokens"
            names = (query_name if query_tt is not None else key_name, key_name, key_name)
            r = scratch_attention(q, k, v, req.variant, req.n_heads, req.scale, names,
                                  max_weights=MAX_WEIGHTS)
        if req.encoding == "base64":
            check_wire_range(r, req.dtype)
        enc = (req.encoding, req.dtype, req.round)
        body.update({
            "variant": req.variant,
            "n_heads": req.n_heads,
            "d_k": r["d_k"],
            "d_v": r["d_v"],
            "scaling": r["scaling"],
            "weights": encode_tensor(r["weights"], *enc, "weights"),
            "scores": encode_tensor(r["scores"], *enc, "scores", allow_neg_inf=True),
            "output": encode_tensor(r["output"], *enc, "output"),
        })
        return body

    return Plan([], job, _estimate(rt, req))


def _estimate(rt, req: ScratchAttentionRequest) -> int:
    """Upper bound of the job's memory (service/serving/core/estimates.py): matrices as given, or
    for a text at most min(characters + 2, n_ctx) tokens of d_model-wide embeddings."""
    H = req.n_heads
    if req.text is None and req.tokens is None:
        n_q, n_k = len(req.q), len(req.k)
        d_k, d_v = len(req.q[0]) // H, len(req.v[0]) // H
        return scratch_bytes(H, n_q, n_k, max(d_k, 1), max(d_v, 1), req.encoding, req.dtype,
                             req.round)
    n_ctx, d = rt.adapter.n_ctx, rt.adapter.d_model
    n_k = min(len(req.text) + 2 if req.text is not None else len(req.tokens), n_ctx)
    n_q = (min(len(req.query_text) + 2, n_ctx) if req.query_text is not None else
           min(len(req.query_tokens), n_ctx) if req.query_tokens is not None else n_k)
    pca = tuple(rt.adapter.embed_matrix().shape) if req.project is not None else (0, 0)
    return scratch_bytes(H, n_q, n_k, max(d // H, 1), max(d // H, 1), req.encoding,
                         req.dtype, req.round, *pca)


ENDPOINTS = [
    Endpoint(
        path='/v1/scratch-attention', name='scratch_attention',
        request=ScratchAttentionRequest, response=ScratchAttentionResponse,
        summary='The textbook scaled dot-product attention on given matrices or token embeddings',
        description="""``softmax(Q K^T * scaling + mask) V`` computed in float64, as the source's
``attention(Q, K, V, mask)`` (000_1c89b6c8c2a32040.txt); ``scale`` off reproduces the
unscaled toy example of 001_92e9928af52718c3.txt.

Q, K, V are the given ``q``, ``k``, ``v``, or the static token embeddings of ``text``
(optionally PCA-projected for Q and K, the source's ``project_embeddings``: whitened, onto the
first ``project`` axes of the exact PCA of the embedding matrix, equal to scikit-learn's
``svd_solver='full'`` to rounding, where the source's ``'randomized'`` approximates it; one
fit per model, cached, computed with torch ops that never hold the event loop). Variants: self,
causal (tril mask), cross (queries from ``query_text`` or seeded random), multi-head split
(``n_heads``). Returns ``weights`` and ``scores`` ``[head, query_pos, key_pos]`` and
``output`` ``[query_pos, d_v]``. The matrices source needs no model.""",
        plan=plan,
        tokenize=False,
        needs_model=False,
        invalid='Invalid request: shapes, sizes, non-finite numbers, n_heads not dividing a width, causal with query_pos != key_pos.',
        tags=('scratch',), order=80,
    ),
]
