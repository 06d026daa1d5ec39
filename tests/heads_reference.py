"""Reference head scores for the tests: TransformerLens ``head_detector`` semantics written
the straightforward way (dense 0/1 detection patterns, per layer, float64), to cross-check
the vectorised ``attnscope.service.analysis.heads.head_scores`` (which sums only the marked
pairs). Formulas: the module docstring of service/analysis/heads.py."""

from __future__ import annotations

import math
from typing import Sequence

import torch


def previous_token_detection_pattern(n: int) -> torch.Tensor:
    """``[n, n]`` float32: 1 where key_pos = query_pos - 1 (TransformerLens
    ``get_previous_token_head_detection_pattern``)."""
    return torch.diag(torch.ones(max(n - 1, 0)), -1) if n > 1 else torch.zeros(n, n)


def next_token_detection_pattern(n: int) -> torch.Tensor:
    """``[n, n]`` float32: 1 where key_pos = query_pos + 1 (the mirror of previous-token)."""
    return torch.diag(torch.ones(max(n - 1, 0)), 1) if n > 1 else torch.zeros(n, n)


def duplicate_token_detection_pattern(ids: Sequence[int]) -> torch.Tensor:
    """``[n, n]`` float32: 1 where key_pos < query_pos and the two tokens have the same id
    (TransformerLens ``get_duplicate_token_head_detection_pattern``)."""
    t = torch.as_tensor(list(ids), dtype=torch.long)
    eq = (t[:, None] == t[None, :]).float()
    return torch.tril(eq, diagonal=-1)


def induction_detection_pattern(ids: Sequence[int]) -> torch.Tensor:
    """``[n, n]`` float32: 1 at (q, k) where k <= q, k >= 1 and ``ids[k-1] == ids[q]`` with
    k-1 != q: the token right after an earlier copy of the query token (TransformerLens
    ``get_induction_head_detection_pattern``: the duplicate pattern shifted one key right)."""
    dup = duplicate_token_detection_pattern(ids)
    n = dup.shape[0]
    out = torch.zeros_like(dup)
    if n > 1:
        out[:, 1:] = dup[:, :-1]
    return torch.tril(out)


def pattern_match_score(
    pattern: torch.Tensor,  # [..., query_pos, key_pos], e.g. [layer, head, T, T]
    detection: torch.Tensor,  # [query_pos, key_pos], 0/1
    exclude_bos: bool = False,
    exclude_current_token: bool = False,
) -> torch.Tensor:
    """Fraction of each head's attention mass on ``detection``: ``sum(A*P) / sum(A)``.

    TransformerLens ``compute_head_attention_similarity_score(error_measure="mul")``:
    ``exclude_bos`` zeroes key column 0 and ``exclude_current_token`` the diagonal of A before
    both sums. Returns float64 of the leading shape (``[layer, head]``) in [0, 1]; NaN where
    the remaining mass is 0.
    """
    a = pattern.double()
    if exclude_bos or exclude_current_token:
        a = a.clone()
        if exclude_bos:
            a[..., :, 0] = 0
        if exclude_current_token:
            a.diagonal(dim1=-2, dim2=-1).zero_()
    num = (a * detection.double()).sum((-2, -1))
    den = a.sum((-2, -1))
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.full_like(den, math.nan))


def row_entropy(pattern: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each row: ``-sum_k A ln A`` (0 ln 0 = 0). ``[..., query_pos]`` float64."""
    a = pattern.double()
    return -torch.where(a > 0, a * a.clamp_min(1e-300).log(), torch.zeros_like(a)).sum(-1)
