"""POST /v1/rollout: checks, memory estimate and the job (runs on the device thread)."""

from __future__ import annotations

import torch

from attnscope.schemas import RolloutRequest, RolloutResponse
from ..analysis import rollout as RO
from ..encoding import encode_tensor, estimate_encoded_bytes
from ..errors import InvalidRequest, NonFiniteValues, n_tokens
from .core.engine import Plan
from .core.estimates import flow_flops
from .core.table import Endpoint
from .core.checks import check_indices
from .common import text_or_results


def check(rt, req) -> None:
    """Token-independent checks (422, before tokenizing; the engine runs them once): layer
    indices, flow_layers without flow, 'tril' on an encoder."""
    L = rt.adapter.n_layers
    check_indices(req.layers, L, "layers", "layer")
    check_indices(req.flow_layers, L, "flow_layers", "layer")
    if req.flow_layers is not None and not req.flow:
        raise InvalidRequest("flow_layers is given but flow is false; set flow to true",
                             "flow_layers")
    if req.layout == "tril" and not rt.adapter.causal:
        raise InvalidRequest("layout 'tril' needs a causal model; this one is an encoder "
                             "(rollout is not triangular)", "layout")


def check_lengths(req, lengths: list[int]) -> None:
    """The token-dependent check (422): flow over :data:`rollout.FLOW_MAX_TOKENS` tokens (the
    message names the limit)."""
    if req.flow:
        for i, n in enumerate(lengths):
            if n > RO.FLOW_MAX_TOKENS:
                where = req.input_param(i)
                raise InvalidRequest(
                    f"attention flow is limited to {RO.FLOW_MAX_TOKENS} tokens (flow_max_tokens:"
                    f" one max-flow per query and input token, its cost grows as T^4 x layers);"
                    f" {where} has {n_tokens(n)}. Send a shorter text or set flow to false "
                    "(rollout has no such limit)", "flow",
                )


def selection(rt, req) -> tuple[list[int], list[int] | None]:
    """The rollout layers and the flow layers (None without flow); checked by :func:`check`."""
    L = rt.adapter.n_layers
    layers = req.layers if req.layers is not None else list(range(L))
    flow_layers = None
    if req.flow:
        flow_layers = req.flow_layers if req.flow_layers is not None else [L - 1]
    return layers, flow_layers


def estimate(rt, req, lengths: list[int], encoding: str) -> int:
    """Bytes the job allocates beyond the recorded forwards, for texts of ``lengths`` tokens:
    float64 F, Â and R (3 * 8 * L*T^2) plus one layer's float64 pattern copy (8*H*T^2), the
    float32 results and their encoded forms (rollout over the selected layers, flow), and
    with flow the largest text's max-flow graphs (:func:`flow_graph_bytes`)."""
    a = rt.adapter
    L, H = a.n_layers, a.n_heads
    n_sel = len(req.layers) if req.layers is not None else L
    n_flow = (len(req.flow_layers) if req.flow_layers is not None else 1) if req.flow else 0
    _, flow_layers = selection(rt, req)
    depth = max(flow_layers) + 1 if flow_layers else 0
    total, graphs = 0, 0
    for T in lengths:
        total += 4 * 8 * L * T * T + 8 * H * T * T
        for n in (n_sel, n_flow):
            if n:
                total += 4 * n * T * T + estimate_encoded_bytes(
                    n * T * T, encoding, req.dtype, req.round, req.layout, req.sparse, T)
        if depth:  # one text's graphs at a time (analysis.rollout.attention_flow)
            graphs = max(graphs, flow_graph_bytes(L, T, depth))
    return total + graphs


#: attention flow's networkx graph and residual network, per edge of the deepest flow layer's
#: full graph (``depth * T^2`` edges): measured at most ~900 bytes (VmHWM of one flow, 2-12
#: layers x 16 tokens, tests/estimate_peak.py); 2 KiB leaves room for the allocator
FLOW_EDGE_BYTES = 2048


def flow_graph_bytes(n_layers: int, T: int, depth: int) -> int:
    """One text's attention-flow work: the graphs (:data:`FLOW_EDGE_BYTES` per edge of
    ``depth * T^2``) and the capacities as Python floats (``n_layers * T^2``, 32 bytes each)."""
    return FLOW_EDGE_BYTES * depth * T * T + 32 * n_layers * T * T


def plan(rt, req, items, *, binary: bool = False) -> Plan:
    """The flow length check (422 naming the limit), the memory estimate of the new tensors
    (:func:`estimate`, counted with the forwards before any runs) and the job (:func:`build`)."""
    encoding = "binary" if binary else req.encoding
    lengths = [len(it) for it in items]
    check_lengths(req, lengths)
    return Plan(items, lambda forwards: build(rt, req, forwards, encoding),
                estimate(rt, req, lengths, encoding), device_flops=flow_cost(rt, req, lengths),
                device_param="flow" if req.flow else None)


def flow_cost(rt, req, lengths: list[int]) -> float:
    """Attention flow's device cost (FLOP-equivalents, counted against ``max_request_flops``
    before the job starts): one :func:`~.core.estimates.flow_flops` term per text and flow
    layer, that layer ``top + 1`` deep; 0 without ``flow``."""
    _, flow_layers = selection(rt, req)
    if not flow_layers:
        return 0.0
    return sum(flow_flops(T, top + 1) for T in lengths for top in flow_layers)


def build(rt, req, forwards, encoding: str) -> dict:
    """The response body (tensors through encode_tensor)."""
    layers, flow_layers = selection(rt, req)
    causal = rt.adapter.causal
    out = []
    for i, fw in enumerate(forwards):
        pfx = "rollout" if req.single else f"results.{i}"
        if not torch.isfinite(fw.pattern.sum()):
            raise NonFiniteValues("the model's attention pattern holds NaN/inf; refusing to "
                                  "roll it out")
        aug = RO.augmented_matrices(fw.pattern, causal, req.fusion, req.residual, req.discard,
                                    req.sink, windows=rt.windows if any(rt.windows) else None)
        R = RO.rollout(aug)
        res = {
            "tokens": [t.as_dict() for t in fw.tokens.tokens],
            "layers": layers,
            "rollout": encode_tensor(R[layers].float(), encoding, req.dtype, req.round,
                                     f"{pfx}.rollout", layout=req.layout, sparse=req.sparse),
            "flow_layers": flow_layers,
            "flow": None,
        }
        if flow_layers is not None:
            flow = RO.attention_flow(aug, flow_layers)
            res["flow"] = encode_tensor(flow.float(), encoding, req.dtype, req.round,
                                        f"{pfx}.flow", layout=req.layout, sparse=req.sparse)
        out.append(res)
    body: dict = {"model": rt.model_ref(), "fusion": req.fusion, "residual": req.residual,
                  "discard": req.discard, "sink": req.sink, "flow_max_tokens": RO.FLOW_MAX_TOKENS,
                  "sliding_windows": list(rt.windows) if any(rt.windows) else None}
    return text_or_results(req, body, "rollout", out)


ENDPOINTS = [
    Endpoint(
        path='/v1/rollout', name='rollout',
        request=RolloutRequest, response=RolloutResponse,
        summary='Attention rollout per layer and attention flow (Abnar & Zuidema 2020)',
        description="""Attention rollout (Abnar and Zuidema 2020, "Quantifying Attention Flow in
Transformers"; S004): per layer ``Â_l = rownorm((1 - residual) F_l + residual I)`` with
``F_l`` the heads fused by ``fusion`` (after dropping the first-token sink on request and
discarding the lowest ``discard`` fraction), and ``R_l = Â_l ... Â_1``: ``rollout``
float32 ``[layer, query_pos, key_pos]``, rows sum to 1, causal models never put weight on a
later token. ``flow``: networkx maximum flow from each (layer output, query) node to each
input token over the layered graph with capacities Â, rows divided by their sums
``[flow_layer, query_pos, key_pos]``; inputs up to ``flow_max_tokens`` (16) tokens.

Errors: 422 blank text / too many tokens / flow over 16 tokens (the limit named) /
unknown fusion or sink / residual outside [0, 1] / discard outside [0, 1) / layer out of
range / 'tril' on an encoder / memory estimate over ``max_request_bytes``; 406; 413;
429; 503.""",
        plan=plan,
        check=check,
        binary=True,
        tags=('rollout',), order=110,
    ),
]
