"""POST /v1/verify."""

from __future__ import annotations

from fastapi import APIRouter

from attnscope.schemas import VerifyRequest, VerifyResponse
from attnscope.service.analysis.verify import check_supported, verify_from_scratch
from attnscope.service.analysis.verify_recorded import verify as verify_recorded_qkv
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
    summary="Recompute the forward from scratch in float64 and compare it with the served one",
)
async def post_verify(req: VerifyRequest, rt: RuntimeDep, slot: SlotDep):
    """The from-scratch check (DESIGN.md, "verification"), mode ``from_scratch`` (default):
    the forward of each text recomputed in float64 from its token ids, the model's weight
    tensors and its config by the project's own blocks (service/analysis/verify.py: wte+wpe /
    BERT embeddings, LayerNorm with the config's eps, q/k/v projections (GPT-2's Conv1D
    transposed vs Linear), the per-layer scale the config implies, the causal or
    bidirectional mask, softmax, output projection, MLP with the config's activation,
    residuals, ln_f), compared layer by layer with the SERVED pattern (per head, absolute),
    q/k/v, attention output and hidden states (relative to their scale). Reports per layer the
    scale used, the mask kind, the true maxima, the tolerance of the served dtype and the first
    failing layer. A config switch the recomputation does not implement: 422
    ``unsupported_model_config`` naming it. HTTP 200 also when the check fails: read ``passed``.

    Mode ``recorded_qkv``, the cheap check of the attention step alone: for each layer the model's OWN
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
    scratch = rt.adapter.scratch_model() if req.mode == "from_scratch" else None
    if scratch is not None:
        check_supported(scratch)  # 422 naming the switch, before any forward
    items = await tokenize_request(rt, req)
    forwards = await forward_request(rt, slot, items)
    layers = req.layers if req.layers is not None else list(range(rt.adapter.n_layers))

    def work():
        if scratch is not None:
            return [verify_from_scratch(fw.tensors, scratch, fw.tokens.input_ids,
                                        rt.info["dtype"], layers, req.tolerance)
                    for fw in forwards]
        params = {layer: rt.adapter.attention_params(layer) for layer in layers}
        out = []
        for fw in forwards:
            r = verify_recorded_qkv(fw.tensors, params, req.tolerance, req.projections)
            for row in r["layers"]:
                row["scale"] = params[row["layer"]].scaling
            out.append({**r, "mode": "recorded_qkv", "compute_dtype": r["dtype"],
                        "mask": "causal" if rt.adapter.causal else "bidirectional",
                        "failing_layer": r["failed_layers"][0] if r["failed_layers"] else None})
        return out

    results = await on_device(slot, forwards, work)  # on the model's device
    body: dict = {"model": rt.model_ref()}
    res = [{"tokens": [t.as_dict() for t in fw.tokens.tokens], "add_bos": fw.tokens.add_bos, **r}
           for fw, r in zip(forwards, results)]
    if req.text is not None:
        body["verification"] = res[0]
    else:
        body["results"] = res
    return ORJSONResponse(body)
