"""POST /v1/verify."""

from __future__ import annotations

from fastapi import APIRouter

from attnscope.schemas import VerifyRequest, VerifyResponse
from attnscope.service.analysis.verify import verify
from attnscope.service.api.common import (
    check_indices,
    error_responses,
    forward_request,
    on_device,
    tokenize_request,
)
from attnscope.service.deps import RuntimeDep, SlotDep
from attnscope.service.encoding import ORJSONResponse

router = APIRouter(tags=["verify"])

ERRORS = error_responses()


@router.post(
    "/v1/verify",
    response_model=VerifyResponse,
    responses=ERRORS,
    summary="Recompute every layer's attention from scratch and compare with the model's",
)
async def post_verify(req: VerifyRequest, rt: RuntimeDep, slot: SlotDep):
    """The from-scratch check (DESIGN.md, "verification"). For each layer: the model's OWN
    q, k, v (recorded by the runtime's hooks on its q/k/v projections) through the textbook
    scaled dot-product attention (000_1c89b6c8c2a32040.txt) with the model's scaling, the
    float32 upcast under ``reorder_and_upcast_attn`` and the additive finfo.min causal mask
    where the model is causal; then the heads merged through the CURRENT output projection.

    Compared with the model's recorded pattern and attention output: max absolute difference
    per layer and head (pattern) and per layer (output), overall ``max_abs_diff``, the
    ``tolerance`` (default 1e-5 for float32) and ``passed``. A NaN anywhere fails.
    ``projections: true`` also recomputes q/k/v from the recorded attention input with the
    current weights (``qkv_max_abs_diff``, counts toward ``passed``): three more
    d_model x d_model matmuls per layer, about 3x the default's time (GPT-2 small, T=128:
    ~20 ms default vs ~60 ms on 2 CPU cores). The default does not see a change of the q/k/v
    weights made after the forward (the recorded q/k/v are what the model used); it does see
    a change of the output projection. HTTP 200 also when the check fails: read ``passed``.
    """
    check_indices(req.layers, rt.adapter.n_layers, "layers", "layer")
    items = await tokenize_request(rt, req)
    forwards = await forward_request(rt, slot, items)
    layers = req.layers if req.layers is not None else list(range(rt.adapter.n_layers))

    def work():
        params = {layer: rt.adapter.attention_params(layer) for layer in layers}
        return [verify(fw.tensors, params, req.tolerance, req.projections) for fw in forwards]

    results = await on_device(slot, forwards, work)  # on the model's device
    body: dict = {"model": rt.model_ref()}
    res = [{"tokens": [t.as_dict() for t in fw.tokens.tokens], **r}
           for fw, r in zip(forwards, results)]
    if req.text is not None:
        body["verification"] = res[0]
    else:
        body["results"] = res
    return ORJSONResponse(body)
