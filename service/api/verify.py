"""POST /v1/verify."""

from __future__ import annotations

from fastapi import APIRouter

from attnscope.schemas import VerifyRequest, VerifyResponse
from attnscope.service.analysis.verify import verify
from attnscope.service.api.common import error_responses, check_indices, forward_request, tokenize_request
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
    """The from-scratch check. For each layer: the model's own attention input and CURRENT
    weights, split into heads, through the textbook scaled dot-product attention
    (000_1c89b6c8c2a32040.txt), with the causal mask where the model is causal and every
    switch HF's eager attention honours (scaling, ``scale_attn_by_inverse_layer_idx``,
    ``reorder_and_upcast_attn``, the additive finfo.min mask), then the output projection.

    Compared with the model's recorded pattern and attention output: max absolute difference
    per layer and head (pattern) and per layer (output), overall ``max_abs_diff``, the
    ``tolerance`` (default 1e-5 for float32) and ``passed``. A NaN anywhere fails.
    HTTP 200 also when the check fails: read ``passed``.
    """
    check_indices(req.layers, rt.adapter.n_layers, "layers", "layer")
    items = await tokenize_request(rt, req)
    forwards = await forward_request(rt, slot, items)
    layers = req.layers if req.layers is not None else list(range(rt.adapter.n_layers))

    def work():
        out = []
        for fw in forwards:
            params = {layer: rt.adapter.attention_params(layer) for layer in layers}
            t = fw.tensors
            out.append(verify(t.attn_input, t.pattern, t.attn_output, params, req.tolerance))
        return out

    results = await slot.run(work)  # the recomputation runs on the model's device
    body: dict = {"model": rt.model_ref()}
    res = [{"tokens": [t.as_dict() for t in fw.tokens.tokens], **r}
           for fw, r in zip(forwards, results)]
    if req.text is not None:
        body["verification"] = res[0]
    else:
        body["results"] = res
    return ORJSONResponse(body)
