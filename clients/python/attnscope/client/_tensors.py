"""Tensors off the wire: ``.numpy()`` on every tensor field of a response.

A tensor field (``attnscope.schemas.common.TensorField``) arrives in one of the forms that
``service/encoding/codecs.py`` writes and :mod:`attnscope.client.wire` decodes (README
"Tensors on the wire"): nested JSON lists (``null`` = masked -> ``-inf``), ``Base64Tensor``
(little-endian bytes, optionally ``layout`` 'tril'), ``TrilTensor``, ``SparseTensor``, or
``BinaryTensorRef`` (a binary ``application/x-safetensors`` response). After parsing a
response, the client wraps every such field so that ``result.pattern.numpy()`` works for all
of them:

* a JSON list becomes a :class:`JsonTensor` (a ``list`` subclass: it still compares equal to,
  and serialises as, the plain list);
* a tensor object becomes a subclass of its schema class with a ``numpy()`` method
  (:class:`EncodedTensor` for base64); a binary ref also keeps the response's arrays.

``numpy()`` gives the logical shape: JSON lists and sparse/tril forms float32, base64/binary
their wire dtype (float16/float32, native byte order); masked scores ``-inf``.
"""

from __future__ import annotations

import typing
from typing import Any, Mapping

import numpy as np
from pydantic import BaseModel, PrivateAttr

from . import wire
from attnscope.schemas.common import Base64Tensor

try:  # the other wire forms (present in schemas since the wire-encodings work)
    from attnscope.schemas.common import BinaryTensorRef, SparseTensor, TrilTensor

    TENSOR_MODELS: tuple[type[BaseModel], ...] = (Base64Tensor, SparseTensor, TrilTensor,
                                                  BinaryTensorRef)
except ImportError:  # pragma: no cover
    TENSOR_MODELS = (Base64Tensor,)


def to_numpy(value: Any, dtype: Any = None,
             arrays: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """Decode one wire tensor to numpy (any form; see :func:`attnscope.client.wire.decode_tensor`).

    Args:
        value: nested lists (``null`` = masked -> ``-inf``), or a dict / schema model of a
            base64, tril, sparse or binary tensor.
        dtype: convert the result to this dtype (default: float32 for JSON lists, sparse and
            tril; the wire dtype for base64 and binary).
        arrays: the named arrays of a binary response (needed for binary refs).

    Returns:
        ndarray of the tensor's logical shape.

    Raises:
        ValueError: ragged lists, an unknown form or dtype, or data not matching the shape.
    """
    a = wire.decode_tensor(value, arrays)
    return a.astype(dtype) if dtype is not None else a


class JsonTensor(list):
    """A tensor sent as nested JSON lists: a plain ``list`` with a :meth:`numpy` method."""

    def numpy(self, dtype: Any = None) -> np.ndarray:
        """The tensor as an ndarray (float32 by default; ``null`` entries -> ``-inf``)."""
        return to_numpy(list(self), dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.numpy().shape


class _NumpyMixin:
    """``numpy()`` for a tensor schema model; binary refs carry the response's arrays."""

    def numpy(self, dtype: Any = None) -> np.ndarray:
        """The tensor as an ndarray of its logical shape (see the module docstring)."""
        return to_numpy(self, dtype, getattr(self, "_attnscope_arrays", None))


class EncodedTensor(_NumpyMixin, Base64Tensor):
    """A tensor sent base64-encoded, with a :meth:`numpy` method."""

    _attnscope_arrays: Any = PrivateAttr(default=None)


_WRAPPED: dict[type, type] = {Base64Tensor: EncodedTensor}


def _wrapper_class(cls: type) -> type:
    if cls not in _WRAPPED:
        _WRAPPED[cls] = type(cls.__name__, (_NumpyMixin, cls), {
            "__module__": __name__, "_attnscope_arrays": PrivateAttr(default=None)})
    return _WRAPPED[cls]


def _wrap_value(v: Any, arrays: Mapping[str, np.ndarray] | None) -> Any:
    if isinstance(v, _NumpyMixin):
        return v
    if isinstance(v, TENSOR_MODELS):
        w = _wrapper_class(type(v)).model_validate(v.model_dump())
        w._attnscope_arrays = arrays
        return w
    if isinstance(v, list) and not isinstance(v, JsonTensor):
        return JsonTensor(v)
    return v


def _is_tensor_annotation(ann: Any) -> bool:
    if isinstance(ann, type) and issubclass(ann, TENSOR_MODELS):
        return True
    return any(_is_tensor_annotation(a) for a in typing.get_args(ann))


def _is_direct_tensor(ann: Any) -> bool:
    """True when ``ann`` is TensorField itself (optionally ``| None``), not a container of it."""
    if typing.get_origin(ann) in (list, dict):
        return False
    if isinstance(ann, type) and issubclass(ann, TENSOR_MODELS):
        return True
    return any(isinstance(a, type) and issubclass(a, TENSOR_MODELS)
               for a in typing.get_args(ann))


def attach_numpy(obj: Any, arrays: Mapping[str, np.ndarray] | None = None) -> Any:
    """Walk a parsed response and wrap every tensor field (annotated with ``TensorField`` in
    the schema) so it has ``.numpy()``. Works for any schema module that uses
    ``attnscope.schemas.common.TensorField``. ``arrays``: the named arrays of a binary
    response. Returns ``obj`` (changed in place)."""
    if isinstance(obj, BaseModel):
        for name, field in type(obj).model_fields.items():
            v = getattr(obj, name, None)
            if v is None:
                continue
            if _is_tensor_annotation(field.annotation):
                if _is_direct_tensor(field.annotation):
                    obj.__dict__[name] = _wrap_value(v, arrays)
                elif isinstance(v, list):  # list[TensorField]
                    obj.__dict__[name] = [_wrap_value(x, arrays) for x in v]
                elif isinstance(v, dict):  # dict[str, TensorField]
                    obj.__dict__[name] = {k: _wrap_value(x, arrays) for k, x in v.items()}
            else:
                attach_numpy(v, arrays)
    elif isinstance(obj, list):
        for x in obj:
            attach_numpy(x, arrays)
    elif isinstance(obj, dict):
        for x in obj.values():
            attach_numpy(x, arrays)
    return obj
