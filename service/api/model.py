"""GET /v1/model."""

from __future__ import annotations

from fastapi import APIRouter

from attnscope.schemas import ModelInfo
from ..deps import RuntimeDep

router = APIRouter(tags=["model"])


@router.get("/v1/model", response_model=ModelInfo, summary="The resident model")
async def model_info(rt: RuntimeDep) -> ModelInfo:
    """Identity and shape of the resident model: id, revision, architecture, causal or not,
    n_layers, n_heads, d_model, d_head, n_ctx, vocab size, device, dtype, and whether the
    bundled checkpoint was loaded as a fallback for the requested model."""
    return ModelInfo(**rt.info)
