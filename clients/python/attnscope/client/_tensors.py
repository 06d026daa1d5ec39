"""Tensors off the wire: ``.numpy()`` on every tensor field of a response.

The service sends a tensor either as nested JSON lists (encoding ``json``; masked entries of
pre-softmax scores are ``null``) or as ``{"encoding": "base64", "dtype", "shape", "data"}``
with little-endian bytes (masked entries ``-inf``). See README "Tensors on the wire" and
``service/encoding.py``. After parsing a response, the client wraps every such field so that
``result.pattern.numpy()`` works either way:

* a JSON list becomes a :class:`JsonTensor` (a ``list`` subclass: it still compares equal to,
  and serialises as, the plain list);
* a base64 object becomes a :class:`EncodedTensor` (a subclass of the schema's
  ``Base64Tensor``).

Both give a C-contiguous ``numpy.ndarray`` of the wire shape; JSON ``null`` -> ``-inf``.
"""

from __future__ import annotations

import base64
import typing
from typing import Any

import numpy as np
from pydantic import BaseModel

from attnscope.schemas.common import Base64Tensor

_NP = {"float32": "<f4", "float16": "<f2", "float64": "<f8", "int32": "<i4", "int64": "<i8"}


def to_numpy(value: Any, dtype: Any = None) -> np.ndarray:
    """Decode one wire tensor to numpy.

    Args:
        value: nested lists (``null`` = masked -> ``-inf``), a base64 dict / model
            (``{"dtype", "shape", "data"}``), or anything ``numpy.asarray`` takes.
        dtype: result dtype; default float32 for JSON lists (the service computes in
            float32), the wire dtype (float32/float16, native byte order) for base64.

    Returns:
        ndarray of the tensor's shape (JSON: the nesting depth; base64: ``shape``).

    Raises:
        ValueError: ragged lists, or base64 data whose length does not match dtype x shape.
    """
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, dict) and value.get("encoding", "base64") == "base64" and "data" in value:
        wire = _NP.get(str(value.get("dtype")))
        if wire is None:
            raise ValueError(f"unknown tensor dtype {value.get('dtype')!r}")
        raw = base64.b64decode(value["data"])
        shape = tuple(int(s) for s in value["shape"])
        a = np.frombuffer(raw, dtype=wire)
        if a.size != int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"base64 tensor holds {a.size} elements, shape {list(shape)} needs "
                             f"{int(np.prod(shape))}")
        a = a.reshape(shape).astype(np.dtype(wire).newbyteorder("="))
        return a.astype(dtype) if dtype is not None else a
    try:
        a = np.array(value, dtype=np.float64)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not a rectangular numeric tensor: {exc}") from exc
    nan = np.isnan(a)
    if nan.any():  # the service never sends NaN: a null is a masked (-inf) entry
        a[nan] = -np.inf
    return np.ascontiguousarray(a.astype(dtype if dtype is not None else np.float32))


class JsonTensor(list):
    """A tensor sent as nested JSON lists. A plain ``list`` with a :meth:`numpy` method."""

    def numpy(self, dtype: Any = None) -> np.ndarray:
        """The tensor as an ndarray (float32 by default; ``null`` entries -> ``-inf``)."""
        return to_numpy(list(self), dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.numpy().shape


class EncodedTensor(Base64Tensor):
    """A tensor sent base64-encoded, with a :meth:`numpy` method."""

    def numpy(self, dtype: Any = None) -> np.ndarray:
        """The tensor as an ndarray of ``shape`` and the wire dtype (masked entries ``-inf``)."""
        return to_numpy(self.model_dump(), dtype)


def _is_tensor_annotation(ann: Any) -> bool:
    if ann is Base64Tensor or (isinstance(ann, type) and issubclass(ann, Base64Tensor)):
        return True
    return any(_is_tensor_annotation(a) for a in typing.get_args(ann))


def _wrap_value(v: Any) -> Any:
    if isinstance(v, Base64Tensor) and not isinstance(v, EncodedTensor):
        return EncodedTensor.model_validate(v.model_dump())
    if isinstance(v, dict) and "data" in v and "shape" in v:
        return EncodedTensor.model_validate(v)
    if isinstance(v, list) and not isinstance(v, JsonTensor):
        return JsonTensor(v)
    return v


def attach_numpy(obj: Any) -> Any:
    """Walk a parsed response and wrap every tensor field (annotated with ``TensorField`` /
    ``Base64Tensor`` in the schema) so it has ``.numpy()``. Works for any schema module that
    uses ``attnscope.schemas.common.TensorField``. Returns ``obj`` (changed in place)."""
    if isinstance(obj, BaseModel):
        for name, field in type(obj).model_fields.items():
            v = getattr(obj, name, None)
            if v is None:
                continue
            if _is_tensor_annotation(field.annotation) and _is_direct_tensor(field.annotation):
                obj.__dict__[name] = _wrap_value(v)
            elif _is_tensor_annotation(field.annotation) and isinstance(v, (list, dict)):
                # e.g. list[TensorField] / dict[str, TensorField]: wrap the elements
                if isinstance(v, list):
                    obj.__dict__[name] = [_wrap_value(x) for x in v]
                else:
                    obj.__dict__[name] = {k: _wrap_value(x) for k, x in v.items()}
            else:
                attach_numpy(v)
    elif isinstance(obj, list):
        for x in obj:
            attach_numpy(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            attach_numpy(x)
    return obj


def _is_direct_tensor(ann: Any) -> bool:
    """True when ``ann`` is TensorField itself (optionally ``| None``), not a container of it."""
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    origin = typing.get_origin(ann)
    if origin in (list, dict):
        return False
    if ann is Base64Tensor:
        return True
    # Union[Base64Tensor, list[Any]] or Optional of it
    if any(a is Base64Tensor for a in args):
        return True
    return any(_is_direct_tensor(a) for a in args if typing.get_origin(a) not in (list, dict))
