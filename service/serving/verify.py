"""/v1/verify: the served forward against a recomputation (modes from_scratch, recorded_qkv)."""

from __future__ import annotations

from attnscope.schemas import VerifyRequest
from ..analysis.verify import check_supported, verify_from_scratch
from ..analysis.verify_recorded import verify as verify_recorded_qkv
from ..analysis.verify import ScratchModel
from ..analysis.verify_recorded import AttentionParams
from ..runtime import interventions as I
from .core.estimates import verify_bytes
from .core.engine import Plan
from .core.table import Endpoint
from attnscope.schemas import VerifyResponse
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
    if req.mode == "from_scratch" and a.causal:  # the served logits, then 8192 float64 columns
        V = int(rt.info.get("vocab_size") or 0)
        es = next(rt.model.parameters()).element_size()
        est += max((es * len(it) * V + 8 * 8192 * (a.d_model + 2 * len(it)) for it in items),
                   default=0)

    def job(forwards) -> dict:
        if req.mode == "from_scratch":
            scratch = ScratchModel.of(rt.adapter)
            # the served logits: the hooked forward's (every intervention endpoint's blocks,
            # ln_f and LM head), one text at a time
            # rotary families: the frequencies the served forward rotates with (checked
            # against the config's formula; the angles rounded to float32 as it does)
            rotary = getattr(rt.adapter, "rotary", None)
            inv_freq = rotary()["inv_freq"] if callable(rotary) else None
            results = [verify_from_scratch(fw.tensors, scratch, fw.tokens.input_ids,
                                           rt.info["dtype"], layers, req.tolerance,
                                           logits=I.served_logits(rt, fw.tokens.input_ids),
                                           served_inv_freq=inv_freq)
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


ENDPOINTS = [
    Endpoint(
        path='/v1/verify', name='verify',
        request=VerifyRequest, response=VerifyResponse,
        summary='Recompute the forward from scratch in float64 and compare it with the served one',
        description="""The from-scratch check (docs/architecture.md, "Verification"), mode ``from_scratch`` (default):
the forward of each text recomputed in float64 from its token ids, the model's weight
tensors and its config by the project's own blocks (service/analysis/verify.py: wte+wpe /
BERT embeddings, LayerNorm with the config's eps, q/k/v projections (GPT-2's Conv1D
transposed vs Linear), the per-layer scale the config implies, the causal or
bidirectional mask, softmax, output projection, MLP with the config's activation,
residuals, ln_f; for Llama, Mistral, Qwen2, Gemma, Gemma 2 and GPT-NeoX: RoPE with the
config's theta, rope_type default/linear/llama3 and partial rotary, grouped-query attention
as Hugging Face's repeat_kv, RMSNorm (Gemma's 1 + w, sqrt(d_model) embedding scale, Gemma 2's
extra norms and query_pre_attn_scalar), SwiGLU/GeGLU, GPT-NeoX's fused qkv and parallel
residual, per-layer sliding windows, attention and final-logit soft-caps; ``architecture``
says which), compared layer by layer with the SERVED pattern (per head, absolute),
q/k/v (rotary families: after RoPE, k/v on the key/value heads), attention output and hidden
states (relative to their scale); then, for a causal LM,
the served next-token logits (the hooked forward's, the blocks, ln_f and LM head that
/v1/predictions, /v1/ablate, /v1/patch and /v1/run compute with) against the LM head's W_U
applied to the recomputed ln_f output in float64 (Gemma 2: soft-capped; ``logits``, relative to max(1, max
|logit|)). Reports per layer the
scale used, the mask kind, the true maxima, the tolerance of the served dtype and the first
failing layer. A config switch the recomputation does not implement: 422
``unsupported_model_config`` naming it. Cost: about 4-10 forwards' time (float64).

Mode ``recorded_qkv``, the cheap check of the attention step alone: for each layer the
model's OWN q, k, v (recorded by the runtime's hooks on its q/k/v projections) through the
textbook scaled dot-product attention with the model's scaling, the float32 upcast under
``reorder_and_upcast_attn`` and the additive finfo.min causal mask; then the heads merged
through the CURRENT output projection; max absolute differences against the recorded
pattern and attention output (tolerance 1e-5 for float32). ``projections: true`` also
recomputes q/k/v from the recorded attention input with the current weights. Same torch
operations in the model's dtype, so its differences are usually exactly 0: it checks
consistency of the attention step, not the model.

HTTP 200 also when the check fails: read ``passed``. A NaN anywhere fails.""",
        plan=plan,
        check=check,
        tags=('verify',), order=70,
    ),
]
