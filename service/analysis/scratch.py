"""Scratch attention: the textbook scaled dot-product attention on raw inputs.

Source: 000_1c89b6c8c2a32040.txt ("Implementing attention": ``attention(Q, K, V, mask)`` in
five numbered steps; "Using query and key projections": ``project_embeddings``; "Attention
Variants": self, causal, cross, multi-head split) and 001_92e9928af52718c3.txt ("A Simple
Attention Example": the same without the 1/sqrt(d_k) scaling on a toy embedding).
Vaswani et al. 2017, eq. 1: Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InvalidRequest


def attention(
    Q: torch.Tensor,  # [..., query_pos, d_k]
    K: torch.Tensor,  # [..., key_pos, d_k]
    V: torch.Tensor,  # [..., key_pos, d_v]
    mask: torch.Tensor | None = None,  # [query_pos, key_pos], 0/False = hidden
    scale: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, as the source's ``attention()`` (000_1c89b6c8c2a32040.txt).

    Returns ``(output [..., query_pos, d_v], weights [..., query_pos, key_pos], scores
    [..., query_pos, key_pos])``; ``weights`` are post-softmax (rows sum to 1), ``scores`` the
    pre-softmax values with masked entries ``-inf``. Same dtype as the inputs. A row whose keys
    are all masked would be NaN; callers must not build such masks.
    """
    # 1. Compare every query with every key using dot(Q, K)
    scores = Q @ K.transpose(-1, -2)  # [..., query_pos, key_pos]

    # 2. Scale the scores by K's dimension size so they do not get too large (optional:
    #    001_92e9928af52718c3.txt's first example does not scale)
    if scale:
        scores = scores / math.sqrt(K.shape[-1])

    # 3. Optionally mask scores to the right (future keys -> -inf)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, float("-inf"))

    # 4. Normalize scores into attention weights via softmax over the keys
    weights = F.softmax(scores, dim=-1)

    # 5. Compute outputs as weighted sums of values using dot(weights, V)
    output = weights @ V  # [..., query_pos, d_v]
    return output, weights, scores


def causal_mask(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``torch.tril(torch.ones(n, n))`` as the source builds it: 1 = visible, 0 = future."""
    return torch.tril(torch.ones(n, n, dtype=dtype))


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``[pos, d] -> [head, pos, d // n_heads]`` (the source's ``view(...).transpose(0, 1)``)."""
    n_pos, d = x.shape
    return x.reshape(n_pos, n_heads, d // n_heads).transpose(0, 1)


def scratch_attention(
    q: torch.Tensor,  # [query_pos, d_k_total]
    k: torch.Tensor,  # [key_pos, d_k_total]
    v: torch.Tensor,  # [key_pos, d_v_total]
    variant: str = "self",
    n_heads: int = 1,
    scale: bool = True,
    names: tuple[str, str, str] = ("q", "k", "v"),
    *,
    max_weights: int | None,
) -> dict:
    """Run :func:`attention` on raw matrices, with a variant and an optional multi-head split.

    ``variant`` 'causal' applies the tril mask (needs query_pos == key_pos); 'self' and
    'cross' apply none. With ``n_heads`` > 1 the widths of q/k and of v are split into equal
    slices, attention runs per head and the outputs are concatenated along the last axis
    (source: "Multi-head attention" in 000_1c89b6c8c2a32040.txt). ``max_weights`` is the
    caller's limit (the API's is ``schemas.scratch.MAX_WEIGHTS``; None = no limit): keyword-only
    and required, so no caller loses the limit by forgetting it.

    Returns a dict: ``weights`` and ``scores`` ``[head, query_pos, key_pos]``, ``output``
    ``[query_pos, d_v_total]`` (same dtype as the inputs), ``d_k`` and ``d_v`` (per head),
    ``scaling`` (1/sqrt(d_k) or 1.0).

    Raises:
        InvalidRequest: incompatible shapes (names the field and both sizes), a width not
            divisible by ``n_heads``, a causal variant with query_pos != key_pos, weights of
            more than ``max_weights`` numbers (n_heads x query_pos x key_pos; param n_heads).
    """
    nq, nk = names[0], names[1]
    if q.ndim != 2 or k.ndim != 2 or v.ndim != 2:
        raise InvalidRequest("q, k and v must be matrices [pos, d]", nq)
    n_weights = n_heads * q.shape[0] * k.shape[0]
    if max_weights is not None and n_weights > max_weights:
        raise InvalidRequest(
            f"the weights would hold n_heads {n_heads} x {q.shape[0]} queries x {k.shape[0]} "
            f"keys = {n_weights} numbers (and as many scores); the limit is {max_weights}: "
            "lower n_heads or send fewer rows", "n_heads",
        )
    if q.shape[1] != k.shape[1]:
        raise InvalidRequest(
            f"{nq} and {nk} must have the same width d_k: {nq} is {list(q.shape)}, "
            f"{nk} is {list(k.shape)}", nk,
        )
    if k.shape[0] != v.shape[0]:
        raise InvalidRequest(
            f"{nk} and {names[2]} must have the same number of rows (key positions): {nk} is "
            f"{list(k.shape)}, {names[2]} is {list(v.shape)}", names[2],
        )
    for name, width in ((nk, k.shape[1]), (names[2], v.shape[1])):
        if width % n_heads:
            raise InvalidRequest(
                f"n_heads = {n_heads} must divide the width of {name} ({width})", "n_heads"
            )
    mask = None
    if variant == "causal":
        if q.shape[0] != k.shape[0]:
            raise InvalidRequest(
                f"variant 'causal' needs as many queries as keys: {nq} has {q.shape[0]} rows, "
                f"{nk} has {k.shape[0]}", "variant",
            )
        mask = causal_mask(q.shape[0], q.dtype)
    Qh, Kh, Vh = (split_heads(x, n_heads) for x in (q, k, v))  # [head, pos, d/head]
    output, weights, scores = attention(Qh, Kh, Vh, mask=mask, scale=scale)
    d_k = Kh.shape[-1]
    # -inf is the mask's value; anywhere else (a visible key) it is an overflow of q.k
    neg_inf_visible = torch.isneginf(scores) if mask is None else (torch.isneginf(scores) & (mask != 0))
    if not (torch.isfinite(weights).all() and torch.isfinite(output).all()
            and not torch.isnan(scores).any() and not torch.isposinf(scores).any()
            and not neg_inf_visible.any()):
        raise InvalidRequest(
            f"attention overflows {str(q.dtype).replace('torch.', '')}: the inputs are too "
            f"large in magnitude (max |{nq}| = {q.abs().max().item():.3g}, max |{nk}| = "
            f"{k.abs().max().item():.3g}, max |{names[2]}| = {v.abs().max().item():.3g}); "
            "scale them down", nq,
        )
    return {
        "weights": weights,  # [head, query_pos, key_pos]
        "scores": scores,  # [head, query_pos, key_pos]
        "output": torch.cat(list(output), dim=-1),  # [query_pos, n_heads * d_v]
        "d_k": int(d_k),
        "d_v": int(Vh.shape[-1]),
        "scaling": 1.0 / math.sqrt(d_k) if scale else 1.0,
    }


_PCA_CACHE: OrderedDict = OrderedDict()
_PCA_CACHE_SIZE = 8
_PCA_LOCK = threading.Lock()


@dataclass(frozen=True)
class EmbeddingPCA:
    """The exact PCA of an embedding matrix ``[vocab, d_model]``, every component kept
    (``r = min(vocab, d_model)``), float64 on the CPU:

    * ``mean`` ``[d_model]``: the column means (what scikit-learn's ``mean_`` holds);
    * ``components`` ``[r, d_model]``: unit principal axes, largest variance first, each signed
      so that its entry of largest magnitude is positive (scikit-learn's ``svd_flip`` with
      ``u_based_decision=False``, as its 'full' and 'covariance_eigh' solvers sign them);
    * ``explained_variance`` ``[r]``: the variance along each axis, ``S**2 / (vocab - 1)``
      (``explained_variance_``).
    """

    mean: torch.Tensor
    components: torch.Tensor
    explained_variance: torch.Tensor

    def transform(self, x: torch.Tensor, n_components: int) -> torch.Tensor:
        """Whitened projection onto the first ``n_components`` axes, as scikit-learn's
        ``PCA(n_components, whiten=True).transform``: ``(x - mean) @ components[:n].T /
        sqrt(explained_variance[:n])``; ``x`` ``[pos, d_model]`` -> ``[pos, n_components]``,
        float64 (unit variance per component over the vocabulary)."""
        n = int(n_components)
        x = x.to("cpu", torch.float64) - self.mean
        return (x @ self.components[:n].T) / self.explained_variance[:n].sqrt()


def _exact_pca(X: torch.Tensor) -> EmbeddingPCA:
    """:class:`EmbeddingPCA` of ``X`` ``[n, d]`` (a float64 copy: centred in place). Torch ops
    only, each of which gives the GIL back while it computes (scikit-learn's randomized
    solver normalises its power iterations with ``scipy.linalg.lu``, which holds the GIL: on a
    [50257, 768] embedding ~1.2 s of event-loop lag). For ``n >= d`` the eigendecomposition
    of the ``[d, d]`` covariance ``Xc^T Xc / (n - 1)`` (``torch.linalg.eigh``; scikit-learn's
    'covariance_eigh' solver); otherwise the thin SVD of ``Xc`` (its 'full' solver). Both are
    exact: the axes are those of the 'full' solver's SVD up to rounding (eigenvalue gaps
    permitting)."""
    mean = X.mean(0)
    X -= mean
    n, d = X.shape
    if n >= d:
        evals, evecs = torch.linalg.eigh((X.T @ X) / (n - 1))  # ascending
        components = evecs.flip(-1).T.contiguous()  # [d, d], largest variance first
        var = evals.flip(-1).clamp(min=0.0)  # rounding can leave -1e-17 for a null axis
    else:
        _, S, Vt = torch.linalg.svd(X, full_matrices=False)
        components, var = Vt, S * S / max(n - 1, 1)
    # svd_flip(u_based_decision=False): each axis's largest-magnitude entry positive
    pick = components.abs().argmax(-1, keepdim=True)
    components = components * torch.sign(components.gather(-1, pick))
    return EmbeddingPCA(mean, components, var)


def embedding_pca(emb: torch.Tensor, n_components: int) -> EmbeddingPCA:
    """The exact PCA of the embedding matrix ``emb`` ``[vocab, d_model]`` for the source's
    ``project_embeddings`` (fit once, transform many): :class:`EmbeddingPCA`, from which
    ``transform(x, n_components)`` equals scikit-learn's ``PCA(n_components, whiten=True,
    svd_solver='full').fit(emb).transform(x)`` to rounding (the source's own
    ``svd_solver='randomized'`` approximates the same axes; its power iterations held the
    GIL). Deterministic: no seed.

    Pass the model's own matrix (its storage is part of the key; the fit runs in float64 as
    the source does). One decomposition serves every ``n_components``, so it is cached (the
    last 8 matrices, keyed by the matrix's storage, shape, dtype and a checksum; ~5 MB for
    d_model 768) and fits run one at a time, so concurrent requests never fan out into many
    simultaneous fits. The cached object is shared: callers only ``transform``.

    Raises:
        InvalidRequest: ``n_components`` outside 1..min(vocab, d_model) (param ``project``).
    """
    limit = min(emb.shape)
    if not 1 <= n_components <= limit:
        raise InvalidRequest(
            f"project = {n_components}: PCA of the embedding matrix {list(emb.shape)} can have "
            f"at most min(vocab, d_model) = {limit} components", "project",
        )
    emb = emb.detach()
    key = (emb.data_ptr(), tuple(emb.shape), str(emb.dtype),
           float(emb[:: max(1, emb.shape[0] // 64)].double().sum()))
    with _PCA_LOCK:
        pca = _PCA_CACHE.get(key)
        if pca is not None:
            _PCA_CACHE.move_to_end(key)
            return pca
        pca = _exact_pca(emb.to("cpu", torch.float64, copy=True))  # float64, as the source
        _PCA_CACHE[key] = pca
        while len(_PCA_CACHE) > _PCA_CACHE_SIZE:
            _PCA_CACHE.popitem(last=False)
        return pca


def clear_pca_cache() -> None:
    """Forget every cached :func:`embedding_pca` (benchmarks time a fresh fit)."""
    with _PCA_LOCK:
        _PCA_CACHE.clear()


def embedding_qkv(
    emb: torch.Tensor,  # [vocab, d_model]
    key_ids: list[int],
    query_ids: list[int] | None = None,
    variant: str = "self",
    project: int | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V from static token embeddings (float64), as the source's variants build them.

    ``seq_emb = emb[key_ids]``. self/causal: ``Q = K = V = seq_emb``. cross: ``K = V =
    seq_emb``, ``Q = emb[query_ids]``, or, without ``query_ids``, uniform random numbers in
    [0, 1) shaped like K drawn from a ``torch.Generator`` seeded with ``seed`` (the source's
    ``torch.rand_like``). With ``project``: Q and K (never V) are replaced by their
    whitened projection onto the first ``project`` axes of the exact PCA of ``emb``
    (:func:`embedding_pca`; random queries are drawn in the projected width). Returns ``(Q [query_pos, d_k], K [key_pos, d_k], V [key_pos, d_model])``.
    """
    emb = emb.detach()  # the model's own matrix: only the rows used are copied to float64

    def rows(ids: list[int]) -> torch.Tensor:
        return emb[torch.tensor(ids, dtype=torch.long, device=emb.device)].to("cpu", torch.float64)

    seq_emb = rows(key_ids)
    q_emb = None
    if variant == "cross" and query_ids is not None:
        q_emb = rows(query_ids)
    V = seq_emb
    K = seq_emb
    if project is not None:
        pca = embedding_pca(emb, project)
        K = pca.transform(seq_emb, project)
        if q_emb is not None:
            q_emb = pca.transform(q_emb, project)
    if variant == "cross":
        if q_emb is None:
            g = torch.Generator().manual_seed(int(seed))
            Q = torch.rand(K.shape, generator=g, dtype=torch.float64)
        else:
            Q = q_emb
    else:
        Q = K
    return Q, K, V


def as_matrix(rows: list[list[float]]) -> torch.Tensor:
    """JSON rows -> float64 tensor ``[pos, d]``."""
    return torch.tensor(np.asarray(rows, dtype=np.float64))
