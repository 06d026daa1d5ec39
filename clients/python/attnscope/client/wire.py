"""Decode every tensor form attnscope sends, to numpy (numpy and the standard library; pybase64
when installed).

The server side is ``service/encoding/codecs.py``; the forms (README "Tensors on the wire"):

* nested JSON lists (``null`` = a masked score, decoded as ``-inf``);
* ``{"encoding": "base64", "dtype", "shape", "data", "layout"}``: little-endian bytes;
  ``layout`` 'tril' packs the lower triangle of the last two axes row by row;
* ``{"encoding": "tril", "shape", "data"}``: JSON ragged rows (row q has q + 1 values);
* ``{"encoding": "sparse", "format", "shape", "indices", "values", "row_mass", ...}``;
* ``{"encoding": "binary", "name", ...}``: a tensor of a binary response
  (``Accept: application/x-safetensors``), whose bytes live in the safetensors file.

Entry points: :func:`decode_tensor` (one wire value -> ndarray), :func:`sparse_to_dense`,
:func:`read_safetensors` (bytes -> JSON body + named arrays) and :func:`decode_binary_response`
(bytes -> the JSON body with every tensor replaced by its ndarray).
"""

from __future__ import annotations

import binascii
import json
import mmap
from typing import Any, Mapping

import numpy as np

try:  # SIMD base64 (a dependency of the client package); the standard library otherwise
    from pybase64 import b64decode
except ImportError:  # pragma: no cover - wire.py also works with numpy alone
    from base64 import b64decode

SAFETENSORS = "application/x-safetensors"
_NP = {"float32": "<f4", "float16": "<f2", "float64": "<f8", "int32": "<i4", "int64": "<i8"}
_ST = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I32": "<i4", "I64": "<i8", "I16": "<i2",
       "I8": "i1", "U8": "u1", "BOOL": "?"}


def _as_dict(v: Any) -> Any:
    if hasattr(v, "model_dump"):  # a pydantic model (the client's parsed response)
        return v.model_dump()
    return v


def _b64decode(data: str | bytes) -> bytes:
    """Standard base64 -> bytes. The service's text holds only the alphabet and padding, which
    the validating decoder reads ~4x faster (pybase64: its SIMD path); anything else (e.g.
    line breaks) is decoded as before, non-alphabet characters discarded.

    Raises:
        binascii.Error: bad padding (as before).
    """
    try:
        return b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return b64decode(data)


def _is_plus_zero(fill: float) -> bool:
    return bool(fill == 0 and not np.signbit(fill))


#: decoded arrays of at least this many bytes get their memory from an anonymous mmap
_MMAP_BYTES = 64 << 20


def _zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A writable zero-filled array. Big ones (>= 64 MiB) are an anonymous mmap (zeroed by the
    kernel, 4 KiB pages, freed with the array) rather than ``np.zeros``: numpy advises
    transparent huge pages for its big arrays, and where the kernel compacts memory for them
    on first touch (``defrag`` ``madvise``) a decoded T = 1024 pattern (604 MB) took 0.8-1.5 s
    to fault in after a model forward in the same process, against ~0.23 s in 4 KiB pages.
    Where the kernel offers ``MAP_POPULATE`` (Linux) the pages are zeroed and mapped by the
    mmap call itself, not faulted in one by one as the decode writes them: 302 MB took 0.10 s
    instead of 0.16 s here."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if n < _MMAP_BYTES:
        return np.zeros(shape, dtype)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0) | \
        getattr(mmap, "MAP_POPULATE", 0)
    buf = mmap.mmap(-1, n, flags=flags) if hasattr(mmap, "MAP_ANONYMOUS") else mmap.mmap(-1, n)
    return np.frombuffer(buf, dtype).reshape(shape)


def _unpack_tril(packed: np.ndarray, shape: list[int], fill: float) -> np.ndarray:
    """``[..., T, T]`` from the lower triangles packed row by row (``[..., T (T + 1) / 2]``;
    entries above the diagonal ``fill``). One strided copy per row over all leading matrices
    (a fancy-index scatter was ~8x slower at T = 1024)."""
    T = shape[-1]
    lead = shape[:-2]
    m = int(np.prod(lead, dtype=np.int64))
    src = packed.reshape(m, T * (T + 1) // 2)
    zero = _is_plus_zero(fill)  # the OS hands out zeroed pages: nothing to write above
    out = _zeros((m, T, T), packed.dtype)
    off = 0
    for q in range(T):
        out[:, q, : q + 1] = src[:, off : off + q + 1]
        if not zero:
            out[:, q, q + 1 :] = fill
        off += q + 1
    return out.reshape(*lead, T, T)


def decode_tensor(
    value: Any, arrays: Mapping[str, np.ndarray] | None = None, fill: float | None = None,
) -> np.ndarray:
    """One wire tensor as an ndarray of its logical shape.

    Args:
        value: nested lists, or a dict / pydantic model of one of the forms above.
        arrays: the named arrays of a binary response (for ``{"encoding": "binary"}`` refs);
            see :func:`read_safetensors`.
        fill: value of entries not sent (above the diagonal for 'tril', dropped entries for
            sparse); default: the tensor's own ``fill`` ('0', or '-inf' for pre-softmax
            scores), 0.0 for sparse.

    Returns:
        JSON lists: float32; base64/binary: the wire dtype (float16/float32, native order);
        sparse: float32 dense array (dropped entries ``fill``).

    Raises:
        ValueError: unknown form or dtype, data length not matching the shape, ragged lists.
    """
    value = _as_dict(value)
    if isinstance(value, dict):
        enc = value.get("encoding")
        if enc == "base64":
            wire = _NP.get(str(value.get("dtype")))
            if wire is None:
                raise ValueError(f"unknown tensor dtype {value.get('dtype')!r}")
            a = np.frombuffer(_b64decode(value["data"]), dtype=wire)
            return _logical(a, value, fill)
        if enc == "binary":
            if arrays is None or value["name"] not in arrays:
                raise ValueError(f"binary tensor {value.get('name')!r}: pass the arrays of the "
                                 "safetensors response (read_safetensors)")
            return _logical(arrays[value["name"]], value, fill)
        if enc == "tril":
            shape = [int(s) for s in value["shape"]]
            T = shape[-1]
            flat: list[np.ndarray] = []

            def walk(x, depth):
                if depth == len(shape) - 2:
                    flat.extend(np.asarray(x[q], dtype=np.float32) for q in range(T))  # None->nan
                    return
                for y in x:
                    walk(y, depth + 1)

            walk(value["data"], 0)
            packed = np.concatenate(flat) if flat else np.zeros(0, np.float32)
            packed[np.isnan(packed)] = -np.inf
            return _unpack_tril(packed, shape, _fill(value, fill))
        if enc == "sparse":
            return sparse_to_dense(value, arrays, 0.0 if fill is None else fill)
        raise ValueError(f"unknown tensor encoding {enc!r}")
    try:
        a = np.array(value, dtype=np.float64)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not a rectangular numeric tensor: {exc}") from exc
    a[np.isnan(a)] = -np.inf  # the service never sends NaN: null is a masked (-inf) entry
    return np.ascontiguousarray(a.astype(np.float32))


def _fill(value: dict, fill: float | None) -> float:
    if fill is not None:
        return fill
    return -np.inf if value.get("fill") == "-inf" else 0.0


def _logical(a: np.ndarray, value: dict, fill: float | None) -> np.ndarray:
    shape = [int(s) for s in value["shape"]]
    a = a.astype(a.dtype.newbyteorder("="), copy=False)
    if value.get("layout", "full") == "tril":
        n = int(np.prod(shape[:-2], dtype=np.int64)) * shape[-1] * (shape[-1] + 1) // 2
        if a.size != n:
            raise ValueError(f"tril tensor holds {a.size} elements; shape {shape} needs {n}")
        return _unpack_tril(a.reshape(-1), shape, _fill(value, fill))
    n = int(np.prod(shape, dtype=np.int64))
    if a.size != n:
        raise ValueError(f"tensor holds {a.size} elements; shape {shape} needs {n}")
    return a.reshape(shape)


def sparse_to_dense(
    value: Any, arrays: Mapping[str, np.ndarray] | None = None, fill: float = 0.0
) -> np.ndarray:
    """Dense float32 array of a SparseTensor (dropped entries = ``fill``)."""
    value = _as_dict(value)
    shape = [int(s) for s in value["shape"]]
    idx = np.asarray(_part(value["indices"], arrays), dtype=np.int64)
    vals = np.asarray(_part(value["values"], arrays), dtype=np.float32).reshape(-1)
    n = int(np.prod(shape, dtype=np.int64))
    out = _zeros((n,), np.float32)
    if not _is_plus_zero(fill):
        out.fill(fill)
    if value.get("format", "flat") == "coo":
        idx = np.ravel_multi_index(tuple(idx.reshape(-1, len(shape)).T), shape) if idx.size else idx
    out[idx.reshape(-1)] = vals
    return out.reshape(shape)


def sparse_parts(value: Any, arrays: Mapping[str, np.ndarray] | None = None) -> dict:
    """A SparseTensor's parts as arrays: ``indices``, ``values``, ``row_mass`` (+ metadata)."""
    value = _as_dict(value)
    out = {k: v for k, v in value.items() if k not in ("indices", "values", "row_mass")}
    for k in ("indices", "values", "row_mass"):
        out[k] = np.asarray(_part(value[k], arrays))
    return out


def _part(v: Any, arrays) -> Any:
    v = _as_dict(v)
    if isinstance(v, dict):
        return decode_tensor(v, arrays)
    return v


#: a base64 tensor's ``"data"`` text at least this long is cut out of the JSON before parsing
BIG_BASE64 = 1 << 16
_KEY = b'"data":"'
_MARK = "\x01attnscope-base64:"


def loads(body: bytes | bytearray | memoryview, as_text: bool = False) -> Any:
    """A JSON response body parsed like ``json.loads(body)``, except that the text of every big
    base64 tensor (a ``"data"`` string of ``BIG_BASE64`` or more characters, as the service
    writes them: compact, no escapes) is not parsed as a JSON string: it comes back as a
    read-only ``memoryview`` of ``body`` (no copy; :func:`decode_tensor` reads it directly),
    or as ``str`` with ``as_text`` (one ASCII copy, what the typed models want). A JSON parser
    validates and copies every byte of a string into a new ``str``, which for a T = 1024
    attention tensor (~200 MB of base64) is most of the client's decode. orjson when
    installed, else the standard library."""
    b = body if isinstance(body, bytes) else bytes(body)
    mv = memoryview(b)
    pieces, big, lo, pos = [], [], 0, 0
    while True:
        i = b.find(_KEY, pos)
        if i < 0:
            break
        s = i + len(_KEY)
        e = b.find(b'"', s)
        if e < 0:
            break
        pos = e + 1
        # a structural key (after '{' or ','; an escaped quote has a backslash before it),
        # whose string has no escapes (base64 needs none): a long base64 text of the service
        if e - s < BIG_BASE64 or i == 0 or b[i - 1] not in b"{," or b.find(b"\\", s, e) >= 0:
            continue
        pieces += [mv[lo:s], b"\\u0001attnscope-base64:" + str(len(big)).encode("ascii")]
        big.append(mv[s:e])
        lo = e
    if not big:
        return _json_loads(b)
    pieces.append(mv[lo:])
    data = _json_loads(b"".join(pieces))
    values = [str(v, "ascii") for v in big] if as_text else [v.toreadonly() for v in big]

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "data" and isinstance(v, str) and v.startswith(_MARK):
                    x[k] = values[int(v[len(_MARK):])]
                elif isinstance(v, (dict, list)):
                    walk(v)
        elif isinstance(x, list):  # only bodies with big base64 texts are walked
            for v in x:
                if isinstance(v, (dict, list)):
                    walk(v)

    walk(data)
    return data


def _json_loads(b: bytes) -> Any:
    try:
        import orjson
    except ImportError:  # pragma: no cover - wire.py also works with numpy alone
        return json.loads(b)
    return orjson.loads(b)


def read_safetensors(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """Parse a safetensors file (a binary response): ``(body, arrays)``.

    ``body`` is the JSON response from ``__metadata__["attnscope"]`` (tensors appear as
    ``{"encoding": "binary", "name", ...}`` refs), ``arrays`` maps names to read-only ndarrays
    viewing ``data`` (no copy) in the stored shape.

    Raises:
        ValueError: not a safetensors file, or offsets outside the data.
    """
    mv = memoryview(data)
    if len(mv) < 8:
        raise ValueError("not a safetensors file: shorter than 8 bytes")
    n = int.from_bytes(mv[:8], "little")
    if n > len(mv) - 8:
        raise ValueError(f"not a safetensors file: header length {n} > {len(mv) - 8} bytes")
    header = json.loads(bytes(mv[8 : 8 + n]))
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    arrays: dict[str, np.ndarray] = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        if not 0 <= b <= e <= len(mv) - base:
            raise ValueError(f"tensor {name!r}: offsets {b}..{e} outside the data")
        dt = np.dtype(_ST[info["dtype"]])
        arrays[name] = np.frombuffer(mv[base + b : base + e], dtype=dt).reshape(info["shape"])
    body = json.loads(meta["attnscope"]) if "attnscope" in meta else {}
    return body, arrays


def decode_binary_response(data: bytes) -> dict:
    """A binary response as its JSON body with every tensor (binary ref, including the parts
    of sparse tensors) replaced by an ndarray of its logical shape ('tril' unpacked)."""
    body, arrays = read_safetensors(data)

    def walk(x):
        if isinstance(x, dict):
            if x.get("encoding") == "binary":
                return decode_tensor(x, arrays)
            if x.get("encoding") == "sparse":
                return {**x, **{k: decode_tensor(x[k], arrays) if isinstance(x[k], dict) else
                                np.asarray(x[k]) for k in ("indices", "values", "row_mass")}}
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(body)
