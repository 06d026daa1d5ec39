"""/v1/verify: the served forward against a recomputation (modes from_scratch, recorded_qkv)."""

from __future__ import annotations

from attnscope.schemas import VerifyRequest
from ..analysis.verify import check_supported, verify_from_scratch
from ..analysis.verify_recorded import verify as verify_recorded_qkv
from ..analysis.verify import ScratchModel
from ..analysis.verify_recorded import AttentionParams
from .core.estimates import verify_bytes
from .core.engine import Plan
from .core.checks import check_indices
from .common import text_or_results


def check(rt, req: VerifyRequest) -> None:
    """``layers`` in range and distinct (422); for ``from_scratch`` every config switch
    implemented (422 ``unsupported_model_config`` naming it), before any forward."""
    check_indices(req.layers, rt.adapter.n_layers, "layers", "layer")
    if req.mode == "from_scratch":
        check_supported(ScratchModel.of(rt.adapter))


def plan(rt, req: VerifyRequest, items) -> Plan:
    """The job: per text the verification report of the selected layers. ``from_scratch``
    holds one layer's float64 recomputation at a time: its pattern ``8 * H * T^2`` bytes."""
    layers = req.layers if req.layers is not None else list(range(rt.adapter.n_layers))
    a = rt.adapter
    est = max((8 * (a.n_heads * len(it) ** 2 + 12 * len(it) * a.d_model) for it in items), default=0)

    def job(forwards) -> dict:
        if req.mode == "from_scratch":
            scratch = ScratchModel.of(rt.adapter)
            results = [verify_from_scratch(fw.tensors, scratch, fw.tokens.input_ids,
                                           rt.info["dtype"], layers, req.tolerance)
                       for fw in forwards]
        else:
            params = {layer: AttentionParams.of(rt.adapter, layer) for layer in layers}
            results = []
            for fw in forwards:
                r = verify_recorded_qkv(fw.tensors, params, req.tolerance, req.projections)
                for row in r["layers"]:
                    row["scale"] = params[row["layer"]].scaling
                results.append({
                    **r, "mode": "recorded_qkv", "compute_dtype": r["dtype"],
                    "mask": "causal" if rt.adapter.causal else "bidirectional",
                    "failing_layer": r["failed_layers"][0] if r["failed_layers"] else None,
                })
        res = [{"tokens": [t.as_dict() for t in fw.tokens.tokens], "add_bos": fw.tokens.add_bos,
                **r} for fw, r in zip(forwards, results)]
        body: dict = {"model": rt.model_ref()}
        return text_or_results(req, body, "verification", res)

    # the recorded_qkv work and the report (encoding layer), plus one float64 layer at a time
    est += verify_bytes([len(it) for it in items], len(layers), a.n_heads, a.d_model,
                        req.projections)
    return Plan(items, job, response_bytes=est)
