"""POST /v1/verify."""

from __future__ import annotations

from fastapi import APIRouter

from attnscope.schemas import VerifyRequest, VerifyResponse
from attnscope.service.api.common import error_responses
from attnscope.service.deps import EngineDep
from attnscope.service.serving import verify as serving

router = APIRouter(tags=["verify"])

ERRORS = error_responses()


@router.post(
    "/v1/verify",
    response_model=VerifyResponse,
    responses=ERRORS,
    summary="Recompute every layer's attention from scratch and compare with the model's",
)
async def post_verify(req: VerifyRequest, engine: EngineDep):
    """The from-scratch check (DESIGN.md, "verification"). For each layer: the model's OWN
    q, k, v (recorded by the runtime's hooks on its q/k/v projections) through the textbook
    scaled dot-product attention (000_1c89b6c8c2a32040.txt) with the model's scaling, the
    float32 upcast under ``reorder_and_upcast_attn`` and the additive finfo.min causal mask
    where the model is causal; then the heads merged through the CURRENT output projection.

    Compared with the model's recorded pattern and attention output: max absolute difference
    per layer and head (pattern) and per layer (output), overall ``max_abs_diff``, the
    ``tolerance`` (default 1e-5 for float32) and ``passed``. A NaN anywhere fails.
    ``projections: true`` also recomputes q/k/v from the recorded attention input with the
    current weights (``qkv_max_abs_diff``, counts toward ``passed``): three more
    d_model x d_model matmuls per layer, about 3x the default's time (GPT-2 small, T=128:
    ~20 ms default vs ~60 ms on 2 CPU cores). The default does not see a change of the q/k/v
    weights made after the forward (the recorded q/k/v are what the model used); it does see
    a change of the output projection. HTTP 200 also when the check fails: read ``passed``.
    """
    return await engine.serve(req, serving.plan, check=serving.check)
