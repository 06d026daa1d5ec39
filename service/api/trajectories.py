"""POST /v1/trajectories."""

from __future__ import annotations

import anyio.to_thread
from fastapi import APIRouter

from attnscope.schemas import TrajectoriesRequest, TrajectoriesResponse
from attnscope.service.analysis.trajectories import check_trajectory_request, trajectories
from attnscope.service.api.common import error_responses, forward_request, tokenize_request
from attnscope.service.deps import RuntimeDep, SlotDep
from attnscope.service.encoding import ORJSONResponse, encode_tensor

router = APIRouter(tags=["trajectories"])

ERRORS = error_responses(
    "Invalid request, or a PCA the text cannot "
    "support (too few states x tokens, n_components too large), position out of range.")


@router.post(
    "/v1/trajectories",
    response_model=TrajectoriesResponse,
    responses=ERRORS,
    summary="Hidden-state trajectories of each token through the layers, PCA-projected",
)
async def post_trajectories(req: TrajectoriesRequest, rt: RuntimeDep, slot: SlotDep):
    """Each token's path through the hidden states in one shared PCA space.

    Steps (source 000_1c89b6c8c2a32040.txt, "Contextual Embeddings"): drop the final hidden
    state (unless ``include_final``), flatten states x tokens (float64), StandardScaler,
    ``PCA(n_components, random_state=0)`` fitted on all tokens, reshape to per-token paths
    ``[token, state, component]``; start-to-end Euclidean distance in PCA space, plus (beyond
    the source) in the raw d_model space and the cosine of first and last state.

    Errors: 422 when PCA cannot be honoured (fewer than 2 states x tokens, ``n_components`` >
    min(states x tokens, d_model)), a position out of range, or the usual text checks.
    """
    items = await tokenize_request(rt, req)
    n_hidden, d_model = rt.adapter.n_layers + 1, rt.adapter.d_model
    wheres = ["text"] if req.text is not None else [f"texts.{i}" for i in range(len(items))]
    for it, where in zip(items, wheres):
        check_trajectory_request(n_hidden, len(it), d_model, req.include_final,
                                 req.n_components, req.positions, where)
    forwards = await forward_request(rt, slot, items)

    def work():
        return [
            trajectories(fw.hidden_states, req.include_final, req.n_components, req.positions,
                         where=where)
            for fw, where in zip(forwards, wheres)
        ]

    computed = await anyio.to_thread.run_sync(work)
    out = []
    for fw, where, r in zip(forwards, wheres, computed):
        pfx = "trajectories" if req.text is not None else f"results.{where.split('.')[1]}"
        out.append({
            "tokens": [t.as_dict() for t in fw.tokens.tokens],
            "positions": r["positions"],
            "states": r["states"],
            "n_components": r["n_components"],
            "explained_variance_ratio": r["explained_variance_ratio"].tolist(),
            "paths": encode_tensor(r["paths"], req.encoding, req.dtype, req.round, f"{pfx}.paths"),
            "distance_projected": r["distance_projected"].tolist(),
            "distance_full": r["distance_full"].tolist(),
            "cosine_first_last": [None if c != c else float(c) for c in r["cosine_first_last"]],
        })
    body: dict = {"model": rt.model_ref()}
    if req.text is not None:
        body["trajectories"] = out[0]
    else:
        body["results"] = out
    return ORJSONResponse(body)
