"""POST /v1/scratch-attention."""

from __future__ import annotations

from attnscope.schemas import ScratchAttentionRequest, ScratchAttentionResponse
from ..serving.core.routes import error_responses, v1_router
from ..deps import EngineDep
from ..serving import scratch as serving

router = v1_router(tags=["scratch"])

ERRORS = error_responses(
    "Invalid request: shapes, sizes, non-finite "
    "numbers, n_heads not dividing a width, causal with query_pos != key_pos.")


@router.post(
    "/v1/scratch-attention",
    response_model=ScratchAttentionResponse,
    responses=ERRORS,
    summary="The textbook scaled dot-product attention on given matrices or token embeddings",
)
async def post_scratch_attention(req: ScratchAttentionRequest, engine: EngineDep):
    """``softmax(Q K^T * scaling + mask) V`` computed in float64, as the source's
    ``attention(Q, K, V, mask)`` (000_1c89b6c8c2a32040.txt); ``scale`` off reproduces the
    unscaled toy example of 001_92e9928af52718c3.txt.

    Q, K, V are the given ``q``, ``k``, ``v``, or the static token embeddings of ``text``
    (optionally PCA-projected for Q and K, the source's ``project_embeddings``). Variants: self,
    causal (tril mask), cross (queries from ``query_text`` or seeded random), multi-head split
    (``n_heads``). Returns ``weights`` and ``scores`` ``[head, query_pos, key_pos]`` and
    ``output`` ``[query_pos, d_v]``. The matrices source needs no model.
    """
    return await engine.serve(req, serving.plan, tokenize=False, needs_model=False)
