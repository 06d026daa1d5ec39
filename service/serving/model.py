"""GET /v1/model: the resident model's identity and shape."""

from __future__ import annotations

from attnscope.schemas import ModelInfo

from .core.table import Endpoint


async def model_info(engine, req=None) -> ModelInfo:
    """``ModelInfo`` of the resident model (503 ``not_ready`` until it is loaded)."""
    return ModelInfo(**engine.runtime.info)


ENDPOINTS = [
    Endpoint(
        path='/v1/model', name='model',
        request=None, response=ModelInfo,
        summary='The resident model',
        description="""Identity and shape of the resident model: id, revision, architecture, causal or not,
n_layers, n_heads, n_kv_heads, d_model, d_head, n_ctx, vocab size, device, dtype, and whether the
bundled checkpoint was loaded as a fallback for the requested model; ``attention``: how the
family builds attention (positions learned or rotary, rotary_dim/fraction, rope theta and
scaling, key/value heads and the query-head -> key/value-head map, sliding windows per layer,
attention and final logit soft-caps, norm kind, parallel residual, q/k/v bias, scaling).""",
        handler=model_info,
        tags=('model',), order=10,
    ),
]
