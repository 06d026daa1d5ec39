"""POST /v1/trajectories: hidden-state trajectories in a shared PCA space.

Source: 000_1c89b6c8c2a32040.txt, "Contextual Embeddings" (drop the final hidden state,
flatten states x tokens, StandardScaler, PCA(n_components=2, random_state=0), reshape to
per-token paths, start-to-end Euclidean distance).
"""

from __future__ import annotations

from pydantic import Field

from attnscope.schemas.common import LenientModel, ModelRef, TensorField, TensorOptions, TextOrTexts, Token


class TrajectoriesRequest(TextOrTexts, TensorOptions):
    """Per-token paths of the hidden states through the layers, PCA-projected."""

    include_final: bool = Field(
        False,
        description="Keep the final hidden state. Default off, as the source does: GPT-2's last "
        "entry has the final LayerNorm applied, which shifts it sharply in PCA space.",
    )
    n_components: int = Field(
        2, ge=1, le=1024,
        description="PCA components (default 2, as the source). At most min(n_states * n_tokens, "
        "d_model); a request PCA cannot honour gets a 422 saying why.",
    )
    positions: list[int] | None = Field(
        None,
        description="Token selection: positions (0-based, each < n_tokens) whose paths and "
        "distances are returned, in the order given, each at most once; null = all tokens; [] = none (empty "
        "paths and distances). The PCA is always fitted on every token and state.",
    )


class TrajectoryResult(LenientModel):
    tokens: list[Token] = Field(description="All analysed tokens (positions index these).")
    positions: list[int] = Field(description="The selected token positions, in response order.")
    states: list[int] = Field(
        description="Hidden-state indices used, in order (0 = embedding output, i = output of "
        "block i); the final state is absent unless include_final."
    )
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
    trajectories: TrajectoryResult | None = Field(None, description="For a 'text' request.")
    results: list[TrajectoryResult] | None = Field(
        None, description="For a 'texts' request, in order; each text gets its own PCA (fitted "
        "on that text's states x tokens), so coordinates are not comparable across texts."
    )
