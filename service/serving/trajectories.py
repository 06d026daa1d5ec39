"""/v1/trajectories: hidden-state paths per token in one PCA space."""

from __future__ import annotations

from attnscope.schemas import TrajectoriesRequest, TrajectoriesResponse
from ..analysis.trajectories import check_trajectory_request, trajectories
from ..encoding import encode_tensor
from .core.estimates import trajectories_bytes
from ..errors import InvalidRequest
from .core.engine import Plan
from .core.table import Endpoint
from .common import text_or_results

#: adapter norm kind -> the name in ``state_names`` ("final RMSNorm output")
NORM_NAMES = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm", "rmsnorm_1p": "RMSNorm"}


def final_norm_name(adapter) -> str:
    """The final norm's name for ``state_names``: "LayerNorm" (GPT-2, GPT-NeoX) or "RMSNorm"
    (Llama, Mistral, Qwen2; Gemma / Gemma 2's ``x * (1 + weight)`` RMSNorm)."""
    return NORM_NAMES.get(getattr(adapter, "norm_kind", "layernorm"), "LayerNorm")


def plan(rt, req: TrajectoriesRequest, items) -> Plan:
    """Checks (PCA feasible, positions in range, include_final only where the model has a
    norm) and the job: per text the PCA-projected paths ``[token, state, component]`` over the
    L+1 residual-stream states (and the final norm's output with include_final, named
    ``final LayerNorm output`` or ``final RMSNorm output`` after the family's norm),
    distances and explained variance."""
    n_hidden, d_model = rt.adapter.n_layers + 1, rt.adapter.d_model
    if req.include_final and rt.adapter.final_norm() is None:
        raise InvalidRequest(
            f"include_final: this model ({rt.adapter.family}) has no final LayerNorm; its last "
            f"block's output (state {rt.adapter.n_layers}) is already among the default states",
            "include_final")
    wheres = [req.input_param(i) for i in range(len(items))]
    for it, where in zip(items, wheres):
        check_trajectory_request(n_hidden, len(it), d_model, req.include_final,
                                 req.n_components, req.positions, where)

    norm_name = final_norm_name(rt.adapter)

    def job(forwards) -> dict:
        out = []
        for fw, where in zip(forwards, wheres):
            r = trajectories(fw.hidden_states, req.include_final, req.n_components,
                             req.positions, where=where, final_state=fw.tensors.final_state,
                             final_norm=norm_name)
            pfx = "trajectories" if req.single else f"results.{where.split('.')[1]}"
            out.append({
                "tokens": [t.as_dict() for t in fw.tokens.tokens],
                "positions": r["positions"],
                "states": r["states"],
                "state_names": r["state_names"],
                "add_bos": fw.tokens.add_bos,
                "dtype": rt.info["dtype"],
                "n_components": r["n_components"],
                "explained_variance_ratio": r["explained_variance_ratio"].tolist(),
                "paths": encode_tensor(r["paths"], req.encoding, req.dtype, req.round,
                                       f"{pfx}.paths"),
                "distance_projected": r["distance_projected"].tolist(),
                "distance_full": r["distance_full"].tolist(),
                "cosine_first_last": [None if c != c else float(c)
                                      for c in r["cosine_first_last"]],
            })
        body: dict = {"model": rt.model_ref()}
        return text_or_results(req, body, "trajectories", out)

    n_states = n_hidden + (1 if req.include_final else 0)  # L+1 states, + ln_f output
    n_comp = req.n_components if req.n_components is not None else d_model
    est = trajectories_bytes([len(it) for it in items], n_states, d_model, n_comp,
                             req.encoding, req.dtype, req.round)
    return Plan(items, job, est, small_ops=True)


ENDPOINTS = [
    Endpoint(
        path='/v1/trajectories', name='trajectories',
        request=TrajectoriesRequest, response=TrajectoriesResponse,
        summary='Hidden-state trajectories of each token through the layers, PCA-projected',
        description="""Each token's path through the hidden states in one shared PCA space.

Steps (source 000_1c89b6c8c2a32040.txt, "Contextual Embeddings"): drop the final hidden
state (unless ``include_final``), flatten states x tokens (float64), StandardScaler,
``PCA(n_components, random_state=0)`` fitted on all tokens, reshape to per-token paths
``[token, state, component]``; start-to-end Euclidean distance in PCA space, plus (beyond
the source) in the raw d_model space and the cosine of first and last state.

Errors: 422 when PCA cannot be honoured (fewer than 2 states x tokens, ``n_components`` >
min(states x tokens, d_model)), a position out of range, or the usual text checks.""",
        plan=plan,
        invalid='Invalid request, or a PCA the text cannot support (too few states x tokens, n_components too large), position out of range.',
        tags=('trajectories',), order=60,
    ),
]
