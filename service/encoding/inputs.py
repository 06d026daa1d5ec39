"""Tensors given in requests (``/v1/run``'s ``vector`` / ``value``): nested JSON lists or the
base64 form ``{"encoding": "base64", "dtype", "shape", "data"}`` (little-endian) -> a float32
numpy array. The one place request tensors are decoded (the other direction: :mod:`.codecs`)."""

from __future__ import annotations

import binascii
import math
from typing import Any

import numpy as np
import pybase64

from ..errors import InvalidRequest

#: the element types a request tensor may have: activations, read as float32 (an integer
#: dtype is refused rather than converted: docs/api.md, "/v1/run")
_DTYPES = {"float32": "<f4", "float16": "<f2"}

#: at most this many elements in one request tensor
MAX_ELEMENTS = 1 << 26


def decode_input(x: Any, param: str) -> np.ndarray:
    """``x`` (nested lists of numbers, or an object with ``encoding`` 'base64', ``dtype``,
    ``shape`` and ``data``; pydantic models are read by attribute) as a float32 array of its
    shape. Raises :class:`InvalidRequest` (``param``) for ragged lists, bad base64, a byte
    count that is not the shape's, more than :data:`MAX_ELEMENTS` elements, or a non-finite
    value."""
    if getattr(x, "encoding", None) == "base64" or (isinstance(x, dict)
                                                    and x.get("encoding") == "base64"):
        get = x.get if isinstance(x, dict) else (lambda k, d=None: getattr(x, k, d))
        dtype, shape, data = get("dtype"), list(get("shape") or []), get("data") or ""
        if get("layout", "full") not in (None, "full"):
            raise InvalidRequest(f"{param}: only layout 'full' is accepted in requests", param)
        if dtype not in _DTYPES:
            raise InvalidRequest(f"{param}.dtype: {dtype!r} is not one of {sorted(_DTYPES)} "
                                 "(request tensors are activations, read as float32)",
                                 f"{param}.dtype")
        # math.prod on Python ints: numpy's int64 product wraps (2**32 x 2**32 x 2**32 -> 0)
        if any(s < 0 for s in shape) or math.prod(shape) > MAX_ELEMENTS:
            raise InvalidRequest(f"{param}: shape {shape} (at most {MAX_ELEMENTS} elements)",
                                 param)
        n = math.prod(shape)
        try:
            raw = pybase64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(f"{param}: data is not valid base64", param) from None
        width = np.dtype(_DTYPES[dtype]).itemsize
        if len(raw) != n * width:
            raise InvalidRequest(f"{param}: {len(raw)} bytes of data; shape {shape} in {dtype} "
                                 f"needs {n * width}", param)
        a = np.frombuffer(raw, _DTYPES[dtype]).reshape(shape).astype(np.float32)
    else:
        try:
            a = np.asarray(x, dtype=np.float32)
        except (ValueError, TypeError):
            raise InvalidRequest(f"{param}: a tensor's nested lists must be rectangular "
                                 "(every row of an axis the same length)", param) from None
        if a.size > MAX_ELEMENTS:
            raise InvalidRequest(f"{param}: {a.size} elements (at most {MAX_ELEMENTS})", param)
    if not np.isfinite(a).all():
        raise InvalidRequest(f"{param}: the tensor holds a non-finite value (NaN or inf); a "
                             "float16 value past 65504 overflows", param)
    return a
