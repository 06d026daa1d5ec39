"""Path patching's arithmetic (Wang et al. 2022, IOI; Goldowsky-Dill et al. 2023): pure
functions on tensors and numbers, no model.

The construction. With every component but the senders frozen at the base run, the residual
stream that reaches a receiver is the base run's plus the senders' change (the residual stream
is a sum of component outputs), so a receiver's patched input is

    x_receiver = x_receiver_base + sum_s (out_s_other - out_s_base)          # [pos, d_model]

at the positions patched (the senders' change masked to ``sender_positions``). This is what a
forward with every other head's ``hook_result`` and every MLP's ``hook_mlp_out`` set to the
base run's values computes, to float rounding (tests/test_path_patch.py compares the two)."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch


def sender_change(other: torch.Tensor, base: torch.Tensor,
                  keep: torch.Tensor | None = None) -> torch.Tensor:
    """``other - base`` of a sender's output ``[..., pos, d_model]``, zero at the positions where
    ``keep`` ``[pos]`` (bool) is False (None: every position kept)."""
    d = other - base
    if keep is not None:
        d = d * keep.to(d.dtype)[:, None]
    return d


def ln_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm's pre-affine output ``(x - mean) / sqrt(var + eps)`` over the last axis (what
    TransformerLens 4.3 calls ``ln*.hook_normalized``)."""
    xc = x - x.mean(-1, keepdim=True)
    return xc / (xc.pow(2).mean(-1, keepdim=True) + eps).sqrt()


def reduce_terms(values: torch.Tensor, rows: Sequence[int], n_rows: int,
                 reduce: str) -> np.ndarray:
    """Per-row metric values from per-term values: ``values`` ``[n_terms]``, ``rows`` the row
    of each term; 'mean' or 'sum' of each row's terms -> ``[n_rows]`` float64."""
    v = values.detach().double().cpu().numpy()
    r = np.asarray(rows, dtype=np.int64)
    s = np.bincount(r, weights=v, minlength=n_rows)
    if reduce == "sum":
        return s
    return s / np.maximum(np.bincount(r, minlength=n_rows), 1)  # rows without terms: 0


def normalized(patched: float, base: float, other: float) -> float | None:
    """``(patched - base) / (other - base)``: 0 = no effect, 1 = the other run's whole effect;
    None where ``other == base`` or a value is not finite."""
    den = other - base
    if not (math.isfinite(patched) and math.isfinite(den)) or den == 0.0:
        return None
    return (patched - base) / den


class Moments:
    """Running count, sum and sum of squares (float64) of per-pair values, cell-wise over an
    array of ``shape``: mean and sample standard deviation (ddof 1)."""

    def __init__(self, shape: tuple[int, ...] = ()):
        self.n = 0
        self.s = np.zeros(shape, dtype=np.float64)
        self.s2 = np.zeros(shape, dtype=np.float64)

    def add(self, values: np.ndarray) -> None:
        """``values`` ``[pairs, *shape]``."""
        values = np.asarray(values, dtype=np.float64)
        self.n += values.shape[0]
        self.s += values.sum(0)
        self.s2 += (values * values).sum(0)

    def mean(self) -> np.ndarray:
        return self.s / max(self.n, 1)

    def std(self) -> np.ndarray | None:
        """Sample standard deviation (ddof 1); None for fewer than 2 values."""
        if self.n < 2:
            return None
        m = self.mean()
        var = (self.s2 - self.n * m * m) / (self.n - 1)
        return np.sqrt(np.maximum(var, 0.0))
