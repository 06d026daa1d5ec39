"""POST /v1/trajectories."""

from __future__ import annotations

from attnscope.schemas import TrajectoriesRequest, TrajectoriesResponse
from ..serving.core.routes import error_responses, v1_router
from ..deps import EngineDep
from ..serving import trajectories as serving

router = v1_router(tags=["trajectories"])

ERRORS = error_responses(
    "Invalid request, or a PCA the text cannot "
    "support (too few states x tokens, n_components too large), position out of range.")


@router.post(
    "/v1/trajectories",
    response_model=TrajectoriesResponse,
    responses=ERRORS,
    summary="Hidden-state trajectories of each token through the layers, PCA-projected",
)
async def post_trajectories(req: TrajectoriesRequest, engine: EngineDep):
    """Each token's path through the hidden states in one shared PCA space.

    Steps (source 000_1c89b6c8c2a32040.txt, "Contextual Embeddings"): drop the final hidden
    state (unless ``include_final``), flatten states x tokens (float64), StandardScaler,
    ``PCA(n_components, random_state=0)`` fitted on all tokens, reshape to per-token paths
    ``[token, state, component]``; start-to-end Euclidean distance in PCA space, plus (beyond
    the source) in the raw d_model space and the cosine of first and last state.

    Errors: 422 when PCA cannot be honoured (fewer than 2 states x tokens, ``n_components`` >
    min(states x tokens, d_model)), a position out of range, or the usual text checks.
    """
    return await engine.serve(req, serving.plan)
