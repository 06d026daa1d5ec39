"""Head classification: per-head pattern scores, an induction probe, and a label per head.

Pure functions on tensors (no HTTP, no model). Every score is computed per head from one
text's attention pattern ``[layer, head, query_pos, key_pos]`` (post-softmax, rows sum to 1)
and, for several texts, averaged over texts by the caller (:func:`mean_over_texts`).

Scores (all float, per head; name: formula, range/unit):

- ``previous_token``: TransformerLens ``detect_head(..., "previous_token_head")``,
  ``sum(A * P) / sum(A)`` with P = ones on the sub-diagonal (key = query - 1); [0, 1].
- ``duplicate_token``: same, P[q, k] = 1 where k < q and ``ids[k] == ids[q]``; [0, 1].
- ``induction``: same, P[q, k] = 1 where 1 <= k <= q and ``ids[k-1] == ids[q]`` (k-1 != q):
  the token right after an earlier copy of the query token; [0, 1].
- ``next_token``: same, P = ones on the super-diagonal (key = query + 1); [0, 1]; encoders
  only (NaN/null for causal models, whose queries never see the next token).
- ``self``: mean over query rows of ``A[q, q]``; [0, 1].
- ``sink``: mean over query rows of ``A[q, 0]`` (S004: ``M[:, 0].mean()``); [0, 1].
- ``previous_s004``: S004's previous-token score, ``mean(A[i, i-1] for i in 1..T-1)`` (no
  exclusions); [0, 1]. Compared with S004's 0.5 threshold (``previous_token`` = this times
  (T-1)/T without exclusions, which would flip labels on short texts).
- ``sink_s004``: S004's sink score ``M[:, 0].mean()`` (= ``sink``), compared with S004's 0.6.
- ``entropy``: mean over query rows of ``-sum_k A[q,k] ln A[q,k]`` (0 ln 0 = 0); nats, >= 0.
- ``entropy_normalized``: mean over rows with >= 2 visible keys of ``H_q / ln(n_visible_q)``
  (n_visible_q = q + 1 causal, T encoder; in a layer with a sliding window w (Mistral, Gemma 2)
  min(q + 1, w)); [0, 1], 1 = uniform over the visible keys.
- ``mean_distance``: mean over query rows of ``sum_k A[q,k] |q - k|``; tokens, [0, T-1].
- ``induction_probe``: :func:`induction_probe_score` on repeated random tokens; [0, 1].

The three TransformerLens scores follow ``transformer_lens/head_detector.py``
(``compute_head_attention_similarity_score``), with either of its error measures
(``error_measure``, TransformerLens 4.3's ``detect_head`` option, default ``"mul"``):

- ``"mul"``: ``sum(A * P) / sum(A)``, described next.
- ``"abs"``: ``1 - round(sum_{q,k} |A[q,k] - P[q,k]| / T, 3)`` (TransformerLens:
  ``1 - round((abs_diff.mean() * size).item(), 3)``, its 3-decimal rounding included), with
  ``exclude_bos`` / ``exclude_current_token`` zeroing ``|A - P|`` in column 0 / on the
  diagonal; in (-1, 1], 1 = the pattern exactly, lower = worse (a pattern row with no 1,
  e.g. a token without an earlier copy, costs the row's whole attention mass). As P is 0/1
  and A <= 1, ``sum |A - P| = sum(A) - 2 sum(A * P) + n(P)`` over the kept entries, so it
  comes from the same sums as "mul" plus the number of marked pairs. TransformerLens asserts
  a lower-triangular ``|A - P|`` (causal models); encoders are scored with the same formula
  over the whole matrix.

"mul" is the fraction of the
head's attention mass that falls on the detection pattern. ``exclude_bos`` zeroes column 0 and
``exclude_current_token`` zeroes the diagonal of A *before* both sums, so with an exclusion the
denominator is the remaining mass (a ratio of totals, as TransformerLens computes it, not a
mean of per-row ratios); without exclusions ``sum(A) = T`` and the score is the mean over query
rows of each row's mass on the pattern. A score whose denominator is 0 (everything excluded) is
NaN (null on the wire). A text with no repeated token scores 0 on ``duplicate_token`` and
``induction`` (there is no pattern to put mass on), as in TransformerLens. Seed 004 scores
previous-token heads as the mean of the sub-diagonal over rows 1..T-1; without exclusions
``previous_token`` here is that value times (T-1)/T (row 0 has no previous token and counts 0).

Labels (:func:`classify_all`): every label of ``LABEL_ORDER`` whose score (:data:`LABEL_SCORE`)
exceeds its threshold -- a head can be an induction head AND a sink -- the primary label being
the first of them (else ``"none"``), and the margin of each score to its threshold. The
thresholds are an argument with no defaults here: their values are part of the API contract
and written once, in ``schemas/heads.py`` (``HeadThresholds``), whose values the serving layer
passes (the client's defaults and the server's are the same object). Sources: TransformerLens ``head_detector.py``;
Olsson et al. 2022, "In-context Learning and Induction Heads"; Clark et al. 2019, "What Does
BERT Look At?"; the source documents S004 (004_e7341cee07d297e4.txt) (previous > 0.5, sink > 0.6)
and 003_fd2ce6cc010446bf.txt (identity, local, special-token patterns).
"""

from __future__ import annotations

import itertools
import math
from typing import Mapping, Sequence

import numpy as np
import torch

from ._blas import one_blas_thread
from ..errors import ContextLengthExceeded, InvalidRequest

#: Order in which labels are tried; the first whose score passes its threshold wins.
LABEL_ORDER: tuple[str, ...] = (
    "induction", "previous_token", "duplicate_token", "next_token", "self", "sink", "broad",
)
_LABELS = frozenset(LABEL_ORDER)

#: TransformerLens 4.3 ``detect_head``'s error measures (``ErrorMeasure``), default first
ERROR_MEASURES: tuple[str, ...] = ("mul", "abs")

SCORE_NAMES: tuple[str, ...] = (
    "previous_token", "duplicate_token", "induction", "next_token", "self", "sink",
    "previous_s004", "sink_s004", "entropy", "entropy_normalized", "mean_distance",
    "induction_probe",
)

#: The score each label's threshold is compared with (S004's own formulas for its two
#: thresholds; TransformerLens' for the pattern scores; the probe for induction when it ran).
LABEL_SCORE: dict[str, str] = {
    "induction": "induction_probe",  # else "induction" (the text's), when the probe is off
    "previous_token": "previous_s004",
    "duplicate_token": "duplicate_token",
    "next_token": "next_token",
    "self": "self",
    "sink": "sink_s004",
    "broad": "entropy_normalized",
}


#: Pattern elements per chunk in :func:`head_scores` (a block of query rows of a few heads,
#: at least one row): two float64 buffers of this size (512 KiB each) are reused by every
#: chunk, so the work stays in cache and no fresh pages are faulted in for every text.
CHUNK_ELEMENTS = 1 << 16


def _pair_index(ids: np.ndarray, exclude_bos: bool, exclude_current_token: bool):
    """Flat ``q * T + k`` indices of the ones of each TransformerLens detection pattern, after
    the exclusions (a pair in an excluded column or on the excluded diagonal is dropped, which
    is what zeroing A there before ``sum(A * P)`` does)."""
    T = len(ids)
    q = np.arange(T)
    eq = ids[:, None] == ids[None, :]
    dq, dk = np.nonzero(np.tril(eq, -1))  # duplicate: k < q, same id
    iq, ik = dq, dk + 1  # induction: the duplicate pattern shifted one key right (k <= q)
    pq, pk = q[1:], q[1:] - 1  # previous token
    nq, nk = q[:-1], q[:-1] + 1  # next token (never column 0 nor the diagonal)
    out = {}
    for name, (qq, kk) in (("previous_token", (pq, pk)), ("duplicate_token", (dq, dk)),
                           ("induction", (iq, ik)), ("next_token", (nq, nk))):
        keep = np.ones(len(qq), dtype=bool)
        if exclude_bos:
            keep &= kk != 0
        if exclude_current_token:
            keep &= kk != qq
        out[name] = (qq[keep] * T + kk[keep]).astype(np.intp)
    return out


def _pattern_numpy(pattern: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy where possible) of a CPU float pattern; bfloat16 etc. -> float32."""
    p = pattern.detach()
    if p.device.type != "cpu":
        p = p.cpu()
    if p.dtype not in (torch.float16, torch.float32, torch.float64):
        p = p.float()
    return p.numpy()


def head_scores(
    pattern: torch.Tensor,  # [layer, head, query_pos, key_pos]
    token_ids: Sequence[int],
    causal: bool,
    exclude_bos: bool = False,
    exclude_current_token: bool = False,
    error_measure: str = "mul",
    windows: Sequence[int | None] | None = None,
) -> dict[str, torch.Tensor]:
    """All text-based scores of every head for one text (see the module docstring).

    Args:
        pattern: post-softmax attention, float, ``[layer, head, T, T]``, T >= 1.
        token_ids: the T token ids (for the duplicate-token and induction patterns).
        causal: whether the model is causal (next_token is NaN for causal models; the entropy
            normaliser uses the q+1 visible keys of a causal query, T otherwise).
        exclude_bos, exclude_current_token: TransformerLens options for the pattern scores
            (previous_token, duplicate_token, induction, next_token).
        error_measure: TransformerLens' measure for those four scores: ``"mul"`` (fraction of
            attention mass on the pattern, [0, 1]) or ``"abs"`` (``1 - round(sum |A - P| / T,
            3)``, (-1, 1]); the other scores do not depend on it.
        windows: per layer, the sliding key window (None: full attention): a windowed
            layer's query sees min(q + 1, w) keys, the entropy normaliser's count.

    Returns:
        name -> float64 ``[layer, head]`` for every name in :data:`SCORE_NAMES` except
        ``induction_probe``. NaN marks an undefined score.

    Raises:
        ValueError: ``pattern`` is not ``[L, H, T, T]`` with T == len(token_ids).

    Every head at once in float64 (numpy, one BLAS thread), without dense detection patterns:
    each ``sum(A * P)`` sums the gathered entries where P is 1 (the previous/next-token
    diagonals, the (q, k) pairs whose ids match), which after an exclusion drops the pairs in
    the zeroed column/diagonal; ``sum(A)`` after the exclusions and ``sum_k A[q,k] |q - k|``
    are matrix-vector products with a 0/1 mask and the distance matrix; the entropy is
    ``A * log(max(A, tiny))`` summed per row (exactly 0 where A = 0). The dense parts run over
    blocks of query rows of a few heads (:data:`CHUNK_ELEMENTS`, two reused buffers: memory
    stays bounded at T = 1024); for a causal model a row block's keys right of the block are
    skipped once checked to be all zero. Equal to the per-layer float64 computation with
    dense TransformerLens detection patterns up to float64 rounding (the reference is
    tests/heads_reference.py; tests/test_heads.py compares to 1e-12). Cost at T = 128 on GPT-2
    small's 12 x 12 heads: ~5 ms (the per-layer loop: 11-38 ms).
    """
    if pattern.dim() != 4 or pattern.shape[-1] != pattern.shape[-2]:
        raise ValueError(f"pattern must be [layer, head, T, T]; got {tuple(pattern.shape)}")
    L, NH, T, _ = pattern.shape
    if len(token_ids) != T:
        raise ValueError(f"{len(token_ids)} token ids for a pattern over {T} positions")
    if error_measure not in ERROR_MEASURES:
        raise ValueError(f"error_measure must be one of {ERROR_MEASURES}; got {error_measure!r}")
    names = ["previous_token", "duplicate_token", "induction"] + ([] if causal else ["next_token"])
    pairs = _pair_index(np.asarray(list(token_ids), dtype=np.int64), exclude_bos,
                        exclude_current_token)
    n_heads = L * NH
    a = _pattern_numpy(pattern).reshape(n_heads, T, T)
    a_flat = a.reshape(n_heads, T * T)
    # sparse parts: sum(A * P) over the pairs where P = 1; the diagonal; column 0
    num = {n: a_flat[:, pairs[n]].astype(np.float64).sum(-1) for n in names}
    self_ = np.diagonal(a, axis1=1, axis2=2).astype(np.float64).mean(-1)
    sink = a[:, :, 0].astype(np.float64).mean(-1)
    # S004: mean(M[i, i-1] for i >= 1), never with exclusions; NaN for a 1-token text
    prev_s004 = (np.diagonal(a, offset=-1, axis1=1, axis2=2).astype(np.float64).mean(-1)
                 if T >= 2 else np.full(n_heads, math.nan))
    # dense parts, per block of query rows (a causal pattern's block r0:r1 is zero right of
    # key r1 - 1: those keys are skipped once checked to be zero)
    pos = np.arange(T, dtype=np.float64)
    dist = np.abs(pos[:, None] - pos[None, :])  # [query_pos, key_pos], tokens
    keep = None  # [query_pos, key_pos]: 0 where the exclusions zero A
    if exclude_bos or exclude_current_token:
        keep = np.ones((T, T))
        if exclude_bos:
            keep[:, 0] = 0
        if exclude_current_token:
            np.fill_diagonal(keep, 0)
    den = np.zeros(n_heads)  # sum(A) after the exclusions
    dist_sum = np.zeros(n_heads)  # sum_{q,k} A[q, k] |q - k|
    ent = np.empty((n_heads, T))  # [head, query_pos]: minus the row entropy, nats
    rows_per_block = max(1, min(-(-T // 8) if causal else T, CHUNK_ELEMENTS // T))
    bounds = list(range(0, T, rows_per_block)) + [T]
    tiny = np.finfo(np.float64).tiny  # below every nonzero float16/float32 value
    size = max(CHUNK_ELEMENTS, rows_per_block * T)
    x_buf = np.empty(size)  # reused by every chunk: stays in cache, no fresh pages
    lx_buf = np.empty(size)
    with one_blas_thread():
        for r0, r1 in itertools.pairwise(bounds):
            nr = r1 - r0
            w = r1 if causal and r1 < T and not a[:, r0:r1, r1:].any() else T
            d_blk = dist[r0:r1, :w].ravel()
            k_blk = None if keep is None else keep[r0:r1, :w].ravel()
            step = max(1, CHUNK_ELEMENTS // (nr * w))
            for c0 in range(0, n_heads, step):
                c1 = min(n_heads, c0 + step)
                m = (c1 - c0) * nr * w
                x = x_buf[:m].reshape(c1 - c0, nr, w)
                np.copyto(x, a[c0:c1, r0:r1, :w])  # float64
                flat = x.reshape(c1 - c0, nr * w)
                den[c0:c1] += flat.sum(-1) if k_blk is None else flat @ k_blk
                dist_sum[c0:c1] += flat @ d_blk
                lx = lx_buf[:m].reshape(x.shape)
                np.maximum(x, tiny, out=lx)  # A * log(max(A, tiny)) = 0 where A = 0
                np.log(lx, out=lx)
                np.einsum("cqk,cqk->cq", x, lx, out=ent[c0:c1, r0:r1])
    np.negative(ent, out=ent)
    n_visible = np.arange(1, T + 1, dtype=np.float64) if causal else np.full(T, float(T))
    if windows is not None and len(windows) != L:
        raise ValueError(f"windows must give one entry per layer ({L}); got {len(windows)}")
    # per head (layer-major), each query's visible key count: a layer's window caps it
    n_vis = np.broadcast_to(n_visible, (n_heads, T))
    if windows is not None and any(w is not None for w in windows):
        n_vis = np.repeat(np.stack([n_visible if w is None else np.minimum(n_visible, w)
                                    for w in windows]), NH, axis=0)
    rows = n_visible >= 2
    ok = den > 0
    safe = np.where(ok, den, 1.0)
    if error_measure == "abs":
        # sum |A - P| over the kept entries = sum(A) - 2 sum(A * P) + n(P) (P is 0/1, A <= 1);
        # TransformerLens' 1 - round(mean * size, 3), Python's round on the float, per head
        res = {n: np.array([1 - round(float(v), 3) for v in
                            (den - 2 * num[n] + len(pairs[n])) / T]) for n in names}
    else:
        res = {n: np.where(ok, num[n] / safe, math.nan) for n in names}
    if causal:
        res["next_token"] = np.full(n_heads, math.nan)
    res["self"] = self_
    res["sink"] = sink
    res["previous_s004"] = prev_s004
    res["sink_s004"] = sink
    res["entropy"] = ent.mean(-1)
    res["entropy_normalized"] = ((ent[:, rows] / np.log(n_vis[:, rows])).mean(-1)
                                 if rows.any() else np.full(n_heads, math.nan))
    res["mean_distance"] = dist_sum / T
    return {n: torch.from_numpy(np.ascontiguousarray(res[n])).reshape(L, NH)
            for n in SCORE_NAMES if n in res}


def mean_over_texts(per_text: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Average each score over texts, ignoring texts where it is NaN (NaN if NaN for all).

    ``per_text``: one dict name -> ``[layer, head]`` per text. Returns the same names.
    Equals TransformerLens ``detect_head(model, [texts...])`` (``torch.stack(...).mean(0)``)
    whenever no score is NaN.
    """
    names = per_text[0].keys()
    out = {}
    for name in names:
        x = torch.stack([d[name] for d in per_text])
        ok = ~x.isnan()
        n = ok.sum(0)
        s = torch.where(ok, x, torch.zeros_like(x)).sum(0)
        out[name] = torch.where(n > 0, s / n.clamp_min(1), torch.full_like(s, math.nan))
    return out


# ---------------------------------------------------------------- induction probe
def build_induction_probe(
    candidates: Sequence[int],
    segment_length: int,
    repeats: int,
    seed: int,
    prefix: Sequence[int],
    suffix: Sequence[int],
    n_ctx: int,
) -> list[int]:
    """Token ids of the induction probe: ``prefix + segment * repeats + suffix``.

    The segment is ``segment_length`` *distinct* ids drawn from ``candidates`` (non-special
    vocabulary ids) by ``torch.randperm`` with a ``torch.Generator`` seeded with ``seed``
    (reproducible across runs and machines with the same torch). Distinct ids make "the same
    token's earlier occurrence" unambiguous. Causal models: prefix = [BOS], suffix = [];
    encoders: prefix = [CLS], suffix = [SEP]. Olsson et al. 2022 (repeated random tokens).

    Raises:
        InvalidRequest: fewer candidates than ``segment_length``.
        ContextLengthExceeded: the probe has more than ``n_ctx`` tokens (the message names the
            limit and the count).
    """
    n = len(prefix) + segment_length * repeats + len(suffix)
    if n > n_ctx:
        raise ContextLengthExceeded(
            f"the induction probe has {n} tokens ({len(prefix) + len(suffix)} framing + "
            f"segment_length {segment_length} x repeats {repeats}); the model's context is "
            f"{n_ctx} tokens (n_ctx): lower probe.segment_length or probe.repeats",
            "probe.segment_length",
        )
    if segment_length > len(candidates):
        raise InvalidRequest(
            f"probe.segment_length = {segment_length} exceeds the {len(candidates)} distinct "
            "non-special token ids of the vocabulary", "probe.segment_length",
        )
    g = torch.Generator().manual_seed(int(seed))
    cand = torch.as_tensor(list(candidates), dtype=torch.long)
    segment = cand[torch.randperm(len(cand), generator=g)[:segment_length]].tolist()
    return list(prefix) + segment * repeats + list(suffix)


def induction_probe_score(
    pattern: torch.Tensor,  # [layer, head, query_pos, key_pos]
    start: int,
    segment_length: int,
    repeats: int,
) -> torch.Tensor:
    """Induction probe score: the attention mass each query of repeats 2..R puts on the tokens
    that FOLLOWED the same token in ALL earlier repeats (Olsson et al. 2022, "In-context
    Learning and Induction Heads": prefix matching on repeated random tokens).

    The segment occupies positions ``start + r*S .. start + (r+1)*S - 1`` for repeat r
    (0-based). For a query at offset j of repeat r >= 1 the targets are the keys
    ``start + r'*S + j + 1`` for every earlier repeat r' < r (for j = S-1 the successor is the
    first token of repeat r'+1). Score = mean over the ``(R-1)*S`` queries of the sum of the
    query's attention on its r targets; float64 ``[layer, head]`` in [0, 1] (1 = all attention
    on induction targets). Counting only the previous repeat's successor would understate an
    induction head that spreads its mass over every earlier copy (at R = 8 by up to 5x).
    Encoders are scored the same way (only earlier copies count).

    Raises:
        ValueError: ``repeats < 2`` or the pattern is shorter than ``start + S*R``.
    """
    S, R = segment_length, repeats
    if R < 2 or S < 1 or pattern.shape[-1] < start + S * R:
        raise ValueError("the probe needs repeats >= 2 and a pattern covering every repeat")
    qs, ks = induction_probe_targets(start, S, R)
    mass = pattern[..., qs, ks].double()  # [layer, head, pairs]: gather first, then float64
    return mass.sum(-1) / ((R - 1) * S)


def induction_probe_targets(start: int, segment_length: int, repeats: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (query, key) pairs of :func:`induction_probe_score`: every query of repeats 1..R-1
    with each earlier repeat's successor of its token. Two long tensors of equal length
    ``S * R * (R-1) / 2``."""
    S, R = segment_length, repeats
    qs, ks = [], []
    for r in range(1, R):
        for j in range(S):
            q = start + r * S + j
            for r_ in range(r):
                qs.append(q)
                ks.append(start + r_ * S + j + 1)
    return torch.tensor(qs, dtype=torch.long), torch.tensor(ks, dtype=torch.long)


# -------------------------------------------------------------------- labels
def label_score(scores: Mapping[str, float | None], label: str) -> float | None:
    """The score ``label``'s threshold is compared with (:data:`LABEL_SCORE`; induction falls
    back to the text's ``induction`` score when the probe did not run); None when undefined."""

    def val(name):
        v = scores.get(name)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)

    v = val(LABEL_SCORE[label])
    if v is None and label == "induction":
        v = val("induction")
    return v


def classify_all(
    scores: Mapping[str, float | None],
    thresholds: Mapping[str, float],
) -> dict:
    """Every label a head passes, its primary label, and the margins to the thresholds.

    ``thresholds``: label -> threshold for exactly the labels of :data:`LABEL_ORDER` (a label
    needs its score strictly above its threshold; ``induction`` is compared with
    ``induction_probe`` when the probe ran, else with the text's ``induction`` score). The
    values come from the caller (the API's ``HeadThresholds``); there are none here.

    Returns ``{"label", "labels", "margins", "margin"}``: ``labels`` = every label of
    :data:`LABEL_ORDER` whose score (:func:`label_score`) is strictly above its threshold, in
    that order; ``label`` = the first of them, else ``"none"`` (S004 tries previous before
    sink, as here); ``margins`` = label -> score - threshold (None where the score is
    undefined), so a label within a rounding error of its threshold can be seen; ``margin`` =
    the primary label's margin (> 0), or for ``"none"`` the largest margin (<= 0: how far the
    nearest label is).

    Raises:
        ValueError: ``thresholds`` lacks a label of :data:`LABEL_ORDER` or names another key.
    """
    th = thresholds
    if th.keys() != _LABELS:
        missing = [lb for lb in LABEL_ORDER if lb not in th]
        unknown = sorted(set(th) - set(LABEL_ORDER))
        raise ValueError(f"thresholds must name exactly the labels {list(LABEL_ORDER)}; "
                         f"missing {missing}, unknown {unknown}")
    margins: dict[str, float | None] = {}
    for label in LABEL_ORDER:
        v = label_score(scores, label)
        margins[label] = None if v is None else v - th[label]
    labels = [lb for lb in LABEL_ORDER if margins[lb] is not None and margins[lb] > 0]
    label = labels[0] if labels else "none"
    defined = [m for m in margins.values() if m is not None]
    margin = margins[label] if labels else (max(defined) if defined else None)
    return {"label": label, "labels": labels, "margins": margins, "margin": margin}


def classify(
    scores: Mapping[str, float | None],
    thresholds: Mapping[str, float],
) -> str:
    """The primary label of one head (:func:`classify_all`'s ``label``)."""
    return classify_all(scores, thresholds)["label"]
