"""Hidden-state trajectories: each token's path through the layers in one shared PCA space.

Source: 000_1c89b6c8c2a32040.txt, "Contextual Embeddings" -> "Projecting hidden states into a
shared space" and "Measuring trajectories":

1. take the L+1 residual-stream states: the embeddings, then each block's output, the last one
   BEFORE any final LayerNorm (the source drops Hugging Face's last hidden state because GPT-2
   applies its final LayerNorm there; the runtime keeps the last block's own output instead, so
   no layer is lost). The final LayerNorm's output (GPT-2 ``ln_f``) is appended only on request
   (``include_final``), as state L+1;
2. flatten ``[n_state, n_token, d_model] -> [n_state * n_token, d_model]`` in float64;
3. standardise with ``StandardScaler`` (zero mean, unit variance per dimension);
4. ``PCA(n_components=2, random_state=0).fit_transform`` (more components on request);
5. reshape to ``[n_state, n_token, n_components]``; a token's path is ``[:, token, :]``;
6. start-to-end Euclidean distance of each token in the projected space.

Beyond the document: the same distance in the full (raw, unstandardised) hidden-state space
and the cosine similarity of each token's first and last state.
"""

from __future__ import annotations

import numpy as np
import torch

from ._blas import one_blas_thread
from ..errors import InvalidRequest, NonFiniteValues, OutOfRange, n_tokens


def state_names(n_layers: int, include_final: bool, final_norm: str = "LayerNorm") -> list[str]:
    """Names of the states :func:`trajectories` uses: ``embeddings``, ``block i output`` for
    i < n_layers (the last before the final norm), and ``final <final_norm> output`` when
    included (``final_norm``: the model's final norm, "LayerNorm" for GPT-2 / GPT-NeoX,
    "RMSNorm" for Llama, Mistral, Qwen2, Gemma, Gemma 2)."""
    names = ["embeddings"] + [f"block {i} output" for i in range(n_layers)]
    return names + ([f"final {final_norm} output"] if include_final else [])


def trajectories(
    hidden_states: torch.Tensor,  # [layer+1, pos, d_model]
    include_final: bool = False,
    n_components: int = 2,
    positions: list[int] | None = None,
    random_state: int = 0,
    where: str = "text",
    final_state: torch.Tensor | None = None,  # [pos, d_model]
    final_norm: str = "LayerNorm",
) -> dict:
    """PCA trajectories of one text's hidden states (see the module docstring for the steps).

    Args:
        hidden_states: ``[n_layers + 1, n_tokens, d_model]``: the residual-stream states,
            index 0 = embedding output, index i = block i-1's output (pre final LayerNorm);
            every one is used.
        include_final: append ``final_state`` (the final LayerNorm's output) as one more state.
        final_state: ``[n_tokens, d_model]``, required with ``include_final`` (ValueError
            without it).
        final_norm: the final norm's kind as named in ``state_names`` ("LayerNorm", "RMSNorm").
        n_components: PCA components, 1 <= n <= min(n_state * n_tokens, d_model).
        positions: selected token positions (each in [0, n_tokens)), null = all; the PCA is
            always fitted on every token and state.
        random_state: the PCA's random_state (the source uses 0).
        where: the request field holding this text (``"text"`` or ``"texts.<i>"``), named in
            error messages.

    Returns:
        dict with ``states`` (state indices used: 0..n_layers, and n_layers+1 for the final
        LayerNorm's output), ``state_names`` (:func:`state_names`), ``positions``, ``n_components``,
        ``explained_variance_ratio`` (float64 ``[n_components]``, in [0, 1]), ``paths``
        (float64 ``[n_selected, n_state, n_components]``), ``distance_projected``,
        ``distance_full`` (float64 ``[n_selected]``, >= 0) and ``cosine_first_last``
        (``[n_selected]`` in [-1, 1], NaN where a state vector is zero).

    Raises:
        OutOfRange: a position outside the text (param ``positions.<i>``).
        InvalidRequest: a PCA the data cannot support (param ``n_components``, or ``text`` for
            a single sample): fewer than 2 samples, n_components > min(n_samples, d_model),
            hidden states with no variance.
        NonFiniteValues: the hidden states hold NaN/inf (or float64 values whose column
            sums overflow).

    Cost (GPT-2 small shapes, T = 128, [1536, 768] samples x features): ~25 ms, ~20 of them
    scikit-learn's randomized SVD (16 float64 products with the data matrix, one BLAS thread;
    two threads measured slower, 5x slower right after a forward).
    """
    from sklearn import config_context
    from sklearn.decomposition import PCA
    from sklearn.preprocessing import StandardScaler

    n_total, n_token, d_model = hidden_states.shape
    positions = check_trajectory_request(
        n_total, n_token, d_model, include_final, n_components, positions, where
    )
    # 1. the L+1 residual-stream states, and the final LayerNorm's output on request
    if include_final:
        if final_state is None or tuple(final_state.shape) != (n_token, d_model):
            raise ValueError("include_final needs final_state [n_tokens, d_model]")
        hidden_states = torch.cat([hidden_states, final_state.to(hidden_states.dtype)[None]])
    n_state = hidden_states.shape[0]
    states = list(range(n_state))
    # 2. flatten states x tokens, float64 as the source (a fresh array, changed in place below)
    flat = _float64_copy(hidden_states.reshape(n_state * n_token, d_model))
    sel = np.asarray(positions, dtype=np.int64)
    first = flat[sel]  # [n_selected, d_model], state 0 (copies)
    last = flat[(n_state - 1) * n_token + sel]  # the last state used
    # 3. standardise (StandardScaler, in place: copy=False on our own float64 array)
    if not _finite(flat, check_all=hidden_states.dtype == torch.float64):
        raise NonFiniteValues(
            f"{where}: the hidden states hold non-finite values (NaN or inf, or sums beyond "
            "float64); refusing to project"
        )
    # 4. PCA with a fixed random state (scikit-learn's default solver for the shape; copy=False
    #    centres our own array in place, the same numbers). One BLAS thread: see _blas.py.
    pca = PCA(n_components=n_components, random_state=random_state, copy=False)
    with one_blas_thread(), config_context(assume_finite=True):  # checked in step 3
        flat = StandardScaler(copy=False).fit_transform(flat)
        if not np.any(flat):
            raise InvalidRequest(
                f"{where}: the hidden states do not vary across states and tokens, so PCA "
                "has no direction to find", where,
            )
        projected = pca.fit_transform(flat)
    evr = np.asarray(pca.explained_variance_ratio_, dtype=np.float64)
    # 5. reshape to per-token paths [n_state, n_token, n_components]
    projected = projected.reshape(n_state, n_token, n_components)
    paths = np.ascontiguousarray(projected[:, sel, :].transpose(1, 0, 2))  # [token, state, comp]
    # 6. start-to-end distances
    distance_projected = np.linalg.norm(paths[:, -1, :] - paths[:, 0, :], axis=-1)
    distance_full = np.linalg.norm(last - first, axis=-1)
    norms = np.linalg.norm(first, axis=-1) * np.linalg.norm(last, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cosine = np.where(norms > 0, (first * last).sum(-1) / norms, np.nan)
    cosine = np.clip(cosine, -1.0, 1.0)
    return {
        "states": states,
        "state_names": state_names(n_total - 1, include_final, final_norm),
        "positions": list(positions),
        "n_components": n_components,
        "explained_variance_ratio": evr,
        "paths": paths,
        "distance_projected": distance_projected,
        "distance_full": distance_full,
        "cosine_first_last": cosine,
    }


def _float64_copy(x: torch.Tensor) -> np.ndarray:
    """A fresh C-contiguous float64 numpy copy of a CPU tensor (numpy's single-threaded cast
    for float16/32/64; torch's otherwise, e.g. bfloat16)."""
    x = x.detach().cpu()
    if x.dtype in (torch.float16, torch.float32, torch.float64):
        return np.array(x.numpy(), dtype=np.float64, order="C", copy=True)
    return np.ascontiguousarray(x.to(torch.float64).numpy())


def _finite(X: np.ndarray, check_all: bool) -> bool:
    """Whether every column sum of ``X`` is finite (a NaN/inf anywhere makes its column's sum
    non-finite; so do float64 values whose sum overflows) and, with ``check_all``, every
    value (float64 input, where an overflowing sum is possible without an inf)."""
    with np.errstate(over="ignore", invalid="ignore"):
        if not np.isfinite(np.sum(X, axis=0)).all():
            return False
    return not check_all or bool(np.isfinite(X).all())


def check_trajectory_request(
    n_hidden: int,
    n_token: int,
    d_model: int,
    include_final: bool,
    n_components: int,
    positions: list[int] | None,
    where: str = "text",
) -> list[int]:
    """Everything :func:`trajectories` can refuse before a forward pass (cheap checks first).

    ``n_hidden`` = n_layers + 1 residual-stream states (all used; ``include_final`` adds the
    final LayerNorm's output). Returns the selected positions (all when None).

    Raises:
        OutOfRange: a position outside the text (param ``positions.<i>``).
        InvalidRequest: a repeated position (param ``positions.<i>``), fewer than 2 samples (states x tokens) for PCA (param ``where``), or
            n_components > min(n_samples, d_model) (param ``n_components``).
    """
    if positions is None:
        positions = list(range(n_token))
    for i, p in enumerate(positions):
        if not 0 <= p < n_token:
            raise OutOfRange(
                f"{where}: positions[{i}] = {p} is out of range: the text has "
                f"{n_tokens(n_token)} (valid positions 0..{n_token - 1})", f"positions.{i}",
            )
    seen: dict[int, int] = {}
    for i, p in enumerate(positions):
        if p in seen:
            raise InvalidRequest(
                f"positions[{i}] = {p} repeats positions[{seen[p]}]; each position may appear "
                "once", f"positions.{i}",
            )
        seen[p] = i
    n_state = n_hidden + 1 if include_final else n_hidden
    n_samples = n_state * n_token
    if n_samples < 2:
        raise InvalidRequest(
            f"{where}: PCA needs at least 2 samples (states x tokens) but this text gives "
            f"{n_state} state(s) x {n_token} token(s) = {n_samples}; use a longer text", where,
        )
    limit = min(n_samples, d_model)
    if n_components > limit:
        raise InvalidRequest(
            f"{where}: n_components = {n_components} is more than PCA can give: at most "
            f"min(n_samples, d_model) = min({n_state} states x {n_token} tokens = {n_samples}, "
            f"{d_model}) = {limit}", "n_components",
        )
    return list(positions)
