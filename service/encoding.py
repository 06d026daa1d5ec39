"""Tensors become JSON in exactly one place (CONVENTIONS.md).

Two encodings: ``json`` (nested lists through orjson's numpy support, rounding done in numpy)
and ``base64`` (``{"encoding": "base64", "dtype", "shape", "data"}``, little-endian bytes).
NaN/inf never reach JSON silently: a non-finite value where none is allowed raises
:class:`NonFiniteValues`; entries declared masked (``allow_neg_inf``) are ``-inf`` and become
``null`` in JSON (orjson writes non-finite floats as null) and stay ``-inf`` in base64.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import orjson
import torch
from fastapi.responses import Response

from attnscope.service.errors import NonFiniteValues

_NP = {"float32": "<f4", "float16": "<f2"}


def to_numpy(t: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach()
        if t.dtype in (torch.float16, torch.bfloat16):
            t = t.float()
        return t.cpu().numpy()
    return np.asarray(t)


def encode_tensor(
    t: torch.Tensor | np.ndarray,
    encoding: str = "json",
    dtype: str = "float32",
    round_: int | None = None,
    name: str = "tensor",
    allow_neg_inf: bool = False,
) -> Any:
    """Encode one tensor for the wire.

    Args:
        t: any float tensor/array.
        encoding: 'json' -> numpy array (orjson writes nested lists); 'base64' -> dict.
        dtype: wire dtype for base64 ('float32' or 'float16').
        round_: decimals for json (numpy round-half-even), None = full precision.
        name: the response field, for error messages.
        allow_neg_inf: -inf marks masked entries (pre-softmax scores) and is allowed.

    Raises:
        NonFiniteValues: NaN or +inf (or -inf where not allowed) in ``t``.
    """
    a = to_numpy(t)
    if a.dtype.kind == "f":
        finite = np.isfinite(a)
        if not finite.all():
            bad = ~finite
            if allow_neg_inf:
                bad &= ~np.isneginf(a)
            if bad.any():
                raise NonFiniteValues(
                    f"{name} holds {int(bad.sum())} non-finite values (NaN or inf) computed by "
                    f"the model (dtype {a.dtype}); refusing to send them"
                )
    if encoding == "base64":
        b = np.ascontiguousarray(a, dtype=_NP[dtype])
        return {
            "encoding": "base64",
            "dtype": dtype,
            "shape": list(b.shape),
            "data": base64.b64encode(b.tobytes()).decode("ascii"),
        }
    if a.dtype.kind == "f":
        if a.dtype not in (np.float32, np.float64):
            a = a.astype(np.float32)
        if round_ is not None:
            a = np.round(a, round_)
    return np.ascontiguousarray(a)


def dumps(content: Any) -> bytes:
    return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)


class ORJSONResponse(Response):
    """JSON response rendered by orjson (numpy-aware)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)
