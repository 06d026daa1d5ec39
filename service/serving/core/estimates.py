"""Memory estimates of every endpoint's response and of its job's own tensors (issue 17,
"Every endpoint's response is in its estimate"). The serving modules call these and put the
result in ``Plan.response_bytes``; the engine adds the forwards (service/serving/core/memory.py)
and checks the sum against ``max_request_bytes`` and the global budget.

Each function counts the big allocations of its job (float64 copies, score matrices,
fitted PCA work) and of its response: the Python objects of the body (token dicts, link
dicts: measured ~300-600 bytes each with their JSON text) and the encoded tensors
(:func:`~attnscope.service.encoding.codecs.estimate_encoded_bytes`). They are upper bounds
of the same order as the truth: tests/test_estimates.py checks every endpoint's response size
against its estimate, and tests/test_abuse.py the process's resident memory.
"""

from __future__ import annotations

from ...encoding.codecs import estimate_encoded_bytes

#: one token of a response (id, label, offsets, special: a dict + its JSON)
TOKEN_BYTES = 600
#: one link of /v1/links (query/key positions and labels, weight: dicts + JSON)
LINK_BYTES = 700
#: one head of /v1/heads (its scores dict, label, JSON)
HEAD_BYTES = 3000


def tokens_bytes(n_tokens: int) -> int:
    """The ``tokens`` lists of ``n_tokens`` tokens in all."""
    return TOKEN_BYTES * int(n_tokens)


#: one reported position of /v1/predictions (its row dict, next-token ref, numbers, JSON)
POSITION_BYTES = 1200
#: one top-k entry of /v1/predictions (a token ref dict: id, label, bytes, partial, prob,
#: logit; measured ~500 bytes with its JSON: 8 x 238 positions x top_k 100 peaked 105 MB)
TOP_TOKEN_BYTES = 600


def predictions_bytes(lengths: list[int], n_positions: int, top_k: int) -> int:
    """/v1/predictions' response objects: ``n_positions`` reported positions in all, each
    with ``top_k`` token entries, and every text's tokens (all alive until the body is sent)."""
    return (int(n_positions) * (POSITION_BYTES + TOP_TOKEN_BYTES * int(top_k))
            + sum(tokens_bytes(T) for T in lengths))


def trajectories_bytes(lengths: list[int], n_states: int, d_model: int, n_components: int,
                       encoding: str, dtype: str, round_: int | None) -> int:
    """/v1/trajectories per text of T tokens: the states x tokens matrix in float64 and the
    standardised, centred and SVD copies of it (PCA: ~6 of ``[n_states * T, d_model]``), the
    paths ``[T, n_states, n_components]`` in float64, and the encoded paths."""
    total = 0
    for T in lengths:
        rows = n_states * T
        paths = T * n_states * n_components
        total += 8 * rows * d_model * 6 + 8 * paths + \
            estimate_encoded_bytes(paths, encoding, dtype, round_, row_len=n_components) + \
            tokens_bytes(T) + 64 * T
    return total


def links_bytes(lengths: list[int], top_k: int, n_heads: int) -> int:
    """/v1/links per text: the head-mean weights ``[T, T]`` (float32 + a ranking copy) and
    up to ``top_k`` link objects per query token."""
    return sum(4 * T * T * 3 + LINK_BYTES * T * min(top_k, T) + tokens_bytes(T)
               for T in lengths)


def heads_bytes(lengths: list[int], n_layers: int, n_heads: int) -> int:
    """/v1/heads: per text the score passes over ``[layer, head, T, T]`` (float64 work
    copies, ~3 at once) and the response's one object per head."""
    work = max((8 * 3 * n_layers * n_heads * T * T for T in lengths), default=0)
    return work + HEAD_BYTES * n_layers * n_heads + sum(tokens_bytes(T) for T in lengths)


def verify_bytes(lengths: list[int], n_layers: int, n_heads: int, d_model: int,
                 projections: bool) -> int:
    """/v1/verify: the selected layers' weights in float64 (q/k/v/output, ``4 d^2``), and for
    one layer at a time the float64 q, k, v, scores, pattern and output of the recomputation
    (``+`` the attention input and recomputed q/k/v with ``projections``)."""
    params = 8 * n_layers * (4 * d_model * d_model + 4 * d_model)
    longest = max(lengths, default=0)
    per_layer = 8 * (3 * n_heads * longest * longest + (4 + (4 if projections else 0))
                     * longest * d_model)
    report = n_layers * n_heads * 200 + sum(tokens_bytes(T) for T in lengths)
    return params + 2 * per_layer + report


def scratch_bytes(n_heads: int, n_query: int, n_key: int, d_k: int, d_v: int, encoding: str,
                  dtype: str, round_: int | None, pca_rows: int = 0, pca_cols: int = 0) -> int:
    """/v1/scratch-attention: Q, K, V in float64, scores / masked / weights ``[head,
    query_pos, key_pos]`` in float64, the output, their encodings; with ``project`` the PCA
    fit of the embedding matrix ``[pca_rows, pca_cols]`` (float64 copy, centred copy, SVD)."""
    hqk = n_heads * n_query * n_key
    out = n_query * d_v
    work = 8 * ((n_query + n_key) * d_k + n_key * d_v + 3 * hqk + out)
    enc = (2 * estimate_encoded_bytes(hqk, encoding, dtype, round_, row_len=max(n_key, 1))
           + estimate_encoded_bytes(out, encoding, dtype, round_, row_len=max(d_v, 1)))
    pca = 8 * 4 * pca_rows * pca_cols
    return work + enc + pca + tokens_bytes(n_query + n_key)


# ------------------------------------------------------------------ device work (issue 29)
# Floating-point operations (a multiply-add = 2), the unit of ``max_request_flops``. Measured
# here (2 shared CPU cores, float32): a GPT-2-small forward at T = 128 (22 GFLOP by
# :func:`forward_flops`) took 232 ms, i.e. ~95 GFLOP/s; the breaker's logit lens over 32 x 256
# tokens (9.6 TFLOP by :func:`lens_flops`) took 110 s, ~87 GFLOP/s.

def forward_flops(T: int, n_layers: int, d_model: int, d_mlp: int, rows: int = 1,
                  layers: int | None = None, logit_positions: int = 0, d_vocab: int = 0) -> float:
    """One forward of ``rows`` prompts of ``T`` tokens through ``layers`` (default all) of a
    transformer's blocks: per token and layer the q/k/v/output projections ``2 * 4 d^2`` and
    the MLP ``2 * 2 d d_mlp``; per layer the scores and the weighted values ``2 * 2 T^2 d``;
    plus the unembedding at ``logit_positions`` positions (``2 d V`` each)."""
    n = n_layers if layers is None else layers
    per_layer = T * (8 * d_model * d_model + 4 * d_model * d_mlp) + 4 * T * T * d_model
    return float(rows) * (n * per_layer + 2.0 * logit_positions * d_model * d_vocab)


def lens_flops(T: int, n_states: int, n_positions: int, d_model: int, d_vocab: int) -> float:
    """The logit lens of one prompt: ``n_states`` residual states unembedded at every one of
    its ``T`` positions (``2 d V`` each; the statistics read ``n_positions`` of them) plus a
    log-softmax over the vocabulary (~5 V per position)."""
    return float(n_states) * T * (2.0 * d_model * d_vocab + 5.0 * d_vocab)


#: attention flow's pure-Python max-flow work, as FLOP-equivalents of this device's torch rate:
#: one (text, flow layer of depth ``top``) at T tokens costs ~FLOW_S_16 seconds at T = 16 and
#: 12 layers (bench/norms_rollout.py: ~1 s for 16 tokens, ~14 s for 24; it grows ~T^6)
FLOW_S_16 = 1.0
FLOW_FLOPS_PER_S = 9e10


def flow_flops(T: int, depth: int) -> float:
    """Attention flow for one text of ``T`` tokens up to a layer ``depth`` layers deep
    (``top + 1``), FLOP-equivalents: ``FLOW_S_16 * (T/16)^6 * (depth/12)^2`` seconds at
    ``FLOW_FLOPS_PER_S``. Texts x layers count: one term per text and flow layer."""
    return FLOW_S_16 * (T / 16.0) ** 6 * (depth / 12.0) ** 2 * FLOW_FLOPS_PER_S


def fmt_flops(x: float) -> str:
    for unit, f in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if x >= f:
            return f"{x / f:.3g} {unit}"
    return f"{x:.3g} FLOP"


def check_device(forwards: float, job: float, limit: float, n_texts: int = 0,
                 longest: int = 0, detail: str = "", param: str | None = None) -> float:
    """Refuse (422 ``device_limit_exceeded``, naming the estimate, its parts and the limit)
    a request whose device work ``forwards + job`` (FLOP) exceeds ``limit``
    (``max_request_flops``; 0 = none). Returns the estimate."""
    from ...errors import DeviceLimitExceeded

    total = float(forwards) + float(job)
    if limit and total > limit:
        parts = []
        if forwards:
            parts.append(f"recorded forwards {fmt_flops(forwards)} for {n_texts} "
                         f"text{'s' if n_texts != 1 else ''}, longest {longest} tokens")
        if job:
            parts.append(f"the job {fmt_flops(job)}{detail}")
        raise DeviceLimitExceeded(
            f"this request needs an estimated {fmt_flops(total)} ({total:.4g} floating-point "
            f"operations) of device work ({'; '.join(parts) or 'none'}); the limit is "
            f"{fmt_flops(limit)} (max_request_flops = {limit:.4g}). Send fewer or shorter "
            "texts or pairs, fewer positions, layers or variants",
            param or ("texts" if n_texts > 1 else "text"))
    return total
