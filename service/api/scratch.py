"""POST /v1/scratch-attention."""

from __future__ import annotations

import asyncio
import weakref

import anyio
import anyio.to_thread
import torch
from fastapi import APIRouter, Request

from attnscope.schemas import ScratchAttentionRequest, ScratchAttentionResponse
from attnscope.schemas.scratch import MAX_WEIGHTS
from attnscope.service.analysis.scratch import as_matrix, embedding_qkv, scratch_attention
from attnscope.service.api.common import error_responses
from attnscope.service.deps import get_runtime
from attnscope.service.encoding import ORJSONResponse, encode_tensor
from attnscope.service.errors import InvalidRequest

router = APIRouter(tags=["scratch"])

ERRORS = error_responses(
    "Invalid request: shapes, sizes, non-finite "
    "numbers, n_heads not dividing a width, causal with query_pos != key_pos.",
    device=False)


_LIMITERS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter]" = (
    weakref.WeakKeyDictionary())


def _pca_limiter() -> anyio.CapacityLimiter:
    """One-at-a-time limiter for 'project' requests, per event loop."""
    loop = asyncio.get_running_loop()
    lim = _LIMITERS.get(loop)
    if lim is None:
        lim = _LIMITERS[loop] = anyio.CapacityLimiter(1)
    return lim


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


@router.post(
    "/v1/scratch-attention",
    response_model=ScratchAttentionResponse,
    responses=ERRORS,
    summary="The textbook scaled dot-product attention on given matrices or token embeddings",
)
async def post_scratch_attention(req: ScratchAttentionRequest, request: Request):
    """``softmax(Q K^T * scaling + mask) V`` computed in float64, as the source's
    ``attention(Q, K, V, mask)`` (000_1c89b6c8c2a32040.txt); ``scale`` off reproduces the
    unscaled toy example of 001_92e9928af52718c3.txt.

    Q, K, V are the given ``q``, ``k``, ``v``, or the static token embeddings of ``text``
    (optionally PCA-projected for Q and K, the source's ``project_embeddings``). Variants: self,
    causal (tril mask), cross (queries from ``query_text`` or seeded random), multi-head split
    (``n_heads``). Returns ``weights`` and ``scores`` ``[head, query_pos, key_pos]`` and
    ``output`` ``[query_pos, d_v]``. The matrices source needs no model.
    """
    body: dict = {"model": None, "source": "matrices" if req.text is None else "embeddings",
                  "tokens": None, "query_tokens": None}
    if req.text is None:
        def work():
            q, k, v = as_matrix(req.q), as_matrix(req.k), as_matrix(req.v)
            return scratch_attention(q, k, v, req.variant, req.n_heads, req.scale,
                                     max_weights=MAX_WEIGHTS)
    else:
        rt = await get_runtime(request)
        body["model"] = rt.model_ref()

        def work():
            key_tt = rt.tokenize(req.text, req.add_bos, "text")
            query_tt = None
            if req.query_text is not None:
                query_tt = rt.tokenize(req.query_text, req.add_bos, "query_text")
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
            names = ("query_text" if query_tt is not None else "text", "text", "text")
            return scratch_attention(q, k, v, req.variant, req.n_heads, req.scale, names,
                                     max_weights=MAX_WEIGHTS)

    # A PCA fit of the embedding matrix takes seconds of CPU: one at a time, and requests
    # waiting for it wait here (holding no worker thread), not in the shared thread pool.
    limiter = _pca_limiter() if req.project is not None else None
    r = await anyio.to_thread.run_sync(work, limiter=limiter)
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
    return ORJSONResponse(body)
