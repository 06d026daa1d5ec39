"""Value-weighted attention norms: what each key position actually contributes to a query.

Source: Kobayashi, Kuribayashi, Yokoi and Inui 2020, "Attention is Not Only a Weight:
Analyzing Transformers with Vector Norms" (EMNLP), eq. 5-7; S004 (004_e7341cee07d297e4.txt):
"attention weights the values (V), not the input; a position can get high attention but
contribute little if its V vector is small".

One layer's multi-head attention output at query ``i`` decomposes exactly into one vector per
(head, key)::

    y_i = sum_h sum_j alpha^h_ij f_h(x_j) + b_O,     f_h(x) = (x W_V^h + b_V^h) W_O^h

with ``x_j`` the attention input (the LayerNorm output entering attention) at key ``j``,
``W_V^h`` / ``b_V^h`` head ``h``'s value projection, ``W_O^h`` the ``d_head`` rows of the output
projection that read head ``h`` and ``b_O`` the output projection's bias. The analyses:

* per head: ``||alpha^h_ij f_h(x_j)||`` ``[head, query_pos, key_pos]`` (= ``alpha^h_ij
  ||f_h(x_j)||``, since alpha >= 0);
* summed over heads: ``||sum_h alpha^h_ij f_h(x_j)||`` ``[query_pos, key_pos]`` (the paper's
  "||sum alpha f(x)||", the whole layer's attention contribution of key j to query i);
* per key: ``||f_h(x_j)||`` ``[head, key_pos]`` (the transformed value vector's norm).

Units: Euclidean norms in the residual stream's units (the same units as hidden states), >= 0.

Biases (``value_bias`` / ``output_bias``), the paper's choice as the defaults:

* ``value_bias="include"`` (default, the paper's f): ``b_V^h`` is part of every key's
  ``f_h(x_j)``. Every key carries the same ``b_V^h W_O^h`` term; ``"exclude"`` gives
  ``f_h(x) = x W_V^h W_O^h`` (then ``sum_hj alpha f`` misses ``sum_h b_V^h W_O^h``).
* ``output_bias="exclude"`` (default, the paper's decomposition): ``b_O`` is added once to the
  layer's output and belongs to no key, so it is in no contribution; ``sum_h sum_j alpha^h_ij
  f_h(x_j) = y_i - b_O``. ``"distribute"`` shares it in proportion to weight: head h's key j
  carries ``alpha^h_ij (f_h(x_j) + b_O / H)`` (H = the model's head count), so the
  contributions of all heads and keys then sum to ``y_i`` itself.

Inputs are the recorded forward's ``v`` (``x W_V + b_V`` as the model computed it) and the
adapter's output projection, both in the ``y = x @ W + b`` layout of
``service.runtime.adapters.AttentionParams``. Pure functions: torch in, torch out.

Grouped-query attention (Llama, Mistral, Qwen2, Gemma with ``n_kv_heads < n_heads``): the
recorded ``v`` is on the KEY/VALUE heads ``[kv_head, key_pos, d_head]`` and ``b_V``
``[n_kv_heads * d_head]``; query head ``h`` weights the values of key/value head
``g = h // (n_heads // n_kv_heads)`` (Hugging Face's ``repeat_kv``), so ``f_h(x) = (x W_V^g +
b_V^g) W_O^h``: the value vector is shared by the query heads of a group, the output rows
``W_O^h`` are each head's own. Every function here takes ``v`` either way (:func:`per_query_head`
expands it when ``W_o`` has more heads than ``v``); the decomposition ``sum_h sum_j alpha f =
y - b_O`` still holds exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

ValueBias = Literal["include", "exclude"]
OutputBias = Literal["exclude", "distribute"]

#: Elements of one query chunk's float64 work array in :func:`summed_norms` (32 MiB: bounds
#: the memory at long inputs; T = 128 with 12 heads is one chunk).
CHUNK_ELEMENTS = 1 << 22


@dataclass
class LayerNorms:
    """One layer's contribution norms (float32). ``head`` / ``summed`` are None when not asked."""

    head: torch.Tensor | None  # [head, query_pos, key_pos], ||alpha^h_ij f_h(x_j)||
    summed: torch.Tensor | None  # [query_pos, key_pos], ||sum_h alpha^h_ij f_h(x_j)||
    value: torch.Tensor  # [head, key_pos], ||f_h(x_j)||


def per_query_head(
    v: torch.Tensor,  # [kv_head, key_pos, d_head] or [head, key_pos, d_head]
    W_o: torch.Tensor,  # [n_heads * d_head, d_model]
    b_v: torch.Tensor | None = None,  # [n_kv_heads * d_head] or [n_heads * d_head]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(v, b_v)`` per QUERY head: under grouped-query attention (``W_o`` reads more heads
    than ``v`` has) key/value head ``g`` is repeated for query heads ``g * G .. g * G + G - 1``
    with ``G = n_heads / n_kv_heads`` (Hugging Face's ``repeat_kv``: query head h reads
    ``h // G``); unchanged otherwise.

    Raises:
        ValueError: ``v`` not 3-D, or ``W_o``'s rows not a multiple of ``v``'s heads x d_head.
    """
    if v.dim() != 3:
        raise ValueError(f"v must be [head, key_pos, d_head]; got {tuple(v.shape)}")
    KV, _, dh = v.shape
    rows = W_o.shape[0] if W_o.dim() == 2 else -1
    if rows == KV * dh:
        return v, b_v
    if rows <= 0 or rows % (KV * dh):
        raise ValueError(f"W_o must be [n_heads * {dh}, d_model] with n_heads a multiple of "
                         f"v's {KV} heads; got {tuple(W_o.shape)}")
    G = rows // (KV * dh)
    v = v.repeat_interleave(G, dim=0)
    if b_v is not None:
        b_v = b_v.reshape(KV, dh).repeat_interleave(G, dim=0).reshape(-1)
    return v, b_v


def transformed_values(
    v: torch.Tensor,  # [head, key_pos, d_head]
    W_o: torch.Tensor,  # [n_heads * d_head, d_model]
    b_v: torch.Tensor | None = None,  # [n_heads * d_head]
    value_bias: ValueBias = "include",
    heads: Sequence[int] | None = None,
) -> torch.Tensor:
    """``f_h(x_j) = (x_j W_V^h + b_V^h) W_O^h`` for every head and key: ``[head, key_pos,
    d_model]``, float32 (computed from float32 copies whatever the model dtype).

    Args:
        v: the recorded value vectors of ONE layer, all of the model's heads, ``x W_V + b_V``.
        W_o: the output projection in the ``y = x @ W`` layout (rows ``h*d_head:(h+1)*d_head``
            read head h).
        b_v: the value bias (needed for ``value_bias="exclude"``, which subtracts it).
        value_bias: 'include' (the paper) or 'exclude'.
        heads: heads to compute (in this order); None = all.

    Raises:
        ValueError: shapes that do not fit, an unknown ``value_bias``, or 'exclude' without b_v.
    """
    v, b_v = per_query_head(v, W_o, b_v)  # grouped-query attention: v per query head
    H, T, dh = v.shape
    if W_o.dim() != 2 or W_o.shape[0] != H * dh:
        raise ValueError(f"W_o must be [{H * dh}, d_model]; got {tuple(W_o.shape)}")
    v = v.float()
    if value_bias == "exclude":
        if b_v is None:
            raise ValueError("value_bias 'exclude' needs b_v")
        v = v - b_v.float().to(v.device).reshape(H, 1, dh)
    elif value_bias != "include":
        raise ValueError(f"value_bias must be 'include' or 'exclude'; got {value_bias!r}")
    W = W_o.float().to(v.device).reshape(H, dh, -1)  # the weights may be on the model's device
    if heads is not None:
        idx = torch.tensor(list(heads), dtype=torch.long)
        v, W = v.index_select(0, idx), W.index_select(0, idx)
    return torch.bmm(v, W)  # [head, key_pos, d_model]


def value_norms(
    v: torch.Tensor,  # [head, key_pos, d_head]
    W_o: torch.Tensor,  # [n_heads * d_head, d_model]
    b_v: torch.Tensor | None = None,
    value_bias: ValueBias = "include",
    heads: Sequence[int] | None = None,
    extra: torch.Tensor | None = None,  # [d_model], added to every f_h (e.g. b_O / H)
    gram: torch.Tensor | None = None,  # [n_heads, d_head, d_head] float64: value_gram(W_o)
) -> torch.Tensor:
    """``||f_h(x_j) [+ extra]||`` ``[head, key_pos]`` (float32) without building f: with
    ``u = v_j^h`` and ``W = W_O^h``, ``||u W + e||^2 = u (W W^T) u^T + 2 u (W e) + ||e||^2``
    (float64). Cost ``H*d_head^2*d_model + H*T*d_head^2`` instead of :func:`transformed_values`'
    ``H*T*d_head*d_model``: what /v1/heads' norm scores need. Same arguments and errors as
    :func:`transformed_values`; ``gram``: :func:`value_gram` of ``W_o`` computed before (it
    depends on the weights only, so callers may keep it).

    Raises:
        ValueError: as :func:`transformed_values`, or ``gram`` not ``[n_heads, d_head, d_head]``.
    """
    v, b_v = per_query_head(v, W_o, b_v)  # grouped-query attention: v per query head
    H, T, dh = v.shape
    if W_o.dim() != 2 or W_o.shape[0] != H * dh:
        raise ValueError(f"W_o must be [{H * dh}, d_model]; got {tuple(W_o.shape)}")
    if gram is not None and tuple(gram.shape) != (H, dh, dh):
        raise ValueError(f"gram must be [{H}, {dh}, {dh}]; got {tuple(gram.shape)}")
    u = v.double()
    if value_bias == "exclude":
        if b_v is None:
            raise ValueError("value_bias 'exclude' needs b_v")
        u = u - b_v.double().to(u.device).reshape(H, 1, dh)
    elif value_bias != "include":
        raise ValueError(f"value_bias must be 'include' or 'exclude'; got {value_bias!r}")
    # the weights may live on the model's device, the recorded v on the CPU: work on v's
    M = (value_gram(W_o, H) if gram is None else gram.double()).to(u.device)  # [head, dh, dh]
    idx = None if heads is None else torch.tensor(list(heads), dtype=torch.long)
    if idx is not None:
        u, M = u.index_select(0, idx), M.index_select(0, idx)
    sq = (torch.bmm(u, M) * u).sum(-1)  # [head, key_pos]
    if extra is not None:
        W = W_o.double().to(u.device).reshape(H, dh, -1)
        if idx is not None:
            W = W.index_select(0, idx)
        e = extra.double().to(u.device)
        sq = sq + 2.0 * torch.einsum("hkd,hd->hk", u, W @ e) + e.dot(e)
    return sq.clamp_(min=0).sqrt_().float()


def value_gram(W_o: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``W_O^h (W_O^h)^T`` for every head: ``[head, d_head, d_head]`` float64, from the output
    projection ``[n_heads * d_head, d_model]`` (:func:`value_norms`' quadratic form)."""
    W = W_o.double().reshape(n_heads, W_o.shape[0] // n_heads, -1)
    return torch.bmm(W, W.transpose(1, 2))


def contribution_vectors(
    pattern: torch.Tensor,  # [head, query_pos, key_pos]
    f: torch.Tensor,  # [head, key_pos, d_model]
    summed: bool = True,
) -> torch.Tensor:
    """The vectors themselves: ``alpha^h_ij f_h(x_j)`` ``[head, query_pos, key_pos, d_model]``,
    or summed over heads ``[query_pos, key_pos, d_model]`` (float32). Memory ``Q*K*d_model``
    (times H unless summed): for short inputs and checks; the norms never build them."""
    a = pattern.float()
    if summed:
        return torch.einsum("hqk,hkd->qkd", a, f.float())
    return a.unsqueeze(-1) * f.float().unsqueeze(1)


def summed_norms(
    pattern: torch.Tensor,  # [head, query_pos, key_pos]
    f: torch.Tensor,  # [head, key_pos, d_model]
    extra: torch.Tensor | None = None,  # [d_model]: a vector every (head, key) carries / H
    n_heads_total: int | None = None,
) -> torch.Tensor:
    """``||sum_h alpha^h_ij (f_h(x_j) [+ extra / H])||`` ``[query_pos, key_pos]``, float32.

    Through each key's Gram matrix ``G_j[h, g] = <f_h(x_j), f_g(x_j)>`` (float64): ``||sum_h
    a_h f_h||^2 = sum_{h,g} a_h a_g G_j[h, g]``, so no ``[query, key, d_model]`` tensor is
    built (cost ``T*H^2*d_model + T^2*H^2``, not ``T^2*H*d_model``). ``extra`` (the
    output-projection bias when distributed) joins as one more vector, with coefficient
    ``sum_h alpha^h_ij / n_heads_total``. Squared norms below 0 by rounding are clamped to 0.
    """
    H, Q, K = pattern.shape
    vecs = f.double()  # [H, K, D]
    coef = pattern.double()
    if extra is not None:
        nh = n_heads_total or H
        vecs = torch.cat([vecs, extra.double().reshape(1, 1, -1).expand(1, K, -1)], 0)
        coef = torch.cat([coef, coef.sum(0, keepdim=True) / nh], 0)
    n = vecs.shape[0]
    gram = torch.bmm(vecs.transpose(0, 1), vecs.permute(1, 2, 0))  # [key_pos, n, n]
    cols = coef.permute(2, 1, 0).contiguous()  # [key_pos, query_pos, n]: each key's coefficients
    out = torch.empty(K, Q, dtype=torch.float64)
    rows = max(1, CHUNK_ELEMENTS // max(1, K * n))
    for q0 in range(0, Q, rows):  # query chunks: the work array is [key_pos, rows, n]
        c = cols[:, q0 : q0 + rows]
        out[:, q0 : q0 + rows] = (torch.bmm(c, gram) * c).sum(-1)  # c G c^T per (key, query)
    out = out.t()
    return out.clamp_(min=0).sqrt_().float()


def layer_norms(
    pattern: torch.Tensor,  # [head, query_pos, key_pos], all of the model's heads
    v: torch.Tensor,  # [head | kv_head, key_pos, d_head], all heads
    W_o: torch.Tensor,  # [n_heads * d_head, d_model]
    b_v: torch.Tensor | None = None,
    b_o: torch.Tensor | None = None,
    value_bias: ValueBias = "include",
    output_bias: OutputBias = "exclude",
    heads: Sequence[int] | None = None,
    per_head: bool = True,
    summed: bool = True,
) -> LayerNorms:
    """Kobayashi et al. 2020's norms of one layer (see the module docstring for the formulas).

    Args:
        pattern: post-softmax attention of one layer, every head (rows sum to 1).
        v, W_o, b_v: see :func:`transformed_values`.
        b_o: output-projection bias ``[d_model]`` (needed for ``output_bias="distribute"``).
        value_bias: 'include' (default, the paper) or 'exclude' b_V from f.
        output_bias: 'exclude' (default, the paper: b_O is in no key's contribution) or
            'distribute' (each head's key j carries ``alpha^h_ij b_O / H``).
        heads: heads to analyse (in this order); None = all. ``summed`` is over these heads.
        per_head, summed: which matrices to compute.

    Returns:
        :class:`LayerNorms`: ``head`` ``[head, query_pos, key_pos]``, ``summed`` ``[query_pos,
        key_pos]``, ``value`` = ``||f_h(x_j)||`` ``[head, key_pos]`` (never includes b_O),
        all float32, >= 0.

    Raises:
        ValueError: shapes that do not fit, unknown bias options, a missing bias tensor.
    """
    v, b_v = per_query_head(v, W_o, b_v)  # grouped-query attention: v per query head
    if pattern.dim() != 3 or pattern.shape[0] != v.shape[0] or pattern.shape[-1] != v.shape[1]:
        raise ValueError(f"pattern {tuple(pattern.shape)} does not fit v {tuple(v.shape)}")
    if output_bias not in ("exclude", "distribute"):
        raise ValueError(f"output_bias must be 'exclude' or 'distribute'; got {output_bias!r}")
    if output_bias == "distribute" and b_o is None:
        raise ValueError("output_bias 'distribute' needs b_o")
    H_all = v.shape[0]
    a = pattern.float()
    if heads is not None:
        a = a.index_select(0, torch.tensor(list(heads), dtype=torch.long))
    if b_o is not None:  # the weights may be on the model's device, the recording on the CPU
        b_o = b_o.to(v.device)
    share = None if output_bias == "exclude" else b_o.float() / H_all  # each head's b_O part
    if not summed:  # norms only: never build f (value_norms' quadratic form)
        value = value_norms(v, W_o, b_v, value_bias, heads)
        vn = value if share is None else value_norms(v, W_o, b_v, value_bias, heads, share)
        head = a * vn.unsqueeze(1) if per_head else None
        return LayerNorms(head, None, value)
    f = transformed_values(v, W_o, b_v, value_bias, heads)  # [head, key_pos, d_model]
    value = f.norm(dim=-1)  # [head, key_pos]
    head = None
    if per_head:
        vn = value if share is None else (f + share).norm(dim=-1)
        head = a * vn.unsqueeze(1)  # ||alpha f|| = alpha ||f|| (alpha >= 0)
    total = summed_norms(a, f, b_o if output_bias == "distribute" else None, H_all)
    return LayerNorms(head, total, value)


#: How far below its weight share the sink's norm share must be to count as no-op attention.
NOOP_TOLERANCE = 1e-6


def noop_scores(
    pattern: torch.Tensor,  # [head, query_pos, key_pos]
    value_norms: torch.Tensor,  # [head, key_pos], ||f_h(x_j)|| (value_norms / LayerNorms.value)
    sink: int = 0,
) -> dict[str, torch.Tensor]:
    """Per head, how much attention sits on the sink while contributing little (a "no-op"
    attention; Kobayashi et al. 2020, section 4: high weight, small norm). For each query row
    q, the sink's weight share is ``alpha[q, sink]`` and its norm share ``n[q, sink] / sum_k
    n[q, k]`` with ``n[q, k] = alpha[q, k] ||f_h(x_k)||`` the head's contribution norms:

    * ``noop``: mean over query rows of ``alpha[q, sink]`` counted only where the norm share is
      below the weight share (the weight on the sink that is discounted by its small value
      vector), a fraction of the row's attention mass, in [0, 1];
    * ``sink_norm_share``: mean over query rows of the sink's norm share, in [0, 1] (compare
      with /v1/heads' ``sink``, the mean weight share).

    "Below" means by more than :data:`NOOP_TOLERANCE` (a share equal to the weight up to
    float32 rounding is not discounted). Rows whose norms are all 0 have norm share 0. The
    row sums are one matrix-vector product (no ``[head, query, key]`` norm tensor is built);
    float32 arithmetic. Returns float64 ``[head]`` tensors.
    """
    a = pattern.float()
    vn = value_norms.float()
    w0 = a[:, :, sink]  # [head, query_pos]
    n0 = w0 * vn[:, sink : sink + 1]
    tot = torch.bmm(a, vn.unsqueeze(-1)).squeeze(-1)  # sum_k alpha[q, k] ||f(x_k)||
    share = torch.where(tot > 0, n0 / torch.where(tot > 0, tot, 1.0), 0.0)
    noop = torch.where(share < w0 - NOOP_TOLERANCE, w0, 0.0)
    return {"noop": noop.double().mean(-1), "sink_norm_share": share.double().mean(-1)}
