"""POST /v1/verify."""

from __future__ import annotations

from attnscope.schemas import VerifyRequest, VerifyResponse
from ..serving.core.routes import error_responses, v1_router
from ..deps import EngineDep
from ..serving import verify as serving

router = v1_router(tags=["verify"])

ERRORS = error_responses()


@router.post(
    "/v1/verify",
    response_model=VerifyResponse,
    responses=ERRORS,
    summary="Recompute the forward from scratch in float64 and compare it with the served one",
)
async def post_verify(req: VerifyRequest, engine: EngineDep):
    """The from-scratch check (DESIGN.md, "verification"), mode ``from_scratch`` (default):
    the forward of each text recomputed in float64 from its token ids, the model's weight
    tensors and its config by the project's own blocks (service/analysis/verify.py: wte+wpe /
    BERT embeddings, LayerNorm with the config's eps, q/k/v projections (GPT-2's Conv1D
    transposed vs Linear), the per-layer scale the config implies, the causal or
    bidirectional mask, softmax, output projection, MLP with the config's activation,
    residuals, ln_f), compared layer by layer with the SERVED pattern (per head, absolute),
    q/k/v, attention output and hidden states (relative to their scale). Reports per layer the
    scale used, the mask kind, the true maxima, the tolerance of the served dtype and the first
    failing layer. A config switch the recomputation does not implement: 422
    ``unsupported_model_config`` naming it. Cost: about 4-10 forwards' time (float64).

    Mode ``recorded_qkv``, the cheap check of the attention step alone: for each layer the
    model's OWN q, k, v (recorded by the runtime's hooks on its q/k/v projections) through the
    textbook scaled dot-product attention with the model's scaling, the float32 upcast under
    ``reorder_and_upcast_attn`` and the additive finfo.min causal mask; then the heads merged
    through the CURRENT output projection; max absolute differences against the recorded
    pattern and attention output (tolerance 1e-5 for float32). ``projections: true`` also
    recomputes q/k/v from the recorded attention input with the current weights. Same torch
    operations in the model's dtype, so its differences are usually exactly 0: it checks
    consistency of the attention step, not the model.

    HTTP 200 also when the check fails: read ``passed``. A NaN anywhere fails.
    """
    return await engine.serve(req, serving.plan, check=serving.check)
