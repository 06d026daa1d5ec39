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


def _f(x) -> float:
    return float(str(np.float32(float(x))))


def _nested(t: torch.Tensor) -> list:
    return np.vectorize(_f, otypes=[float])(t.numpy()).tolist()


def weights(p: H.GPT2Parts) -> C.CircuitWeights:
    """The raw per-head weights of the hooked forward's parts (row-vector convention, TL's
    ``W_Q`` ``[layer, head, d_model, d_head]`` ...): c_attn's q | k | v columns, head-major
    inside each, and c_proj's rows; ``W_E`` = wte, ``W_U`` = lm_head.weight^T."""
    D, Hn, dh = p.d_model, p.n_heads, p.d_head

    def split(w, i):  # [D, 3D] -> [H, D, dh]
        return w[:, i * D:(i + 1) * D].reshape(D, Hn, dh).permute(1, 0, 2)

    W_Q = torch.stack([split(b.attn_w, 0) for b in p.blocks])
    W_K = torch.stack([split(b.attn_w, 1) for b in p.blocks])
    W_V = torch.stack([split(b.attn_w, 2) for b in p.blocks])
    W_O = torch.stack([b.proj_w.reshape(Hn, dh, D) for b in p.blocks])
    return C.CircuitWeights(W_Q, W_K, W_V, W_O, p.wte, p.unembed.T)


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
    key = ("circuits", rt.model_ref()["id"], rt.model_ref()["revision"])
    work = 0 if key in rt.memo else 8 * (4 * n * D * dh + V * D + D * D + (1 << 23) * 2
                                         + 4 * n * n)

    def job(_forwards) -> dict:
        _, kept = _kept(rt)
        heads = [{**h, "ov_singular_values": h["ov_singular_values"][:k],
                  "qk_singular_values": h["qk_singular_values"][:k]} for h in kept["heads"]]
        return {"model": rt.model_ref(), "weights": CIRCUIT_WEIGHTS_DOC, "n_layers": L,
                "n_heads": Hn, "d_head": dh, "heads": heads,
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
(tests/test_circuits.py).
Errors: 422 a model the hooked forward does not run (encoders, other families).""",
        plan=plan, check=check, tokenize=False,
        invalid="Invalid request: top_k out of 1..1024, an unsupported model.",
        tags=("circuits",), order=132,
    ),
]
