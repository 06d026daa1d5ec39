"""The one dependency that reaches the resident model (full-stack-fastapi-template api/deps.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from .errors import NotReady
from .runtime import Runtime
from .serving.core.engine import Engine
from .serving.core.slot import DeviceSlot


# async: FastAPI runs a plain ``def`` dependency in its thread pool (~1-2 ms per request
# under load); these only read app state.
async def get_runtime(request: Request) -> Runtime:
    rt = getattr(request.app.state, "runtime", None)
    if rt is None:
        err = getattr(request.app.state, "load_error", None)
        raise NotReady(
            "the model is not loaded" + (f": {err}" if err else " yet; retry shortly")
        )
    return rt


async def get_slot(request: Request) -> DeviceSlot:
    return request.app.state.slot


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
SlotDep = Annotated[DeviceSlot, Depends(get_slot)]


async def get_engine(request: Request) -> Engine:
    """The app's engine (runtime, device slot, memory limit, metrics): the one call a
    /v1 endpoint makes (service/serving/core/engine.py)."""
    return request.app.state.engine


EngineDep = Annotated[Engine, Depends(get_engine)]
