"""POST /v1/attention."""

from __future__ import annotations

from fastapi import APIRouter

from attnscope.schemas import AttentionRequest, AttentionResponse, ErrorResponse
from attnscope.service.analysis.attention import select_heads
from attnscope.service.api.common import check_indices, forward_request, tokenize_request
from attnscope.service.deps import RuntimeDep, SlotDep
from attnscope.service.encoding import ORJSONResponse, encode_tensor

router = APIRouter(tags=["attention"])

ERRORS = {
    413: {"model": ErrorResponse, "description": "Request body too large."},
    422: {"model": ErrorResponse, "description": "Invalid request (field, limit and value named)."},
    429: {"model": ErrorResponse, "description": "Overloaded: the device queue is full."},
    503: {"model": ErrorResponse, "description": "The model is not loaded yet."},
}


@router.post(
    "/v1/attention",
    response_model=AttentionResponse,
    responses=ERRORS,
    summary="Attention patterns (and optionally pre-softmax scores) per layer and head",
)
async def attention(req: AttentionRequest, rt: RuntimeDep, slot: SlotDep):
    """Attention of the resident model for ``text`` (response field ``attention``) or
    ``texts`` (response field ``results``, in order).

    ``pattern``: float32 post-softmax weights ``[layer, head, query_pos, key_pos]`` (or
    ``[layer, query_pos, key_pos]`` with ``head_mean``), equal to Hugging Face's
    ``output_attentions``. ``scores`` (``include_scores``): pre-softmax ``q.k * scaling``, masked
    entries null/-inf. Source: Vaswani et al. 2017; 000_1c89b6c8c2a32040.txt.

    Errors: 422 blank text / too many tokens / layer or head out of range / batch over
    ``max_batch``; 413 body too large; 429 overloaded; 503 not ready.
    """
    check_indices(req.layers, rt.adapter.n_layers, "layers", "layer")
    check_indices(req.heads, rt.adapter.n_heads, "heads", "head")
    items = await tokenize_request(rt, req)
    forwards = await forward_request(rt, slot, items)
    layers = req.layers if req.layers is not None else list(range(rt.adapter.n_layers))
    heads = req.heads if req.heads is not None else list(range(rt.adapter.n_heads))
    out = []
    for i, fw in enumerate(forwards):
        pfx = "attention" if req.text is not None else f"results.{i}"
        pattern = select_heads(fw.pattern, req.layers, req.heads, req.head_mean)
        res = {
            "tokens": [t.as_dict() for t in fw.tokens.tokens],
            "layers": layers,
            "heads": heads,
            "head_mean": req.head_mean,
            "pattern": encode_tensor(pattern, req.encoding, req.dtype, req.round, f"{pfx}.pattern"),
            "scores": None,
        }
        if req.include_scores:
            scores = select_heads(fw.scores(layers), None, req.heads, req.head_mean)
            res["scores"] = encode_tensor(
                scores, req.encoding, req.dtype, req.round, f"{pfx}.scores", allow_neg_inf=True
            )
        out.append(res)
    body: dict = {"model": rt.model_ref()}
    if req.text is not None:
        body["attention"] = out[0]
    else:
        body["results"] = out
    return ORJSONResponse(body)
