"""Strongest links: for each query token, the key token(s) it attends to most.

Source: ``strongest_previous_token`` in 000_1c89b6c8c2a32040.txt ("Token-to-token
relationships"). For each query row of one attention matrix (a layer's head mean, or one
head): future keys never count (key_pos > query_pos), the query itself is excluded when
``exclude_self``, positions in ``ignore`` are never chosen (e.g. the first-token sink at 0);
a query left with no eligible key is skipped, not given a fake link; otherwise the key with
the largest weight is its link (ties: the lowest key_pos, as ``numpy.argmax``). ``top_k``
extends this to the k largest eligible weights, in descending order (ties by lower key_pos).

Beyond the document: encoders (bidirectional attention) may set ``direction="any"`` to let
keys after the query count too; ``"earlier"`` is the document's rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

Direction = Literal["earlier", "any"]


@dataclass(frozen=True)
class Link:
    key_pos: int
    weight: float


@dataclass(frozen=True)
class QueryLinks:
    """One query's links, as two parallel lists (1..top_k entries, weight descending):
    ``keys`` (key positions, ``int``) and ``weights`` (``float``). :attr:`links` makes the
    :class:`Link` objects on demand; the lists hold only atomic values, which the cyclic
    garbage collector does not track (a million :class:`Link` objects, one /v1/links body of
    2 x 1,000 tokens with ``top_k`` 4,096, set off full collections that held the GIL for
    0.1-0.3 s each, and so the event loop)."""

    query_pos: int
    keys: list[int]
    weights: list[float]

    @property
    def links(self) -> tuple[Link, ...]:
        return tuple(map(Link, self.keys, self.weights))


def eligible_keys(
    n: int,
    exclude_self: bool = True,
    ignore: Sequence[int] = (),
    direction: Direction = "earlier",
) -> torch.Tensor:
    """Boolean ``[query_pos, key_pos]``: True where a key may be a query's link.

    ``"earlier"``: key_pos <= query_pos (future keys never count); ``"any"``: every key.
    ``exclude_self`` removes the diagonal; every position in ``ignore`` is removed as a key.

    Raises:
        ValueError: an ``ignore`` position outside ``[0, n)``.
    """
    ok = torch.ones(n, n, dtype=torch.bool)
    if direction == "earlier":
        ok = ok.tril()
    elif direction != "any":
        raise ValueError(f"direction must be 'earlier' or 'any'; got {direction!r}")
    if exclude_self:
        ok.fill_diagonal_(False)
    for p in ignore:
        if not 0 <= p < n:
            raise ValueError(f"ignore position {p} outside [0, {n})")
        ok[:, p] = False
    return ok


def strongest_links(
    weights: torch.Tensor,  # [query_pos, key_pos]
    top_k: int = 1,
    exclude_self: bool = True,
    ignore: Sequence[int] = (),
    direction: Direction = "earlier",
) -> list[QueryLinks]:
    """The strongest eligible key(s) of every query (000_1c89b6c8c2a32040.txt,
    ``strongest_previous_token``, generalised to top-k).

    Args:
        weights: one attention matrix, float, ``[query_pos, key_pos]`` (a head, or a layer's
            head mean), values in [0, 1].
        top_k: links per query (>= 1); a query with fewer eligible keys gets all of them.
        exclude_self, ignore, direction: see :func:`eligible_keys`.

    Returns:
        One :class:`QueryLinks` per query that has at least one eligible key, in query order
        (its ``keys`` and ``weights`` lists; ``links`` as :class:`Link` objects);
        queries with none (e.g. position 0 with ``exclude_self``; everything ignored) are
        absent. Weights are the attention weights (fraction of the query's attention, [0, 1]),
        as Python floats of the input dtype's values.

    Raises:
        ValueError: ``weights`` not square, ``top_k < 1``, or an ``ignore`` position out of range.
    """
    if weights.dim() != 2 or weights.shape[0] != weights.shape[1]:
        raise ValueError(f"weights must be [query_pos, key_pos]; got {tuple(weights.shape)}")
    if top_k < 1:
        raise ValueError("top_k must be >= 1")
    n = weights.shape[0]
    ok = eligible_keys(n, exclude_self, ignore, direction)
    # One stable sort of every row at once (vectorised; a per-row loop took seconds for
    # T = 256 x top_k 4096 x 32 texts): eligible keys by weight descending, ties in key order
    # (lower key_pos first, as numpy.argmax); ineligible keys rank -inf, after every eligible
    # one (attention weights are finite, >= 0), and are cut by the row's eligible count.
    k = min(top_k, n)
    w = weights.detach().to("cpu")
    rank = torch.where(ok, w.to(torch.float64), torch.tensor(float("-inf"), dtype=torch.float64))
    order = torch.sort(rank, dim=-1, descending=True, stable=True).indices
    counts = ok.sum(-1).clamp(max=k).tolist()
    top = order[:, :k]
    keys, vals = top.numpy(), w.gather(-1, top).to(torch.float64).numpy()  # exact widening
    # Python lists row by row: one tolist() of a [1000, 1000] table is a single C call that
    # holds the GIL (and so the event loop) for 50-150 ms; a row's is under 0.1 ms
    return [QueryLinks(q, keys[q, :c].tolist(), vals[q, :c].tolist())
            for q, c in enumerate(counts) if c]


def skipped_queries(n: int, links: Sequence[QueryLinks]) -> list[int]:
    """Query positions in ``[0, n)`` that got no link."""
    have = {ql.query_pos for ql in links}
    return [q for q in range(n) if q not in have]
