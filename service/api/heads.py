"""POST /v1/heads: scores and a label for every head."""

from __future__ import annotations

from attnscope.schemas import HeadsRequest, HeadsResponse
from ..serving.core.routes import error_responses, v1_router
from ..deps import EngineDep
from ..serving import heads as serving

router = v1_router(tags=["heads"])

ERRORS = error_responses(
    "Invalid request: blank text, a text of fewer "
    "than 2 tokens, too many tokens, a probe longer than n_ctx, a bad threshold.")


@router.post("/v1/heads", response_model=HeadsResponse, responses=ERRORS,
             summary="Classify every head: pattern scores, induction probe, label")
async def heads(req: HeadsRequest, engine: EngineDep):
    """Tokens: BOS prepended by default where the model has one (``add_bos`` null -> true for
    GPT-2), as TransformerLens' ``detect_head`` and S004 tokenize; echoed in ``add_bos``.

    Per head: TransformerLens ``head_detector`` scores (previous_token, duplicate_token,
    induction; fraction of attention mass on the pattern, [0, 1]), next_token (encoders),
    self, sink, entropy (nats) and entropy_normalized ([0, 1]), mean_distance (tokens), the
    induction probe (Olsson et al. 2022: mass on the successors of the token in all earlier
    repeats; [0, 1]), S004's own previous_s004 / sink_s004 (used for S004's thresholds), every
    label a head passes (``labels``), the primary ``label`` and the margins to the thresholds.
    Several texts: each score is the mean over texts. Field descriptions give every formula.

    Errors: 422 blank text, text under 2 tokens, over n_ctx tokens, probe over n_ctx;
    413; 429; 503.
    """
    req = serving.with_default_add_bos(engine.runtime, req)
    return await engine.serve(req, serving.plan)
