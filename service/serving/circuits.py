"""/v1/circuits: weight-only OV/QK circuit summaries and composition scores of every head
(service/analysis/circuits.py), computed once per model revision and kept in the runtime's
memo; a request only slices the kept result (``top_k``) and encodes it."""

from __future__ import annotations

import numpy as np
import torch

from attnscope.schemas.circuits import CIRCUIT_WEIGHTS_DOC, CircuitsRequest, CircuitsResponse
from ..analysis import circuits as C
from ..runtime import hooked as H
from .core.engine import Plan
from .core.table import Endpoint
from .lens import check
from .run import parts


#: the ``weights`` field on the rotary families
FAMILY_WEIGHTS_DOC = (
    "The checkpoint's raw weights, as TransformerLens' enable_compatibility_mode("
    "no_processing=True) gives them: no norm folding (ln1's and the final norm's weights are "
    "not multiplied in), no centring, biases ignored (Qwen2's q/k/v, GPT-NeoX's). Row-vector "
    "convention: W_Q [d_model, d_head] per query head (rows of q_proj, transposed; GPT-NeoX the "
    "fused query_key_value's q rows), W_K and W_V of the key/value head query head h reads "
    "(h // (n_heads / n_kv_heads), HF's repeat_kv), W_O [d_head, d_model] (columns of o_proj / "
    "dense), W_E = the embedding matrix [d_vocab, d_model] (Gemma: without its sqrt(d_model) "
    "factor, which the copying scores, ratios of eigenvalues, do not depend on), W_U = "
    "lm_head.weight^T; W_OV = W_V W_O, W_QK = W_Q W_K^T (without the score scaling and "
    "RoPE: see qk_definition)."
)


def _f(x) -> float:
    return float(str(np.float32(float(x))))


def _nested(t: torch.Tensor) -> list:
    return np.vectorize(_f, otypes=[float])(t.numpy()).tolist()


def weights(p) -> C.CircuitWeights:
    """The raw per-head weights of the hooked forward's parts (row-vector convention, TL's
    ``W_Q`` ``[layer, head, d_model, d_head]`` ...). GPT-2: c_attn's q | k | v columns,
    head-major inside each, and c_proj's rows. The rotary families: ``q_proj`` / ``k_proj`` /
    ``v_proj`` rows per head (GPT-NeoX: the fused ``query_key_value``, rows ``[head, q|k|v,
    d_head]``), transposed; with grouped-query attention query head ``h`` gets key/value head
    ``h // (n_heads / n_kv_heads)``'s ``W_K`` / ``W_V`` (HF's ``repeat_kv``); ``W_O`` the
    columns of ``o_proj`` / ``dense`` per head, transposed. ``W_E`` = the embedding matrix
    (Gemma: without its sqrt(d_model) factor, as TransformerLens' ``W_E``; the copying scores
    are ratios of eigenvalues, unchanged by it), ``W_U`` = lm_head.weight^T. Biases are
    ignored."""
    D, Hn, dh = p.d_model, p.n_heads, p.d_head
    if getattr(p, "family", "gpt2") == "gpt2":
        def split(w, i):  # [D, 3D] -> [H, D, dh]
            return w[:, i * D:(i + 1) * D].reshape(D, Hn, dh).permute(1, 0, 2)

        W_Q = torch.stack([split(b.attn_w, 0) for b in p.blocks])
        W_K = torch.stack([split(b.attn_w, 1) for b in p.blocks])
        W_V = torch.stack([split(b.attn_w, 2) for b in p.blocks])
        W_O = torch.stack([b.proj_w.reshape(Hn, dh, D) for b in p.blocks])
        return C.CircuitWeights(W_Q, W_K, W_V, W_O, p.wte, p.unembed.T)
    kv_of = torch.arange(Hn) // (Hn // p.n_kv_heads)  # query head -> its key/value head

    def per_head(blk, i):  # [H, D, dh] of q (0), k (1), v (2), on the query heads
        if blk.qkv_w is not None:  # GPT-NeoX: rows [head, 3, d_head]
            w = blk.qkv_w.view(Hn, 3, dh, D)[:, i]
        else:
            w = (blk.q_w, blk.k_w, blk.v_w)[i]
            w = w.view(w.shape[0] // dh, dh, D)
            if i:
                w = w[kv_of]
        return w.transpose(1, 2)

    W_Q, W_K, W_V = (torch.stack([per_head(b, i) for b in p.blocks]) for i in range(3))
    W_O = torch.stack([b.o_w.view(D, Hn, dh).permute(1, 2, 0) for b in p.blocks])
    return C.CircuitWeights(W_Q, W_K, W_V, W_O, p.wte, p.unembed.T)


def qk_definition(p) -> str | None:
    """What the QK circuit and Q-/K-composition mean on ``p`` (None for GPT-2, where positions
    are a residual component and W_QK is position-free)."""
    if getattr(p, "family", "gpt2") == "gpt2":
        return None
    part = p.rotary_dim < p.d_head
    return (
        f"{p.family} applies RoPE to q and k ({p.rotary_dim} of {p.d_head} dims per head"
        f"{', the rest unrotated' if part else ''}), so the bilinear form a query at position i "
        "applies to a key at position j is W_Q R(j - i) W_K^T: position-dependent. W_QK = W_Q "
        "W_K^T here (qk_singular_values, qk_frobenius, composition.q and .k) is that form at "
        "relative position 0 (query and key at the same position, where the rotations cancel), "
        "the same matrix TransformerLens' model.QK / all_composition_scores use (they ignore "
        "rotary). The OV circuit, copying scores and V-composition do not involve positions "
        "and are as for GPT-2."
        + (" Gemma 2's attention soft-cap tanh(s / cap) * cap is applied after W_QK and not "
           "included." if getattr(p, "attn_softcap", None) is not None else ""))


def computed(rt) -> C.Circuits:
    """The resident model's circuits, computed on first use (on the device thread) and kept
    per model id and revision in ``rt.memo`` (one entry: a runtime holds one model)."""
    return _kept(rt)[0]


def _kept(rt) -> tuple[C.Circuits, dict]:
    """(the circuits on the CPU, the response's numbers as Python floats: ``heads`` at full
    d_head and ``composition``), computed once per model id and revision and kept in
    ``rt.memo``: a later request only slices ``top_k`` (turning 3 x (L H)^2 composition
    scores into JSON floats cost ~0.1 s per request on GPT-2-small)."""
    key = ("circuits", rt.model_ref()["id"], rt.model_ref()["revision"])
    got = rt.memo.get(key)
    if got is None:
        with torch.inference_mode():
            c = C.circuits(weights(parts(rt)), composition=True)
        c = C.Circuits(*(t.cpu() if isinstance(t, torch.Tensor) else
                         {k: v.cpu() for k, v in t.items()} for t in (
                             c.copying, c.positive_share, c.ov_sv, c.qk_sv,
                             c.ov_norm, c.qk_norm, c.comp)))
        L, Hn = c.copying.shape
        heads = [{"layer": layer, "head": h,
                  "copying_score": _f(c.copying[layer, h]),
                  "positive_eigenvalue_share": _f(c.positive_share[layer, h]),
                  "ov_singular_values": _nested(c.ov_sv[layer, h]),
                  "qk_singular_values": _nested(c.qk_sv[layer, h]),
                  "ov_frobenius": _f(c.ov_norm[layer, h]),
                  "qk_frobenius": _f(c.qk_norm[layer, h])}
                 for layer in range(L) for h in range(Hn)]
        got = rt.memo[key] = (c, {"heads": heads,
                                  "composition": {m: _nested(c.comp[m]) for m in ("q", "k", "v")}})
    return got


def plan(rt, req: CircuitsRequest, items) -> Plan:
    """The estimate (the weights in float64 and the composition work, when not yet kept; the
    response's numbers) and the job: the kept circuits sliced to ``top_k``."""
    p = parts(rt)
    L, Hn, D, dh, V = p.n_layers, p.n_heads, p.d_model, p.d_head, p.d_vocab
    n = L * Hn
    k = min(req.top_k, dh)
    body = 300 * n + 2 * 30 * n * k + (3 * 30 * n * n if req.composition else 0)
    qk_def = qk_definition(p)
    weights_doc = CIRCUIT_WEIGHTS_DOC if qk_def is None else FAMILY_WEIGHTS_DOC
    key = ("circuits", rt.model_ref()["id"], rt.model_ref()["revision"])
    work = 0 if key in rt.memo else 8 * (4 * n * D * dh + V * D + D * D + (1 << 23) * 2
                                         + 4 * n * n)

    def job(_forwards) -> dict:
        _, kept = _kept(rt)
        heads = [{**h, "ov_singular_values": h["ov_singular_values"][:k],
                  "qk_singular_values": h["qk_singular_values"][:k]} for h in kept["heads"]]
        return {"model": rt.model_ref(), "weights": weights_doc, "n_layers": L,
                "n_heads": Hn, "d_head": dh, "qk_definition": qk_def, "heads": heads,
                "composition": kept["composition"] if req.composition else None}

    return Plan([], job, int(body + work))


ENDPOINTS = [
    Endpoint(
        path="/v1/circuits", name="circuits", request=CircuitsRequest,
        response=CircuitsResponse,
        summary="Weight-only OV/QK circuit summaries and composition scores of every head",
        description="""From the weights alone (no text; Elhage et al. 2021, "A Mathematical
Framework for Transformer Circuits"), per head: the copying score of the full OV circuit
``W_E W_OV W_U`` (``sum(lambda) / sum(|lambda|)`` over its eigenvalues, in [-1, 1], and the
positive eigenvalues' share ``sum(max(Re lambda, 0)) / sum(|lambda|)``), computed on the
d_head x d_head matrix ``W_O (W_U W_E) W_V``, which has the same nonzero eigenvalues (never the
vocab x vocab matrix); the top singular values and Frobenius norms of ``W_OV = W_V W_O`` and
``W_QK = W_Q W_K^T`` (by QR cores, as TransformerLens' FactoredMatrix); and the Q-, K- and
V-composition scores ``||W_A W_B||_F / (||W_A||_F ||W_B||_F)`` between every pair of heads in
different layers (TransformerLens ``all_composition_scores``, ``[layer_a, head_a, layer_b,
head_b]``, 0 unless layer_a < layer_b). The checkpoint's raw weights, as TransformerLens'
``enable_compatibility_mode(no_processing=True)`` / ``from_pretrained_no_processing``: no
LayerNorm folding, no centring, biases ignored (said in ``weights``). Computed in float64 once
per model revision and kept; equal to TransformerLens 4.3 and numpy to <= 1e-5
(tests/test_circuits.py). Rotary families (Llama, Mistral, Qwen2, Gemma, Gemma 2, GPT-NeoX):
W_K / W_V of the key/value head each query head reads; RoPE makes the query-key form
position-dependent (``W_Q R(j - i) W_K^T``), so W_QK and the Q-/K-composition are served at
relative position 0 (TransformerLens' ``QK`` / ``all_composition_scores``, which ignore rotary),
said in ``qk_definition``; OV, copying and V-composition as for GPT-2
(tests/test_lens_families.py).
Errors: 422 a model the hooked forward does not run (encoders, other families).""",
        plan=plan, check=check, tokenize=False,
        invalid="Invalid request: top_k out of 1..1024, an unsupported model.",
        tags=("circuits",), order=132,
    ),
]
