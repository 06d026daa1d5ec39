"""POST /v1/trajectories: hidden-state trajectories in a shared PCA space.

Source: 000_1c89b6c8c2a32040.txt, "Contextual Embeddings" (drop the final hidden state,
flatten states x tokens, StandardScaler, PCA(n_components=2, random_state=0), reshape to
per-token paths, start-to-end Euclidean distance).
"""

from __future__ import annotations

from pydantic import Field

from .common import (
    MAX_POSITIONS, LenientModel, ModelRef, TensorField, TensorOptions, TextOrTexts, Token,
)
from .common import AT_MOST_MARK, add_bos_echo, distinct_positions


class TrajectoriesRequest(TextOrTexts, TensorOptions):
    """Per-token paths of the hidden states through the layers, PCA-projected."""

    include_final: bool = Field(
        False,
        description="Append the final LayerNorm's output (GPT-2 ln_f; Hugging Face's last "
        "hidden_states entry) as one more state, L+1. Default off: the default states are the "
        "L+1 residual-stream states (embeddings, then each block's output, the last one BEFORE "
        "ln_f), so every layer is in the path and none is LayerNorm-shifted (the source drops "
        "Hugging Face's last entry for that reason). 422 for models without a final LayerNorm "
        "(BERT: its last block's output is already state L).",
    )
    n_components: int = Field(
        2, ge=1, le=1024, json_schema_extra={AT_MOST_MARK: "d_model"},
        description="PCA components (default 2, as the source). At most min(n_states * n_tokens, "
        "d_model); a request PCA cannot honour gets a 422 saying why.",
    )
    positions: list[int] | None = Field(
        None, max_length=MAX_POSITIONS, fail_fast=True,
        json_schema_extra=distinct_positions(minimum=0),
        description="Token selection: positions (0-based, each < n_tokens) whose paths and "
        f"distances are returned, in the order given, each at most once (at most "
        f"{MAX_POSITIONS}); null = all tokens; [] = none (empty paths and distances). The PCA is always fitted on every token and state.",
    )


class TrajectoryResult(LenientModel):
    tokens: list[Token] = Field(description="All analysed tokens (positions index these).")
    positions: list[int] = Field(description="The selected token positions, in response order.")
    states: list[int] = Field(
        description="State indices used, in order: 0 = embedding output, i = output of block "
        "i-1 (i = 1..L, the last before any final LayerNorm), L+1 = the final LayerNorm's "
        "output (only with include_final)."
    )
    state_names: list[str] = Field(
        default_factory=list, description="The same states by name: 'embeddings', 'block i "
        "output', 'final LayerNorm output'.")
    add_bos: bool = Field(False, description="Whether BOS was prepended (the request's add_bos).")
    dtype: str = Field("float32", description="The dtype the hidden states were computed in "
                       "(the model's); the PCA runs in float64.")
    n_components: int = Field(description="Number of PCA components.")
    explained_variance_ratio: list[float] = Field(
        description="Fraction of the standardised variance each component explains, in [0, 1], "
        "descending (scikit-learn's PCA.explained_variance_ratio_)."
    )
    paths: TensorField = Field(
        description="Per-token paths in PCA space, float, shape [token, state, component] "
        "(token in the order of 'positions'); unitless (standardised coordinates)."
    )
    distance_projected: list[float] = Field(
        description="Per selected token: Euclidean distance between its first and last state in "
        "PCA space (the source's 'How far did each token move?'), >= 0, standardised units."
    )
    distance_full: list[float] = Field(
        description="Per selected token: Euclidean distance between its first and last raw "
        "hidden state in the full d_model space (not standardised), >= 0, model units."
    )
    cosine_first_last: list[float | None] = Field(
        description="Per selected token: cosine similarity of its first and last raw hidden "
        "state, in [-1, 1]; null when either vector is zero."
    )


class TrajectoriesResponse(LenientModel):
    model: ModelRef = Field(description="The model that produced this response.")
    add_bos: bool = add_bos_echo()
    trajectories: TrajectoryResult | None = Field(None, description="For a 'text' or 'tokens' request.")
    results: list[TrajectoryResult] | None = Field(
        None, description="For a 'texts' or 'token_lists' request, in order; each text gets its own PCA (fitted "
        "on that text's states x tokens), so coordinates are not comparable across texts."
    )
