"""Codecs: one tensor -> its wire form (json, rounded json, 'tril', sparse flat/coo, base64,
binary), NaN/inf and float16 range checks, and the memory estimate of each form.

Every form is produced *linearly and in bounded pieces*: the big parts of a wire form are
lazy objects (:class:`RoundedArray`, :class:`TrilRows`, :class:`Base64Text`) or plain numpy
arrays that :mod:`.responses` serialises chunk by chunk (``pieces(chunk_bytes)``: each piece
one vectorised ``orjson.dumps`` / ``b64encode`` call over at most ~``chunk_bytes`` of input).
Nothing is done per element in Python, so the cost per MB is the same for every shape: issue
17 measured ``format: "coo"`` at 97 s for a 512-token request when its ``[nnz, ndim]``
coordinates were serialised one row (one orjson call) per kept entry.

The bytes are exactly those of ``orjson.dumps`` over the eager forms of the previous
implementation (``tests/encoding_v0.py``; tests/test_encoding_equivalence.py compares them).

NaN/inf never reach the wire silently: a non-finite value where none is allowed raises
:class:`NonFiniteValues` (before any byte is sent); entries declared masked (``allow_neg_inf``)
are ``-inf`` and become ``null`` in JSON (orjson writes non-finite floats as null) and stay
``-inf`` in base64/binary. A finite value beyond float16's range with ``dtype: float16`` is a
422 (``InvalidRequest``, param ``dtype``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import orjson
import torch
from pybase64 import b64encode

from ..errors import InvalidRequest, NonFiniteValues

_ST_DTYPE = {"float32": "F32", "float16": "F16", "int32": "I32", "int64": "I64"}
_WIRE = {"float32": "<f4", "float16": "<f2", "int32": "<i4", "int64": "<i8"}
#: default piece size of the lazy forms (responses.CHUNK_BYTES is what the server uses)
PIECE_BYTES = 1 << 20
_OPTS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def _dumps(x: Any) -> bytes:
    return orjson.dumps(x, option=_OPTS)


def to_numpy(t: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach()
        if t.dtype in (torch.float16, torch.bfloat16):
            t = t.float()
        return t.cpu().numpy()
    return np.asarray(t)


# ------------------------------------------------------------------------------ lazy forms
class Base64Text:
    """Standard base64 (RFC 4648, padded) of an array's bytes, encoded lazily.

    Written into the JSON verbatim between quotes (the alphabet needs no escaping), in pieces of
    a multiple of 3 input bytes (so the pieces concatenate to the one-shot encoding): a big
    tensor never exists as one base64 buffer, nor passes orjson's string escaper. ``raw``: the
    whole text (small bodies)."""

    __slots__ = ("_src",)

    def __init__(self, src: np.ndarray | bytes):
        # flattened first: memoryview cannot cast a multi-axis view with a zero in its shape
        # (an empty [0, ndim] 'coo' index array was a TypeError, i.e. a 500)
        self._src = memoryview(np.ascontiguousarray(src).reshape(-1) if isinstance(
            src, np.ndarray) else src).cast("B")

    @property
    def raw(self) -> bytes:
        return b64encode(self._src)

    @property
    def nbytes(self) -> int:
        return len(self)

    def __len__(self) -> int:
        return 4 * ((len(self._src) + 2) // 3)

    def pieces(self, chunk: int = PIECE_BYTES) -> Iterator[bytes]:
        step = max(3, (chunk * 3 // 4) // 3 * 3)
        mv = self._src
        for i in range(0, len(mv), step):
            yield b64encode(mv[i : i + step])


class TrilBase64(Base64Text):
    """Base64 of the lower triangles of ``array [..., T, T]`` (float32) packed row by row in
    wire dtype ``wire`` (``[..., T (T + 1) / 2]``, little-endian): the 'tril' base64 form,
    packed lazily, a few matrices per piece, while the response streams. The text equals
    ``Base64Text(packed)`` of the eagerly packed array (:func:`_pack_tril`). Made only for
    arrays whose every value fits the wire dtype (:func:`_fits_wire`): packing cannot fail."""

    __slots__ = ("array", "wire")

    def __init__(self, array: np.ndarray, wire: str):
        self.array = array
        self.wire = wire

    def _n_bytes(self) -> int:
        T = self.array.shape[-1]
        return self.array.size // max(T, 1) * (T + 1) // 2 * np.dtype(_WIRE[self.wire]).itemsize

    @property
    def raw(self) -> bytes:
        return b64encode(memoryview(_pack_tril(self.array, self.wire).reshape(-1)).cast("B"))

    def __len__(self) -> int:
        return 4 * ((self._n_bytes() + 2) // 3)

    def pieces(self, chunk: int = PIECE_BYTES) -> Iterator[bytes]:
        a = self.array
        T = a.shape[-1]
        m = a.reshape(-1, T, T)
        per = max(1, T * (T + 1) // 2 * np.dtype(_WIRE[self.wire]).itemsize)
        # whole matrices per piece; at least _TRIL_MIN_ROWS rows of copies per group
        g = max(1, chunk // per, -(-_TRIL_MIN_ROWS // max(T, 1)))
        carry = b""
        for m0 in range(0, m.shape[0], g):
            mv = memoryview(_pack_tril(m[m0 : m0 + g], self.wire).reshape(-1)).cast("B")
            i = 0
            if carry:  # complete the 3 bytes left over from the last group
                i = min(3 - len(carry), len(mv))
                carry += bytes(mv[:i])
                if len(carry) < 3:
                    continue
                yield b64encode(carry)
                carry = b""
            n = (len(mv) - i) // 3 * 3
            if n:
                yield b64encode(mv[i : i + n])
            carry = bytes(mv[i + n :])
        if carry:
            yield b64encode(carry)


#: a lazy 'tril' group packs at least this many rows (the per-row copies' overhead)
_TRIL_MIN_ROWS = 4096


def round_decimals(x: np.ndarray, decimals: int) -> np.ndarray:
    """``x`` rounded to ``decimals`` places, half to even, exactly: every result is the
    decimal nearest to the TRUE value of each float32 element (within half a unit of the last
    kept place, ``0.5 * 10**-decimals``), returned as float64 so that orjson writes it as
    that short decimal (``0.0021``, not ``0.0020999999``).

    Why float64: ``np.round`` computes ``rint(x * 10**d) / 10**d`` in the array's dtype; in
    float32 the product is itself rounded, so values just past a tie fall the wrong way
    (float32 ``0.00205000001`` rounded to 4 places gave ``0.002``; issue 29: 36 of 151M values
    of a T = 1024 GPT-2-small pattern, bench/rounding.py). A float32 (or float16) value has a
    24-bit significand and ``10**d = 2**d * 5**d`` with ``5**10 < 2**24``, so for
    ``0 <= d <= 10`` (the schema's bound) ``x * 10**d`` is exact in float64; ``rint`` (half to
    even) is then exact, ties included, and the division is correctly rounded to the float64
    nearest the decimal, whose shortest repr is that decimal (for ``|x| < 10**(15 - d)``;
    beyond, ``x * 10**d`` is an integer already and the float32 value itself comes back,
    written as its float64 repr: ``1e20`` in float32 is ``1.0000000200408773e+20``, its true
    value, where float32's shortest repr ``1e+20`` would be 2e12 off). float64 input is rounded by ``np.round`` in float64 (off only where
    the float64 product is inexact, within 1e-16 relative of a tie). Shapes: any; NaN/inf
    pass through.
    """
    # np.round's own steps (multiply, rint, divide), the product taken in float64 without a
    # separate cast: 3x faster than np.round(x.astype(float64)), the same values
    scale = 10.0 ** decimals
    y = np.multiply(x, scale, dtype=np.float64)
    np.rint(y, out=y)
    return np.divide(y, scale, out=y)


class RoundedArray:
    """``array`` rounded to ``decimals`` places (:func:`round_decimals`: half to even, exact
    on the float32 values, written as float64 short decimals) as nested JSON lists, rounded
    piece by piece at serialisation time: no rounded copy of the whole tensor is ever held.
    ``np.asarray(x)`` gives the rounded array (float64)."""

    __slots__ = ("array", "decimals")

    def __init__(self, array: np.ndarray, decimals: int):
        self.array = array
        self.decimals = decimals

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    @property
    def shape(self) -> tuple:
        return self.array.shape

    def __array__(self, dtype=None, copy=None):
        out = round_decimals(self.array, self.decimals)
        return out if dtype is None else out.astype(dtype)

    def pieces(self, chunk: int = PIECE_BYTES) -> Iterator[bytes]:
        d = self.decimals
        return array_pieces(self.array, chunk, lambda x: round_decimals(x, d))


class TrilRows:
    """The lower triangle (key_pos <= query_pos) of ``array [..., T, T]`` as nested JSON
    lists whose innermost lists are the ragged rows ``array[..., q, :q + 1]``; rounded per
    piece when ``decimals`` is set. Each piece is one ``orjson.dumps`` of a list of row views
    covering at most ~``chunk`` bytes of the array (one Python object per row, none per
    value), so it is streamed at every T."""

    __slots__ = ("array", "decimals")

    def __init__(self, array: np.ndarray, decimals: int | None):
        self.array = array
        self.decimals = decimals

    @property
    def nbytes(self) -> int:
        T = self.array.shape[-1]
        return self.array.nbytes // max(T, 1) * (T + 1) // 2

    def pieces(self, chunk: int = PIECE_BYTES) -> Iterator[bytes]:
        a = self.array
        T = a.shape[-1]
        budget = max(1, chunk // a.itemsize)  # values per piece
        groups, q0, n = [], 0, 0
        for q in range(T):
            n += q + 1
            if n >= budget or q == T - 1:
                groups.append((q0, q + 1))
                q0, n = q + 1, 0
        d = self.decimals

        def matrix(m: np.ndarray) -> Iterator[bytes]:
            yield b"["
            for gi, (lo, hi) in enumerate(groups):
                blk = m[lo:hi] if d is None else round_decimals(m[lo:hi], d)
                if gi:
                    yield b","
                yield _dumps([blk[j, : lo + j + 1] for j in range(hi - lo)])[1:-1]
            yield b"]"

        def walk(x: np.ndarray) -> Iterator[bytes]:
            if x.ndim == 2:
                yield from matrix(x)
                return
            yield b"["
            for i in range(x.shape[0]):
                if i:
                    yield b","
                yield from walk(x[i])
            yield b"]"

        return walk(a)


LAZY = (Base64Text, RoundedArray, TrilRows)  # TrilBase64 is a Base64Text


def array_pieces(a: np.ndarray, chunk: int = PIECE_BYTES,
                 transform: Callable[[np.ndarray], np.ndarray] | None = None) -> Iterator[bytes]:
    """The JSON of ``transform(a)`` (nested lists, exactly ``orjson.dumps``' bytes) as pieces,
    each one ``orjson.dumps`` of a block of whole sub-arrays holding at most ~``chunk`` bytes
    (or of one sub-array, recursively, where a single one is bigger)."""
    f = transform or (lambda x: x)
    if a.nbytes <= chunk or a.ndim == 0 or a.size == 0:
        yield _dumps(f(a))
        return
    if a.ndim == 1 or a[0].nbytes <= chunk:
        step = max(1, chunk // (a[0].nbytes if a.ndim > 1 else a.itemsize))
        yield b"["
        for i in range(0, a.shape[0], step):
            if i:
                yield b","
            yield _dumps(f(a[i : i + step]))[1:-1]
        yield b"]"
        return
    yield b"["
    for i in range(a.shape[0]):
        if i:
            yield b","
        yield from array_pieces(a[i], chunk, transform)
    yield b"]"


# ------------------------------------------------------------------------------ encoders
def encode_tensor(
    t: torch.Tensor | np.ndarray,
    encoding: str = "json",
    dtype: str = "float32",
    round_: int | None = None,
    name: str = "tensor",
    allow_neg_inf: bool = False,
    layout: str = "full",
    sparse: Any = None,
) -> Any:
    """Encode one tensor for the wire.

    Args:
        t: any float tensor/array; ``[..., query_pos, key_pos]`` for layout 'tril' / sparse.
        encoding: 'json' -> a numpy array, or a lazy :class:`RoundedArray` when ``round_`` is
            set (orjson / :mod:`.responses` write nested lists); 'base64' -> dict;
            'binary' -> :class:`BinaryTensor` (for ``tensor_response`` with binary=True).
        dtype: wire dtype for base64/binary ('float32' or 'float16').
        round_: decimals for json (:func:`round_decimals`: half to even, exact on the
            float32 values), None = full precision.
        name: the response field, for error messages and the binary tensor key.
        allow_neg_inf: -inf marks masked entries (pre-softmax scores) and is allowed.
        layout: 'full', or 'tril' (lower triangle of the last two axes, diagonal included).
        sparse: None, or an object with ``top_k``, ``threshold``, ``format`` (schemas
            SparseOptions): a SparseTensor dict (for non-negative weights: patterns).

    Raises:
        NonFiniteValues: NaN or +inf (or -inf where not allowed) in ``t``.
        InvalidRequest: a finite value beyond float16's range with dtype 'float16'.
    """
    if sparse is not None:
        return encode_sparse(t, sparse, encoding, dtype, round_, name)
    a = to_numpy(t)
    if layout == "tril" and encoding in ("base64", "binary") and _fits_wire(a, dtype):
        # every value finite and within the wire dtype: no error is possible, so the packing
        # (and for base64 the encoding) is done without the float32 packed copy
        fill = "-inf" if allow_neg_inf else "0"
        if encoding == "binary":
            return BinaryTensor(name, _pack_tril(a, dtype), list(a.shape), "tril", fill)
        return {"encoding": "base64", "dtype": dtype, "shape": list(a.shape), "layout": "tril",
                "fill": fill, "data": TrilBase64(np.ascontiguousarray(a), dtype)}
    _check_finite(a, name, allow_neg_inf)
    if layout == "tril":
        return _encode_tril(a, encoding, dtype, round_, name, "-inf" if allow_neg_inf else "0")
    if encoding == "binary":
        return BinaryTensor(name, _wire_array(a, dtype), list(a.shape))
    if encoding == "base64":
        b = _wire_array(a, dtype)
        return {
            "encoding": "base64",
            "dtype": dtype,
            "shape": list(b.shape),
            "data": _b64(b),
        }
    return _json_array(a, round_)


def _check_finite(a: np.ndarray, name: str, allow_neg_inf: bool) -> None:
    if a.dtype.kind == "f":
        if a.size and a.dtype in (np.float32, np.float64) and bool(
            torch.isfinite(torch.from_numpy(np.ascontiguousarray(a)).sum())
        ):
            return  # fast path: NaN/inf anywhere make the sum non-finite (overflow: slow path)
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


def _wire_array(a: np.ndarray, wire: str) -> np.ndarray:
    """``a`` as a C-contiguous array of wire dtype ``wire`` (float16 cast through torch).

    Raises:
        InvalidRequest: a finite value would become inf in float16 (param ``dtype``).
    """
    want = np.dtype(_WIRE[wire])
    if a.dtype == want and a.flags.c_contiguous:
        return a
    if wire == "float16" and a.dtype.kind == "f" and a.dtype != np.float16:
        src = np.ascontiguousarray(a)
        out = (torch.from_numpy(src).to(torch.float16).numpy() if a.dtype == np.float32
               else src.astype(np.float16))
        t16 = torch.from_numpy(out)
        mn, mx = torch.aminmax(t16) if out.size else (0.0, 0.0)  # ~1 ms per 20M values
        if mx == float("inf") or mn == float("-inf") and not torch.equal(
                torch.isneginf(t16), torch.isneginf(torch.from_numpy(src))):  # masked -inf ok
            bad = np.isinf(out) & np.isfinite(src)  # finite values cast to inf
            big = float(np.abs(src[bad]).max()) if bad.any() else float("inf")
            raise InvalidRequest(
                f"a value of magnitude {big:.4g} is beyond float16's largest finite number "
                "(65504): it would be sent as inf. Use dtype 'float32' or encoding 'json'",
                "dtype",
            )
        return out
    return np.ascontiguousarray(a, dtype=want)


def _b64(a: np.ndarray) -> Base64Text:
    """Base64 of ``a``'s bytes (lazy; SIMD-accelerated by pybase64 when written)."""
    return Base64Text(a)


def _json_array(a: np.ndarray, round_: int | None) -> np.ndarray | RoundedArray:
    if a.dtype.kind == "f":
        if a.dtype not in (np.float32, np.float64):
            a = a.astype(np.float32)
        if round_ is not None:
            return RoundedArray(np.ascontiguousarray(a), round_)
    return np.ascontiguousarray(a)


@dataclass
class BinaryTensor:
    """Placeholder for a tensor of a binary response: ``array`` is stored under ``name``.

    ``shape`` is the logical shape; ``array.shape`` the stored one (packed for 'tril')."""

    name: str
    array: np.ndarray
    shape: list[int]
    layout: str = "full"
    fill: str | None = None

    @property
    def dtype(self) -> str:
        return {np.dtype(v): k for k, v in _WIRE.items()}[self.array.dtype]

    def ref(self) -> dict:
        return {"encoding": "binary", "name": self.name, "dtype": self.dtype,
                "shape": self.shape, "stored_shape": list(self.array.shape),
                "layout": self.layout, **({"fill": self.fill} if self.fill else {})}


def _packed(a: np.ndarray, wire: str) -> dict:
    """The base64 dict of a whole array in wire dtype ``wire``."""
    b = _wire_array(a, wire)
    return {"encoding": "base64", "dtype": wire, "shape": list(b.shape), "data": _b64(b)}


#: float32 values at or beyond this magnitude round to inf in float16 (65504 is its largest
#: finite number; 65520, halfway to 65536, rounds to even: up)
_F16_INF_FROM = 65520.0


def _fits_wire(a: np.ndarray, wire: str) -> bool:
    """True when ``a`` is a non-empty float32 ``[..., T, T]`` array whose values are all
    finite and (wire float16) of magnitude below 65520, i.e. nothing for
    :func:`_check_finite` or :func:`_wire_array` to refuse. One min/max pass; False (the
    checked path) otherwise, e.g. for scores with masked -inf."""
    if a.dtype != np.float32 or a.ndim < 2 or a.shape[-1] != a.shape[-2] or not a.size \
            or wire not in ("float32", "float16"):
        return False
    mn, mx = (float(v) for v in torch.aminmax(torch.from_numpy(np.ascontiguousarray(a))))
    lim = _F16_INF_FROM if wire == "float16" else float("inf")
    return -lim < mn and mx < lim  # False for NaN


def _pack_tril(a: np.ndarray, wire: str) -> np.ndarray:
    """The lower triangles (key_pos <= query_pos) of float32 ``a [..., T, T]``, row by row,
    as a C-contiguous ``[..., T (T + 1) / 2]`` array of wire dtype ``wire``. Values must fit
    the wire dtype (:func:`_fits_wire`); float16 is torch's cast (the same rounding as
    :func:`_wire_array`), made per block of rows on the rectangle the block needs, so no
    float32 packed copy is made."""
    T = a.shape[-1]
    lead = a.shape[:-2]
    m = a.reshape(-1, T, T)
    out = np.empty((m.shape[0], T * (T + 1) // 2), dtype=_WIRE[wire])
    off = 0
    for lo in range(0, T, _TRIL_CAST_ROWS):
        hi = min(T, lo + _TRIL_CAST_ROWS)
        blk = m[:, lo:hi, :hi]
        if wire == "float16":
            blk = torch.from_numpy(np.ascontiguousarray(blk)).to(torch.float16).numpy()
        for q in range(lo, hi):  # row by row: strided copies over every matrix
            out[:, off : off + q + 1] = blk[:, q - lo, : q + 1]
            off += q + 1
    return out.reshape(*lead, T * (T + 1) // 2)


_TRIL_CAST_ROWS = 64


def _encode_tril(
    a: np.ndarray, encoding: str, dtype: str, round_: int | None, name: str, fill: str
) -> Any:
    """Lower triangle (key_pos <= query_pos) of ``a [..., T, T]``, row by row."""
    if a.ndim < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"layout 'tril' needs [..., T, T]; {name} has shape {list(a.shape)}")
    T = a.shape[-1]
    if encoding == "json":
        if a.dtype.kind == "f" and a.dtype not in (np.float32, np.float64):
            a = a.astype(np.float32)
        a = np.ascontiguousarray(a)
        return {"encoding": "tril", "shape": list(a.shape), "data": TrilRows(a, round_),
                "fill": fill}
    packed = np.empty(a.shape[:-2] + (T * (T + 1) // 2,), dtype=a.dtype)
    off = 0
    for q in range(T):  # row by row: strided copies, ~4x faster than fancy indexing
        packed[..., off : off + q + 1] = a[..., q, : q + 1]
        off += q + 1
    packed = _wire_array(packed, dtype)
    if encoding == "binary":
        return BinaryTensor(name, packed, list(a.shape), "tril", fill)
    return {"encoding": "base64", "dtype": dtype, "shape": list(a.shape), "layout": "tril",
            "fill": fill,
            "data": _b64(packed)}


def encode_sparse(
    t: torch.Tensor | np.ndarray, opts: Any, encoding: str = "json", dtype: str = "float32",
    round_: int | None = None, name: str = "pattern",
) -> dict:
    """Sparse form of a non-negative ``[..., query_pos, key_pos]`` tensor (a pattern).

    Per query row keep the ``opts.top_k`` largest weights and/or those ``>= opts.threshold``;
    zeros are never kept. Among entries exactly equal to a row's k-th largest weight, which
    ones are kept is ``torch.topk``'s choice (deterministic for one input and torch build; the
    kept values and ``row_mass`` do not depend on it). Returns the SparseTensor dict
    (schemas.common): ``indices`` row-major flat int (int32 when the tensor has < 2^31
    elements, else int64) or ``[nnz, ndim]`` int32 coordinates (``opts.format``), ``values``,
    ``row_mass`` ``shape[:-1]`` = sum of kept weights per row (float32, summed in float64),
    ``min_row_mass``. Entries in row-major order. Sub-arrays are numpy (json), base64 dicts
    or :class:`BinaryTensor` (binary).

    Raises:
        NonFiniteValues: NaN/inf in ``t`` (with ``top_k``: among each row's top-k candidates,
            where torch.topk ranks NaN and +inf first).
    """
    x = t.detach().to("cpu") if isinstance(t, torch.Tensor) else torch.from_numpy(np.asarray(t))
    if x.dtype != torch.float32:
        x = x.float()
    x = x.contiguous()
    shape = list(x.shape)
    K = shape[-1]
    rows = x.reshape(-1, K)
    top_k = getattr(opts, "top_k", None)
    thr = getattr(opts, "threshold", None)
    R = rows.shape[0]
    if top_k is not None and top_k < K:
        vals, keys = _top_k_causal(rows, shape, top_k, thr, name)
        keep = vals > 0
        if thr is not None:
            keep &= vals >= thr
        row_mass = torch.where(torch.from_numpy(keep), torch.from_numpy(vals).double(),
                               0.0).sum(-1).float()
        # numpy's boolean indexing: ~4x torch's here (same entries, same row-major order)
        flat = torch.from_numpy((np.arange(R)[:, None] * K + keys)[keep])
        values = torch.from_numpy(vals[keep])
    else:
        xn = x.numpy().reshape(-1)
        _check_finite(xn, name, False)
        # numpy: flatnonzero/take are ~3x torch's nonzero/gather here (same indices, in order)
        flat_np = np.flatnonzero(xn >= thr if thr is not None else xn > 0)
        vals_np = xn[flat_np]
        row_mass = torch.from_numpy(np.bincount(
            flat_np // K, weights=vals_np, minlength=R).astype(np.float32))
        flat, values = torch.from_numpy(flat_np), torch.from_numpy(vals_np)
    n_total = int(np.prod(shape, dtype=np.int64))
    fmt = getattr(opts, "format", "flat")
    if fmt == "coo":
        idx = np.empty((flat.numel(), len(shape)), dtype=np.int32)
        rest = flat.numpy()
        for d in range(len(shape) - 1, -1, -1):  # unravel, one int32 column per axis
            if d:
                rest, col = np.divmod(rest, shape[d])
            else:
                col = rest
            idx[:, d] = col
        del rest, col
        iwire = "int32"
    else:
        iwire = "int32" if n_total < 2**31 else "int64"
        idx = flat.numpy().astype(_WIRE[iwire])
    del flat
    vals_np = values.numpy()
    mass_np = row_mass.reshape(shape[:-1]).numpy()
    out = {"encoding": "sparse", "format": fmt, "shape": shape, "nnz": int(vals_np.size),
           "top_k": top_k, "threshold": thr,
           "min_row_mass": float(mass_np.min()) if mass_np.size else 1.0}
    if encoding == "binary":
        out["indices"] = BinaryTensor(f"{name}.indices", np.ascontiguousarray(idx), list(idx.shape))
        out["values"] = BinaryTensor(f"{name}.values", _wire_array(vals_np, dtype), [int(vals_np.size)])
        out["row_mass"] = BinaryTensor(f"{name}.row_mass", mass_np.astype("<f4"), list(mass_np.shape))
    elif encoding == "base64":
        out["indices"] = _packed(idx, iwire)
        out["values"] = _packed(vals_np, dtype)
        out["row_mass"] = _packed(mass_np, "float32")
    else:
        out["indices"] = idx
        out["values"] = _json_array(vals_np, round_)
        out["row_mass"] = mass_np
    return out


def _top_k_torch(rows: torch.Tensor, k: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``rows [n, K]`` the ``k`` largest values and their keys (key_pos), as
    ``torch.topk`` chooses them, sorted by key: ``(values float32 [n, k], keys int64 [n, k])``.

    Raises:
        NonFiniteValues: NaN / +inf in a row (topk ranks them first), or -inf among a row's k.
    """
    vals, keys = torch.topk(rows, k, dim=-1, sorted=False)
    _check_finite(vals.numpy(), name, False)  # NaN / +inf rank first: they would be here
    keys, order = torch.sort(keys, dim=-1)
    return torch.gather(vals, -1, order).numpy(), keys.numpy()


#: rows per block of the causal top-k, and the most elements one unit of its work holds
_TOPK_ROWS = 128
_TOPK_BLOCK_ELEMENTS = 1 << 22


def _top_k_causal(rows: torch.Tensor, shape: list[int], k: int, thr: float | None,
                  name: str) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_top_k_torch` of every row of ``rows [R, K]`` (the tensor of ``shape``
    ``[..., Q, K]``), with the same result, faster on causal patterns.

    A row whose k largest values are unique (its k-th largest ``kth`` is positive, at least
    ``thr`` when given, and exactly k entries are ``>= kth``) has only one top-k set: it is
    taken as ``row >= kth``, with ``kth`` from ``np.partition`` over the row's first ``hi``
    keys, where a block of query rows ``[lo, hi)`` has nothing positive beyond key ``hi``
    (causal: half the work of topk, and no run of zeros to partition). Every other row
    (fewer than k positive values, a tie across the k-th value, a block with positive values
    above the diagonal: non-causal) goes through ``torch.topk`` as before, so which of tied
    entries are kept, the values and their order are exactly :func:`_top_k_torch`'s. Rows
    with NaN/inf anywhere: all of them through :func:`_top_k_torch` (the same error). The
    blocks run on torch's intra-op thread count (numpy releases the GIL), like topk.
    """
    R, K = rows.shape
    if len(shape) < 2 or R < 2 * _TOPK_ROWS or shape[-2] != K \
            or not bool(torch.isfinite(rows.sum())):
        return _top_k_torch(rows, k, name)
    x = rows.numpy().reshape(-1, K, K)  # [matrix, query_pos, key_pos]
    M = x.shape[0]
    flat_x = x.reshape(-1)
    vals = np.empty((M, K, k), np.float32)
    keys = np.empty((M, K, k), np.int64)
    slow = np.zeros((M, K), bool)  # rows left to torch.topk
    units = []
    for lo in range(0, K, _TOPK_ROWS):
        hi = min(K, lo + _TOPK_ROWS)
        if hi < K and x[:, lo:hi, hi:].max() > 0:  # not causal: topk for every row from here
            slow[:, lo:] = True
            break
        if hi < k:
            slow[:, lo:hi] = True
            continue
        g = max(1, _TOPK_BLOCK_ELEMENTS // ((hi - lo) * hi))  # matrices per unit
        units += [(m0, min(M, m0 + g), lo, hi) for m0 in range(0, M, g)]

    def unit(u) -> None:
        m0, m1, lo, hi = u
        sub = x[m0:m1, lo:hi, :hi]
        kth = np.partition(sub, hi - k, axis=-1)[..., hi - k]  # k-th largest per row
        ge = sub >= kth[..., None]
        fast = (np.count_nonzero(ge, axis=-1) == k) & (kth > 0)
        if thr is not None:
            fast &= kth >= thr
        ge &= fast[..., None]
        pos = np.flatnonzero(ge)  # row-major over [m1 - m0, hi - lo, hi]
        row, col = np.divmod(pos, hi)
        m, q = np.divmod(row, hi - lo)
        keys[m0:m1, lo:hi][fast] = col.reshape(-1, k)  # ascending key_pos per row
        vals[m0:m1, lo:hi][fast] = flat_x[((m + m0) * K + q + lo) * K + col].reshape(-1, k)
        slow[m0:m1, lo:hi] = ~fast

    workers = max(1, min(torch.get_num_threads(), len(units)))
    if workers > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="attnscope-topk") as ex:
            list(ex.map(unit, units))
    else:
        for u in units:
            unit(u)
    vals = vals.reshape(R, k)
    keys = keys.reshape(R, k)
    idx = np.flatnonzero(slow.reshape(-1))
    if idx.size:
        v, kk = _top_k_torch(rows[torch.from_numpy(idx)], k, name)
        vals[idx] = v
        keys[idx] = kk
    return vals, keys


# ------------------------------------------------------------------------------ estimates
def estimate_encoded_bytes(
    n_elements: int, encoding: str = "json", dtype: str = "float32", round_: int | None = None,
    layout: str = "full", sparse: Any = None, row_len: int = 1, ndim: int = 4,
) -> int:
    """Peak bytes :func:`encode_tensor` and the response writer hold for one float32 tensor of
    ``n_elements`` (held until the response is sent).

    ``row_len``: length of the last axis (rows for sparse / 'tril'); ``ndim``: the tensor's
    number of axes (sparse 'coo' coordinates). Counts the copies the code makes: the float16
    cast, the 'tril' packing (base64/binary), the sparse work arrays (top-k values and int64
    keys, sort, gather, ~40 bytes per candidate; or the threshold mask) and their output, the
    'coo' unravelling (int64 quotient + remainder per entry, int32 column per axis), plus what
    what the writer holds: the whole JSON text of a small body sent in one piece (below
    responses.STREAM_MIN_BYTES of arrays: at most ~12 bytes of JSON per value), or of a stream
    the chunks in flight (the rounded / base64 / JSON text of ~3 pieces of ``PIECE_BYTES``
    of input: bounded by the same 12 bytes x 2^20 values).
    """
    wes = 2 if dtype == "float16" else 4
    n = n_elements
    rows = n // max(row_len, 1)
    writer = 12 * min(n, 1 << 20)  # one-shot JSON text, or the ~3 JSON chunks in flight
    if sparse is not None:
        k = min(getattr(sparse, "top_k", None) or row_len, row_len)
        work = rows * k * 40 if k < row_len else n  # top-k arrays, or the threshold mask
        kept = rows * k
        out = kept * (8 + 4 + 8)  # flat int64, values, bincount/float64 mass
        if getattr(sparse, "format", "flat") == "coo":
            out += kept * (8 + 8 + 4 * ndim)  # divmod quotient/remainder, [nnz, ndim] int32
        return work + out + kept * (8 + wes) + writer
    if layout == "tril":
        n = rows * (row_len + 1) // 2
        packed = 4 * n if encoding != "json" else 0  # the packed float32 copy
    else:
        packed = 0
    if encoding == "json":
        return packed + 160 * rows + writer
    cast = n * wes if (wes != 4) else 0
    return packed + cast + writer  # base64 is written piece by piece; binary from the arrays
