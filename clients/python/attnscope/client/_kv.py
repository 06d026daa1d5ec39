"""Query head -> key/value head maps for grouped-query attention labels ("head 3 \u00b7 kv 1"),
shared by the figures (plots) and the notebook views (no matplotlib needed)."""

from __future__ import annotations

from typing import Any

import numpy as np


def _get(obj: Any, name: str, default: Any = None) -> Any:
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)


def kv_head_map(kv_heads: Any, n_heads: int) -> list[int] | None:
    """Query head -> key/value head for grouped-query attention labels: ``kv_heads`` is GET
    /v1/model's ``attention.kv_head_of_query_head`` (a list), its ``n_kv_heads`` (an int:
    head h reads kv head ``h // (n_heads // n_kv_heads)``, Hugging Face's ``repeat_kv``), a
    ``ModelInfo`` (or its dict), or None (no labels). Returns None where every query head has
    its own key/value head (no GQA: nothing to label).

    Raises:
        ValueError: an int that does not divide ``n_heads``, or a list not ``n_heads`` long."""
    if kv_heads is None:
        return None
    att = _get(kv_heads, "attention", None)
    if att is not None:
        kv_heads = _get(att, "kv_head_of_query_head", None)
        if kv_heads is None:
            return None
    if isinstance(kv_heads, (int, np.integer)):
        n_kv = int(kv_heads)
        if n_kv <= 0 or n_heads % n_kv:
            raise ValueError(f"kv_heads {n_kv} does not divide the {n_heads} query heads")
        out = [h // (n_heads // n_kv) for h in range(n_heads)]
    else:
        out = [int(x) for x in kv_heads]
        if len(out) != n_heads:
            raise ValueError(f"kv_heads has {len(out)} entries for {n_heads} query heads")
    return None if len(set(out)) == n_heads else out
