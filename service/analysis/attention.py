"""Attention patterns and scores: selection of layers/heads and the head mean.

Pattern = post-softmax attention weights, softmax(q.k^T * scaling + mask) (Vaswani et al. 2017,
eq. 1; source 000_1c89b6c8c2a32040.txt, "Extracting attention weights", which averages heads
with ``tensor.mean(dim=0)``). Scores = pre-softmax ``q.k^T * scaling`` with masked entries -inf.
"""

from __future__ import annotations

import torch


def select_heads(
    t: torch.Tensor,  # [layer, head, query_pos, key_pos]
    layers: list[int] | None,
    heads: list[int] | None,
    head_mean: bool,
) -> torch.Tensor:
    """Select layers/heads (in the order given) and optionally average heads.

    Returns ``[n_layers_sel, n_heads_sel, query_pos, key_pos]``, or ``[n_layers_sel, query_pos,
    key_pos]`` with ``head_mean`` (arithmetic mean over the selected heads; -inf entries, which
    are masked for every head alike, stay -inf). Same dtype as ``t``.
    """
    if layers is not None:
        t = t.index_select(0, torch.tensor(layers, dtype=torch.long))
    if heads is not None:
        t = t.index_select(1, torch.tensor(heads, dtype=torch.long))
    if head_mean:
        t = t.mean(dim=1)
    return t
