"""/v1/links: each query token's strongest earlier key token(s)."""

from __future__ import annotations

import numpy as np
import torch

from attnscope.schemas import LinksRequest, LinksResponse
from ..analysis.links import skipped_queries, strongest_links
from ..analysis.verify_recorded import AttentionParams
from .core.estimates import links_bytes
from ..errors import InvalidRequest, NonFiniteValues, OutOfRange, n_tokens
from .core.engine import Plan
from .core.table import Endpoint
from .core.checks import check_distinct, check_index
from .common import text_or_results


def check(rt, req: LinksRequest) -> None:
    """Token-independent checks (before tokenizing): layer/head range, direction, ignore."""
    check_index(req.layer, rt.adapter.n_layers, "layer", "layer")
    check_index(req.head, rt.adapter.n_heads, "head", "head")
    if req.direction == "any" and rt.adapter.causal:
        raise InvalidRequest("direction 'any' applies to encoders only: in this causal model "
                             "no query sees a later key", "direction")
    check_distinct(req.ignore, "ignore")


def plan(rt, req: LinksRequest, items) -> Plan:
    """Checks (``ignore`` positions inside every text) and the job: per text the ``top_k``
    strongest eligible keys of every query in ``layer``'s head mean or ``head``
    (:func:`check` ran before tokenizing)."""
    if req.ignore:
        top = max(req.ignore)
        for i, it in enumerate(items):
            if top >= len(it):
                j, top = next((j, p) for j, p in enumerate(req.ignore) if p >= len(it))
                where = req.input_param(i)
                raise OutOfRange(f"ignore[{j}] = {top} is out of range: {where} has "
                                 f"{n_tokens(len(it))} (valid positions 0..{len(it) - 1})",
                                 f"ignore.{j}")

    def job(forwards) -> dict:
        out = _build(req, forwards, rt)
        body = {"model": rt.model_ref(), "layer": req.layer, "head": req.head,
                "direction": req.direction, "by": req.by}
        return text_or_results(req, body, "links", out)

    est = links_bytes([len(it) for it in items], req.top_k, rt.adapter.n_heads)
    return Plan(items, job, est, small_ops=True)


def _build(req: LinksRequest, forwards, rt=None) -> list[dict]:
    out = []
    for fw in forwards:
        pattern = fw.pattern[req.layer]  # [head, query_pos, key_pos]
        weights = pattern.mean(0) if req.head is None else pattern[req.head]
        if not torch.isfinite(weights).all():
            raise NonFiniteValues(f"layer {req.layer}'s attention holds NaN/inf; refusing to rank it")
        rank = weights
        if req.by == "norm":  # Kobayashi et al. 2020: rank by ||alpha f(x)||
            rank = _norms(rt, fw, req.layer, req.head)
            if not torch.isfinite(rank).all():
                raise NonFiniteValues(f"layer {req.layer}'s value vectors hold NaN/inf; "
                                      "refusing to rank by norm")
        found = strongest_links(rank, req.top_k, req.exclude_self, req.ignore, req.direction)
        # the weights of norm-ranked links (float64 holds every float32/16 value exactly;
        # rows become lists one at a time: no GIL-holding tolist() of the whole matrix)
        w = weights.detach().to("cpu", torch.float64).numpy() if req.by == "norm" else None
        labels = [t.label for t in fw.tokens.tokens]
        # float32 weights as their shortest round-tripping decimal (as orjson writes float32)
        rnd = ((lambda w: round(w, req.round)) if req.round is not None
               else (lambda w: float(str(np.float32(w)))))
        out.append({
            "tokens": [t.as_dict() for t in fw.tokens.tokens],
            "links": [{"query_pos": ql.query_pos, "query": labels[ql.query_pos],
                       "links": _targets(ql, labels, rnd, w)} for ql in found],
            "skipped": skipped_queries(fw.n_tokens, found),
        })
    return out


def _targets(ql, labels, rnd, weights) -> list[dict]:
    """One query's links. Ranked by weight (``weights`` None): ``ql.weights`` are the
    attention weights; ranked by norm: ``ql.weights`` are the norms and ``weights[q][key]``
    the attention weights. Dicts of ints, strings and floats only, which the cyclic garbage
    collector does not track (no full collections set off by a million-link body)."""
    if weights is None:
        return [{"key_pos": k, "key": labels[k], "weight": rnd(v)}
                for k, v in zip(ql.keys, ql.weights)]
    row = weights[ql.query_pos].tolist()
    return [{"key_pos": k, "key": labels[k], "weight": rnd(row[k]), "norm": rnd(v)}
            for k, v in zip(ql.keys, ql.weights)]


def _norms(rt, fw, layer: int, head: int | None) -> torch.Tensor:
    """Contribution norms of one layer ``[query_pos, key_pos]`` (default biases): one head's
    ||alpha f|| or the layer's ||sum_h alpha f|| (head None)."""
    from ..analysis.norms import layer_norms

    p = AttentionParams.of(rt.adapter, layer)
    res = layer_norms(fw.pattern[layer], fw.tensors.v[layer], p.W_o, p.b_v, p.b_o,
                      heads=None if head is None else [head], per_head=head is not None,
                      summed=head is None)
    return res.summed if head is None else res.head[0]


ENDPOINTS = [
    Endpoint(
        path='/v1/links', name='links',
        request=LinksRequest, response=LinksResponse,
        summary='Strongest earlier link(s) of every query token',
        description="""For each query token, its ``top_k`` strongest eligible key tokens in one layer's head
mean (``head`` null) or one head, as ``strongest_previous_token`` in
000_1c89b6c8c2a32040.txt defines it: future keys never count, self excluded by default,
``ignore`` positions never chosen, a query with no eligible key is skipped (listed in
``skipped``). ``weight`` = attention weight in [0, 1]. Encoders: ``direction`` 'any'
lets later keys count too.

Errors: 422 layer/head/ignore out of range, 'any' on a causal model, too many tokens;
413; 429; 503.""",
        plan=plan,
        check=check,
        invalid="Invalid request: layer/head/ignore position out of range, direction 'any' on a causal model, too many tokens.",
        tags=('links',), order=50,
    ),
]
