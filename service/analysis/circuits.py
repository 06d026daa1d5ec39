"""Weight-only circuit summaries of attention heads: pure functions on weight tensors.

Source: Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits"
(transformer-circuits.pub/2021/framework): the OV circuit ``W_OV = W_V W_O`` and QK circuit
``W_QK = W_Q W_K^T`` of each head (row-vector convention, TransformerLens' ``model.OV`` /
``model.QK``), the full OV circuit ``W_E W_OV W_U`` and its eigenvalue summary, and the Q-, K-
and V-composition scores ``||W_A W_B||_F / (||W_A||_F ||W_B||_F)`` (TransformerLens
``utils.composition_scores`` / ``all_composition_scores``).

Every matrix here is d_model x d_model or larger but of rank <= d_head, so it is never built:
as TransformerLens' ``FactoredMatrix`` does, ``A B`` (A ``[m, r]``, B ``[r, n]``) is reduced to
an ``r x r`` core by QR (``A = Q_a R_a``, ``B^T = Q_b R_b`` -> ``A B = Q_a (R_a R_b^T) Q_b^T``,
whose singular values and Frobenius norm are the core's), and the eigenvalues of the full OV
circuit ``W_E W_V W_O W_U`` (d_vocab x d_vocab: 50257^2 for GPT-2) are those of the cyclic
rotation ``W_O (W_U W_E) W_V`` (d_head x d_head; the nonzero eigenvalues of ``XY`` and ``YX``
coincide), with ``W_U W_E`` (d_model x d_model) formed once for every head.

Everything is computed in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CircuitWeights:
    """Raw weights, row-vector convention: ``W_Q``, ``W_K``, ``W_V`` ``[layer, head, d_model,
    d_head]``, ``W_O`` ``[layer, head, d_head, d_model]``, ``W_E`` ``[d_vocab, d_model]``,
    ``W_U`` ``[d_model, d_vocab]``."""

    W_Q: torch.Tensor
    W_K: torch.Tensor
    W_V: torch.Tensor
    W_O: torch.Tensor
    W_E: torch.Tensor
    W_U: torch.Tensor


@dataclass
class Circuits:
    """``copying`` / ``positive_share`` ``[layer, head]``; ``ov_sv`` / ``qk_sv`` ``[layer,
    head, d_head]`` (descending); ``ov_norm`` / ``qk_norm`` ``[layer, head]``; ``comp`` mode
    ('q', 'k', 'v') -> ``[layer, head, layer, head]`` (0 unless layer_a < layer_b), or None."""

    copying: torch.Tensor
    positive_share: torch.Tensor
    ov_sv: torch.Tensor
    qk_sv: torch.Tensor
    ov_norm: torch.Tensor
    qk_norm: torch.Tensor
    comp: dict[str, torch.Tensor] | None


def _r(x: torch.Tensor) -> torch.Tensor:
    """R of the reduced QR of ``x`` ``[..., m, r]`` (m >= r): ``x = Q R``, ``R`` ``[..., r, r]``."""
    return torch.linalg.qr(x, mode="r").R


def copying_scores(W_E: torch.Tensor, W_V: torch.Tensor, W_O: torch.Tensor, W_U: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per head the eigenvalues ``[..., d_head]`` (complex) of the full OV circuit's nonzero
    part, its copying score ``sum(lambda) / sum(|lambda|)`` (Elhage et al. 2021, in [-1, 1];
    the sum of the eigenvalues is real, the trace) and the positive share
    ``sum(max(Re lambda, 0)) / sum(|lambda|)`` (in [0, 1]).

    ``W_E`` ``[d_vocab, d_model]``, ``W_V`` ``[..., d_model, d_head]``, ``W_O`` ``[..., d_head,
    d_model]``, ``W_U`` ``[d_model, d_vocab]``; eigenvalues of ``W_O (W_U W_E) W_V``."""
    G = W_U.double() @ W_E.double()  # [d_model, d_model], once
    M = W_O.double() @ G @ W_V.double()  # [..., d_head, d_head]
    lam = torch.linalg.eigvals(M)
    mag = lam.abs().sum(-1)
    return lam, lam.real.sum(-1) / mag, lam.real.clamp(min=0).sum(-1) / mag


def circuits(w: CircuitWeights, composition: bool = True) -> Circuits:
    """Every head's OV/QK summaries and (``composition``) the composition scores between
    every pair of heads, as TransformerLens ``all_composition_scores(mode)``:
    ``scores[la, ha, lb, hb] = ||L_a R_b||_F / (||L_a||_F ||R_b||_F)`` with ``L_a`` =
    W_OV of head a and ``R_b`` = W_QK (Q), W_QK^T (K) or W_OV (V) of head b, zero where
    ``la >= lb``."""
    W_Q, W_K, W_V, W_O = (t.double() for t in (w.W_Q, w.W_K, w.W_V, w.W_O))
    L, H, D, dh = W_Q.shape
    R_Q, R_K, R_V = _r(W_Q), _r(W_K), _r(W_V)
    R_O = _r(W_O.transpose(-1, -2))  # W_O^T = Q_O R_O  ->  W_O = R_O^T Q_O^T
    # W_OV = Q_V (R_V R_O^T) Q_O^T ; W_QK = Q_Q (R_Q R_K^T) Q_K^T
    ov_core = R_V @ R_O.transpose(-1, -2)
    qk_core = R_Q @ R_K.transpose(-1, -2)
    ov_sv = torch.linalg.svdvals(ov_core)
    qk_sv = torch.linalg.svdvals(qk_core)
    ov_norm = torch.linalg.matrix_norm(ov_core)
    qk_norm = torch.linalg.matrix_norm(qk_core)
    _, copying, positive = copying_scores(w.W_E, W_V, W_O, w.W_U)
    comp = None
    if composition:
        comp = {}
        # Head a's left factor R_V^a W_O^a [dh, D] (W_OV^a = Q_V^a R_V^a W_O^a, and Q_V^a's
        # orthonormal columns keep the Frobenius norm); head b's right factor, per mode, with
        # its orthonormal Q dropped on the right: Q: W_QK^b = W_Q^b R_K^T Q_K^T -> W_Q^b R_K^T;
        # K: W_QK^b^T = W_K^b R_Q^T Q_Q^T -> W_K^b R_Q^T; V: W_OV^b = W_V^b R_O^T Q_O^T ->
        # W_V^b R_O^T [D, dh]. ||L_a R_b||_F = ||left_a right_b||_F: one GEMM per sender layer
        # over the heads of every LATER layer only (TL's mask zeroes the rest), so each pair
        # costs one [dh, D] x [D, dh] product and no per-pair core products.
        left = (R_V @ W_O).reshape(L, H * dh, D)  # [layer, head*dh, D]
        for mode, X, Rr, right_norm in (("q", W_Q, R_K, qk_norm), ("k", W_K, R_Q, qk_norm),
                                        ("v", W_V, R_O, ov_norm)):
            right = (X @ Rr.transpose(-1, -2)).permute(2, 0, 1, 3).reshape(D, L * H * dh)
            norms = torch.zeros(L, H, L, H, dtype=torch.float64)
            for la in range(L - 1):
                block = left[la] @ right[:, (la + 1) * H * dh:]  # [H*dh, (L-la-1)*H*dh]
                block = block.reshape(H, dh, L - la - 1, H, dh)
                norms[la, :, la + 1:] = torch.linalg.vector_norm(block, dim=(1, 4))
            s = norms / ov_norm[:, :, None, None] / right_norm[None, None]
            comp[mode] = s
    return Circuits(copying, positive, ov_sv, qk_sv, ov_norm, qk_norm, comp)
