"""POST /v1/links: each query token's strongest earlier key token(s)."""

from __future__ import annotations

import numpy as np
import torch
from fastapi import APIRouter

from attnscope.schemas import LinksRequest, LinksResponse
from attnscope.service.analysis.links import skipped_queries, strongest_links
from attnscope.service.api.common import (
    check_distinct,
    check_index,
    error_responses,
    forward_request,
    on_device,
    tokenize_request,
)
from attnscope.service.deps import RuntimeDep, SlotDep
from attnscope.service.encoding import ORJSONResponse
from attnscope.service.errors import InvalidRequest, NonFiniteValues, OutOfRange

router = APIRouter(tags=["links"])

ERRORS = error_responses(
    "Invalid request: layer/head/ignore position "
    "out of range, direction 'any' on a causal model, too many tokens.")


@router.post("/v1/links", response_model=LinksResponse, responses=ERRORS,
             summary="Strongest earlier link(s) of every query token")
async def links(req: LinksRequest, rt: RuntimeDep, slot: SlotDep):
    """For each query token, its ``top_k`` strongest eligible key tokens in one layer's head
    mean (``head`` null) or one head, as ``strongest_previous_token`` in
    000_1c89b6c8c2a32040.txt defines it: future keys never count, self excluded by default,
    ``ignore`` positions never chosen, a query with no eligible key is skipped (listed in
    ``skipped``). ``weight`` = attention weight in [0, 1]. Encoders: ``direction`` 'any'
    lets later keys count too.

    Errors: 422 layer/head/ignore out of range, 'any' on a causal model, too many tokens;
    413; 429; 503.
    """
    check_index(req.layer, rt.adapter.n_layers, "layer", "layer")
    check_index(req.head, rt.adapter.n_heads, "head", "head")
    if req.direction == "any" and rt.adapter.causal:
        raise InvalidRequest("direction 'any' applies to encoders only: in this causal model "
                             "no query sees a later key", "direction")
    check_distinct(req.ignore, "ignore")
    items = await tokenize_request(rt, req)
    if req.ignore:
        top = max(req.ignore)
        for i, it in enumerate(items):
            if top >= len(it):
                j, top = next((j, p) for j, p in enumerate(req.ignore) if p >= len(it))
                where = "text" if req.text is not None else f"texts.{i}"
                raise OutOfRange(f"ignore[{j}] = {top} is out of range: {where} has {len(it)} "
                                 f"tokens (valid positions 0..{len(it) - 1})", f"ignore.{j}")
    forwards = await forward_request(rt, slot, items)
    # ranking and building up to top_k x T links per text: on the device thread (torch work)
    out = await on_device(slot, forwards, _build, req, forwards, rt)
    body = {"model": rt.model_ref(), "layer": req.layer, "head": req.head,
            "direction": req.direction, "by": req.by}
    if req.text is not None:
        body["links"] = out[0]
    else:
        body["results"] = out
    return ORJSONResponse(body)


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
        w = weights.tolist() if req.by == "norm" else None  # the weights of norm-ranked links
        labels = [t.label for t in fw.tokens.tokens]
        # float32 weights as their shortest round-tripping decimal (as orjson writes float32)
        rnd = ((lambda w: round(w, req.round)) if req.round is not None
               else (lambda w: float(str(np.float32(w)))))
        out.append({
            "tokens": [t.as_dict() for t in fw.tokens.tokens],
            "links": [{"query_pos": ql.query_pos, "query": labels[ql.query_pos],
                       "links": [_target(ql.query_pos, k, labels, rnd, w) for k in ql.links]}
                      for ql in found],
            "skipped": skipped_queries(fw.n_tokens, found),
        })
    return out


def _target(q: int, link, labels, rnd, weights) -> dict:
    """One link. Ranked by weight (``weights`` None): ``link.weight`` is the attention weight;
    ranked by norm: ``link.weight`` is the norm and ``weights[q][key]`` the attention weight."""
    k = link.key_pos
    if weights is None:
        return {"key_pos": k, "key": labels[k], "weight": rnd(link.weight)}
    return {"key_pos": k, "key": labels[k], "weight": rnd(weights[q][k]), "norm": rnd(link.weight)}


def _norms(rt, fw, layer: int, head: int | None) -> torch.Tensor:
    """Contribution norms of one layer ``[query_pos, key_pos]`` (default biases): one head's
    ||alpha f|| or the layer's ||sum_h alpha f|| (head None)."""
    from attnscope.service.analysis.norms import layer_norms

    p = rt.adapter.attention_params(layer)
    res = layer_norms(fw.pattern[layer], fw.tensors.v[layer], p.W_o, p.b_v, p.b_o,
                      heads=None if head is None else [head], per_head=head is not None,
                      summed=head is None)
    return res.summed if head is None else res.head[0]
