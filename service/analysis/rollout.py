"""Attention rollout and attention flow: how attention combines across layers.

Source: Abnar and Zuidema 2020, "Quantifying Attention Flow in Transformers" (ACL), section 3,
and the authors' code (samiraabnar/attention_flow: ``compute_joint_attention``,
``get_adjmat``, ``compute_flows``); the head-fusion and discard options follow the widely used
implementation for vision transformers (jacobgil/vit-explain, ``rollout``); S004 (several
layers and heads are combined: a single head's pattern does not say what the network does).

Per layer ``l`` (1-based in the formulas, 0-based in arrays), from the post-softmax pattern
``A_l^h`` ``[head, query_pos, key_pos]``:

1. head fusion ``F_l = mean_h A_l^h`` (the paper), or ``max_h`` / ``min_h`` (elementwise);
2. ``sink="drop"``: ``F_l[q, 0] = 0`` for every query ``q >= 1`` (row 0 keeps its own weight:
   in a causal model it sees nothing else), to see the flow among the other tokens;
3. ``discard`` (fraction ``d`` in [0, 1)): the ``floor(d * n)`` smallest of the ``n`` entries of
   ``F_l`` that are still candidates (visible under the causal mask, not removed in step 2)
   are set to 0 (ties: the lower flat index ``q * T + k`` goes first); a layer with a sliding
   key window (Mistral, Gemma 2) has as candidates only the keys inside it,
   ``q - window < k <= q`` (its pattern is 0 outside; rollout still reaches earlier tokens
   through the layers below, since ``R_l`` is a product);
4. residual: ``Â_l = rownorm((1 - w) F_l + w I)`` with residual weight ``w`` (default 0.5: for
   mean fusion, no discard and the sink kept, ``Â_l = ½ A_l + ½ I``, the paper's and
   ``compute_joint_attention``'s matrix). ``rownorm`` divides each row by its sum (max/min
   fusion and discarding leave rows that do not sum to 1, as vit-explain does). A row left
   with no weight at all (only with ``w = 0``) becomes the identity row (the token keeps
   itself) so every row still sums to 1;
5. rollout: ``R_1 = Â_1``, ``R_l = Â_l R_{l-1}`` (``[query_pos, key_pos]``, rows = the token at
   layer l's output, columns = the input tokens); every row of every ``R_l`` sums to 1 and in
   a causal model no row puts weight on a later input token.

Attention flow (:func:`attention_flow`): the layered graph has a node per (layer output
``l = 0..L``, position), with ``l = 0`` the input tokens, and an edge from ``(l, q)`` to
``(l - 1, k)`` of capacity ``Â_l[q, k]`` (edges of capacity 0 are left out); the flow of query
``q`` at layer ``l`` to input ``k`` is networkx's maximum flow value from ``(l, q)`` to ``(0, k)``,
and each query's row is divided by its sum (as ``compute_flows`` does), so rows sum to 1.
Its cost grows as ``T^4 * L`` (one max-flow per (query, input) pair, each over ``L * T^2``
edges): inputs longer than :data:`FLOW_MAX_TOKENS` are refused.

All arithmetic in float64; results float64 (the caller casts for the wire).
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

Fusion = Literal["mean", "max", "min"]
Sink = Literal["keep", "drop"]

#: Longest input (tokens) attention flow is computed for. Measured (networkx 3.6, preflow-push,
#: one residual network reused per layer, one core): 12 layers of 16 tokens take ~1 s for the
#: last layer, 24 tokens ~14 s; bench/norms_rollout.py prints the figures for the model served.
FLOW_MAX_TOKENS = 16


def fuse_heads(pattern: torch.Tensor, fusion: Fusion = "mean") -> torch.Tensor:
    """``[layer, head, query_pos, key_pos]`` -> ``[layer, query_pos, key_pos]`` (float64): the
    mean, elementwise max or elementwise min over heads.

    Raises:
        ValueError: ``pattern`` not 4-D square, or an unknown ``fusion``.
    """
    if pattern.dim() != 4 or pattern.shape[-1] != pattern.shape[-2]:
        raise ValueError(f"pattern must be [layer, head, T, T]; got {tuple(pattern.shape)}")
    ops = {"mean": lambda p: p.mean(0), "max": lambda p: p.amax(0), "min": lambda p: p.amin(0)}
    if fusion not in ops:
        raise ValueError(f"fusion must be 'mean', 'max' or 'min'; got {fusion!r}")
    L, _, T, _ = pattern.shape
    out = torch.empty(L, T, T, dtype=torch.float64)
    for layer in range(L):  # one layer's float64 copy at a time
        out[layer] = ops[fusion](pattern[layer].double())
    return out


def augmented_matrices(
    pattern: torch.Tensor,  # [layer, head, query_pos, key_pos]
    causal: bool,
    fusion: Fusion = "mean",
    residual: float = 0.5,
    discard: float = 0.0,
    sink: Sink = "keep",
    windows: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """``Â_l`` of every layer, ``[layer, query_pos, key_pos]`` float64, rows sum to 1 (steps
    1-4 of the module docstring).

    Args:
        pattern: post-softmax attention of every layer and head (rows sum to 1).
        causal: whether keys after the query are masked (they are never discard candidates).
        fusion: 'mean' (the paper), 'max' or 'min' over heads.
        residual: weight ``w`` of the identity (the residual connection), in [0, 1].
        discard: fraction of each layer's candidate entries to zero, in [0, 1).
        sink: 'keep' or 'drop' the first token as a key (queries >= 1).
        windows: per layer, a sliding key window (Mistral, Gemma 2) or None: a windowed
            layer's candidates are only the keys ``query_pos - window < key_pos <=
            query_pos`` (its pattern is 0 outside them), so ``discard`` is a fraction of
            what the layer can attend to.

    Raises:
        ValueError: ``residual`` outside [0, 1], ``discard`` outside [0, 1), unknown
            ``fusion`` or ``sink``.
    """
    if not 0.0 <= residual <= 1.0:
        raise ValueError(f"residual must be in [0, 1]; got {residual}")
    if not 0.0 <= discard < 1.0:
        raise ValueError(f"discard must be in [0, 1); got {discard}")
    if sink not in ("keep", "drop"):
        raise ValueError(f"sink must be 'keep' or 'drop'; got {sink!r}")
    F = fuse_heads(pattern, fusion)
    L, T, _ = F.shape
    cand = torch.ones(T, T, dtype=torch.bool)
    if causal:
        cand = cand.tril()
    if sink == "drop" and T > 1:
        F[:, 1:, 0] = 0.0
        cand[1:, 0] = False
    if windows is not None and len(windows) != L:
        raise ValueError(f"windows must give one entry per layer ({L}); got {len(windows)}")
    if discard > 0:
        for layer in range(L):
            w = None if windows is None else windows[layer]
            c = cand if w is None else cand & torch.ones(T, T, dtype=torch.bool).triu(-(w - 1))
            flat_cand = c.reshape(-1).nonzero().squeeze(-1)  # ascending flat indices
            n_drop = int(discard * flat_cand.numel())
            if n_drop:
                vals = F[layer].reshape(-1)[flat_cand]
                order = torch.sort(vals, stable=True).indices  # ties: lower flat index first
                F[layer].reshape(-1)[flat_cand[order[:n_drop]]] = 0.0
    eye = torch.eye(T, dtype=torch.float64)
    aug = (1.0 - residual) * F + residual * eye
    sums = aug.sum(-1, keepdim=True)
    empty = sums.squeeze(-1) <= 0  # [layer, query_pos]
    if bool(empty.any()):
        aug = torch.where(empty.unsqueeze(-1), eye.expand_as(aug), aug)
        sums = aug.sum(-1, keepdim=True)
    return aug / sums


def rollout(aug: torch.Tensor) -> torch.Tensor:
    """Attention rollout ``R_l = Â_l Â_{l-1} ... Â_1`` for every layer: ``[layer, query_pos,
    key_pos]`` float64 (``aug`` from :func:`augmented_matrices`). ``R[l][q, k]``: the share of
    token q's representation after layer l that traces back to input token k; rows sum to 1."""
    out = torch.empty_like(aug, dtype=torch.float64)
    acc = aug[0].double()
    out[0] = acc
    for layer in range(1, aug.shape[0]):
        acc = aug[layer].double() @ acc
        out[layer] = acc
    return out


def attention_flow(
    aug: torch.Tensor,  # [layer, query_pos, key_pos]
    layers: Sequence[int] | None = None,
    max_tokens: int = FLOW_MAX_TOKENS,
) -> torch.Tensor:
    """Attention flow (Abnar and Zuidema 2020) at the output of each layer in ``layers``
    (0-based; None = the last layer only): ``[len(layers), query_pos, key_pos]`` float64, row
    ``q`` = the maximum flow from node ``(l + 1, q)`` to each input node ``(0, k)`` over the
    layered graph with capacities ``Â`` (module docstring), divided by the row's sum.

    Uses networkx's ``maximum_flow_value`` (preflow-push, the residual network built once per
    layer, or per query when the capacities are lower-triangular (causal models: only positions
    <= q are reachable from q), and reused for each input, which preflow-push resets). Pairs
    with no path of positive capacity (``R_l[q, k] = 0``: later tokens of a causal model,
    discarded edges) have flow 0 and are not run.

    Raises:
        ValueError: more than ``max_tokens`` positions, or a layer index out of range.
    """
    import networkx as nx
    from networkx.algorithms.flow import build_residual_network, preflow_push

    L, T, _ = aug.shape
    if T > max_tokens:
        raise ValueError(f"attention flow is limited to {max_tokens} tokens; got {T}")
    layers = [L - 1] if layers is None else list(layers)
    for layer in layers:
        if not 0 <= layer < L:
            raise ValueError(f"layer {layer} out of range 0..{L - 1}")
    caps = aug.double().tolist()
    # a path of positive capacity from (l+1, q) to (0, k) exists iff rollout R_l[q, k] > 0
    # (products of non-negative entries): the other pairs' flow is 0 without a max-flow run
    reach = rollout(aug) > 0
    out = torch.zeros(len(layers), T, T, dtype=torch.float64)
    # lower-triangular capacities (causal models): from (l, q) only positions <= q are
    # reachable, so query q's flows run on the graph of positions 0..q (exact; 1.3x faster at
    # 12 layers x 16 tokens)
    lower = not bool(torch.triu(aug, 1).any())

    def graph(top: int, n: int):
        G = nx.DiGraph()
        G.add_nodes_from(lvl * T + p for lvl in range(top + 2) for p in range(n))
        for lvl in range(1, top + 2):  # node lvl * T + q: position q at layer lvl's output
            m = caps[lvl - 1]
            G.add_edges_from(
                (lvl * T + q, (lvl - 1) * T + k, {"capacity": m[q][k]})
                for q in range(n) for k in range(n) if m[q][k] > 0
            )
        return G, build_residual_network(G, "capacity")

    G = R = None

    def drop() -> None:
        # networkx graphs sit in reference cycles (their views): cleared here, their edges
        # are freed now, not at the next full collection (16 texts x 12 layers piled up
        # ~10 MB of dead graphs; service/serving/rollout.py's estimate counts one graph)
        for g in (G, R):
            if g is not None:
                g.clear()

    for i, top in enumerate(layers):
        src0 = (top + 1) * T
        if not lower:
            drop()
            G, R = graph(top, T)
        for q in range(T):
            if lower:
                drop()
                G, R = graph(top, q + 1)
            row = [nx.maximum_flow_value(G, src0 + q, k, capacity="capacity",
                                         flow_func=preflow_push, residual=R)
                   if reach[top, q, k] else 0.0 for k in range(T)]
            out[i, q] = torch.tensor(row, dtype=torch.float64)
        sums = out[i].sum(-1, keepdim=True)
        out[i] = out[i] / torch.where(sums > 0, sums, torch.ones_like(sums))
    drop()
    return out
