"""/v1/verify: every layer's attention recomputed and compared with the served one."""

from __future__ import annotations

from attnscope.schemas import VerifyRequest
from attnscope.service.analysis.verify import verify
from attnscope.service.runtime.engine import Plan
from attnscope.service.serving.checks import check_indices


def check(rt, req: VerifyRequest) -> None:
    """``layers`` in range and distinct (422)."""
    check_indices(req.layers, rt.adapter.n_layers, "layers", "layer")


def plan(rt, req: VerifyRequest, items) -> Plan:
    """The job: per text the verification report of the selected layers."""
    layers = req.layers if req.layers is not None else list(range(rt.adapter.n_layers))

    def job(forwards) -> dict:
        params = {layer: rt.adapter.attention_params(layer) for layer in layers}
        res = [{"tokens": [t.as_dict() for t in fw.tokens.tokens],
                **verify(fw.tensors, params, req.tolerance, req.projections)}
               for fw in forwards]
        body: dict = {"model": rt.model_ref()}
        if req.text is not None:
            body["verification"] = res[0]
        else:
            body["results"] = res
        return body

    return Plan(items, job)
