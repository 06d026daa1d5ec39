"""FROZEN COPY of service/encoding.py before issue 17 (commit 5b2e652): the reference that
tests/test_encoding_equivalence.py compares the chunked encoders with, byte for byte. Not used
by the service.

Tensors become wire data in exactly one place (CONVENTIONS.md).

Encodings of one tensor (:func:`encode_tensor`):

* ``json``: nested lists through orjson's numpy support, rounding done in numpy;
* ``base64``: ``{"encoding": "base64", "dtype", "shape", "data", "layout"}``, little-endian;
* ``binary``: a :class:`BinaryTensor` placeholder; :func:`tensor_response` writes the whole
  response as one safetensors file (``application/x-safetensors``, negotiated by ``Accept``
  with :func:`wants_binary`) whose ``__metadata__["attnscope"]`` holds the JSON body with each
  tensor replaced by ``{"encoding": "binary", "name", "dtype", "shape", "stored_shape",
  "layout"}``;

and two shapes: ``layout="tril"`` (causal ``[..., T, T]``: the lower triangle only, about
half) and ``sparse`` (top-k per query row and/or a threshold, flat or coordinate indices, with
the kept mass of every row; schemas.common.SparseTensor documents the wire form).

NaN/inf never reach the wire silently: a non-finite value where none is allowed raises
:class:`NonFiniteValues`; entries declared masked (``allow_neg_inf``) are ``-inf`` and become
``null`` in JSON (orjson writes non-finite floats as null) and stay ``-inf`` in base64/binary.

Big responses never block the event loop for long: :func:`tensor_response` builds the body in
a worker thread and streams large JSON in ~1 MB orjson chunks (each produced in a worker
thread, so the GIL is released between chunks and memory holds one chunk, not the whole
document). Decoders (numpy only) for every form: ``clients/python/attnscope/client/wire.py``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator

import anyio.to_thread
import numpy as np
import orjson
import torch
from pybase64 import b64encode
from fastapi.responses import JSONResponse, Response, StreamingResponse

from attnscope.service.errors import InvalidRequest, NonFiniteValues, NotAcceptable

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
    layout: str = "full",
    sparse: Any = None,
) -> Any:
    """Encode one tensor for the wire.

    Args:
        t: any float tensor/array; ``[..., query_pos, key_pos]`` for layout 'tril' / sparse.
        encoding: 'json' -> numpy array (orjson writes nested lists); 'base64' -> dict;
            'binary' -> :class:`BinaryTensor` (for :func:`tensor_response` with binary=True).
        dtype: wire dtype for base64/binary ('float32' or 'float16').
        round_: decimals for json (numpy round-half-even), None = full precision.
        name: the response field, for error messages and the binary tensor key.
        allow_neg_inf: -inf marks masked entries (pre-softmax scores) and is allowed.
        layout: 'full', or 'tril' (lower triangle of the last two axes, diagonal included).
        sparse: None, or an object with ``top_k``, ``threshold``, ``format`` (schemas
            SparseOptions): a SparseTensor dict (for non-negative weights: patterns).

    Raises:
        NonFiniteValues: NaN or +inf (or -inf where not allowed) in ``t``.
    """
    if sparse is not None:
        return encode_sparse(t, sparse, encoding, dtype, round_, name)
    a = to_numpy(t)
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
    """``a`` as a C-contiguous array of wire dtype ``wire`` (float16 cast through torch)."""
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


class Base64Text:
    """Base64 text held as ASCII bytes (``raw``). :func:`dumps` and :func:`iter_json` write it
    into the JSON verbatim between quotes (the base64 alphabet needs no escaping), so a big
    tensor never becomes a Python str nor passes orjson's string escaper."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes):
        self.raw = raw

    def __len__(self) -> int:
        return len(self.raw)


def _b64(a: np.ndarray) -> Base64Text:
    """Standard base64 (RFC 4648, padded) of ``a``'s bytes; SIMD-accelerated by pybase64."""
    return Base64Text(b64encode(memoryview(np.ascontiguousarray(a)).cast("B")))


def _json_array(a: np.ndarray, round_: int | None) -> np.ndarray:
    if a.dtype.kind == "f":
        if a.dtype not in (np.float32, np.float64):
            a = a.astype(np.float32)
        if round_ is not None:  # issue 29: exact from float64 (np.round on float32 before)
            a = np.round(a.astype(np.float64), round_)
    return np.ascontiguousarray(a)


def estimate_encoded_bytes(
    n_elements: int, encoding: str = "json", dtype: str = "float32", round_: int | None = None,
    layout: str = "full", sparse: Any = None, row_len: int = 1,
) -> int:
    """Bytes :func:`encode_tensor` allocates for one float32 tensor of ``n_elements`` (held
    until the response is sent; streamed JSON holds ~one chunk, so only its rounded copy).

    ``row_len``: length of the last axis (rows for sparse / 'tril'). Counts the copies the
    code makes: float16 cast, 'tril' packing, rounding, base64 bytes + str (4/3 each), sparse
    top-k work arrays (values, int64 keys, sort, gather, ~40 bytes per candidate) and output.
    """
    wes = 2 if dtype == "float16" else 4
    n = n_elements
    rows = n // max(row_len, 1)
    if sparse is not None:
        k = min(getattr(sparse, "top_k", None) or row_len, row_len)
        work = rows * k * 40 if k < row_len else n  # top-k arrays, or the threshold mask
        kept = rows * k
        return work + kept * (8 + 4 + 8) + kept * (8 + wes) * 3  # flat/values, b64
    if layout == "tril":
        n = rows * (row_len + 1) // 2
        packed = 4 * n  # the packed float32 copy
    else:
        packed = 0
    if encoding == "json":
        return packed + (4 * n if round_ is not None else 0) + 160 * rows + 4 * CHUNK_BYTES
    cast = n * wes if (wes != 4) else 0
    if encoding == "base64":
        return packed + cast + 2 * (n * wes * 4 // 3)  # base64 bytes, then the str
    return packed + cast  # binary: sent from these arrays without further copies


_ST_DTYPE = {"float32": "F32", "float16": "F16", "int32": "I32", "int64": "I64"}
_WIRE = {"float32": "<f4", "float16": "<f2", "int32": "<i4", "int64": "<i8"}


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


def _encode_tril(
    a: np.ndarray, encoding: str, dtype: str, round_: int | None, name: str, fill: str
) -> Any:
    """Lower triangle (key_pos <= query_pos) of ``a [..., T, T]``, row by row."""
    if a.ndim < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"layout 'tril' needs [..., T, T]; {name} has shape {list(a.shape)}")
    T = a.shape[-1]
    if encoding == "json":
        a = _json_array(a, round_)

        def rows(m: np.ndarray) -> list:
            if m.ndim == 2:
                return [m[q, : q + 1] for q in range(T)]
            return [rows(x) for x in m]

        return {"encoding": "tril", "shape": list(a.shape), "data": rows(a), "fill": fill}
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
        vals, keys = torch.topk(rows, top_k, dim=-1, sorted=False)
        _check_finite(vals.numpy(), name, False)  # NaN / +inf rank first: they would be here
        keys, order = torch.sort(keys, dim=-1)
        vals = torch.gather(vals, -1, order)
        keep = vals > 0
        if thr is not None:
            keep &= vals >= thr
        row_mass = torch.where(keep, vals.double(), 0.0).sum(-1).float()
        flat = (torch.arange(R).unsqueeze(-1) * K + keys)[keep]
        values = vals[keep]
    else:
        _check_finite(x.numpy(), name, False)
        keep = rows >= thr if thr is not None else rows > 0
        flat = keep.view(-1).nonzero().squeeze(-1)
        values = rows.view(-1)[flat]
        row_mass = torch.from_numpy(np.bincount(
            (flat // K).numpy(), weights=values.numpy(), minlength=R).astype(np.float32))
    n_total = int(np.prod(shape, dtype=np.int64))
    fmt = getattr(opts, "format", "flat")
    if fmt == "coo":
        idx = np.stack(np.unravel_index(flat.numpy(), shape), axis=-1).astype(np.int32)
        iwire = "int32"
    else:
        iwire = "int32" if n_total < 2**31 else "int64"
        idx = flat.numpy().astype(_WIRE[iwire])
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


def _default(obj: Any) -> Any:
    if isinstance(obj, Base64Text):
        return orjson.Fragment(b'"' + obj.raw + b'"')
    raise TypeError(f"Type is not JSON serializable: {type(obj).__name__}")


def dumps(content: Any) -> bytes:
    return orjson.dumps(content, default=_default,
                        option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)


class ORJSONResponse(JSONResponse):  # a JSONResponse, so OpenAPI documents response models
    """JSON response rendered by orjson (numpy-aware)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)


# ---------------------------------------------------------------------------- responses
SAFETENSORS = "application/x-safetensors"
STREAM_MIN_BYTES = 4 << 20  # JSON bodies whose arrays exceed this are streamed in chunks
CHUNK_BYTES = 1 << 20


def wants_binary(accept: str | None) -> bool:
    """True when the ``Accept`` header prefers ``application/x-safetensors`` (q > 0) to JSON.

    Raises:
        NotAcceptable: the header names media types, none of which we can produce (406).
    """
    if not accept or not accept.strip():
        return False  # no (or a blank) Accept header: any media type (RFC 9110 12.5.1)
    best: dict[str, float] = {}
    for part in accept.split(","):
        bits = [b.strip() for b in part.split(";")]
        media = bits[0].lower()
        if not media:
            continue
        q = 1.0
        for b in bits[1:]:
            if b[:2].lower() == "q=":
                try:
                    q = float(b[2:])
                except ValueError:
                    q = float("nan")
                if not float("-inf") < q < float("inf"):  # NaN or infinite
                    raise NotAcceptable(
                        f"Accept: the q value {b[2:][:40]!r} of {media[:60]!r} is not a number "
                        "in [0, 1]", "Accept",
                    )
                q = min(max(q, 0.0), 1.0)  # RFC 9110 12.4.2: qvalue in [0, 1]
        best[media] = max(best.get(media, 0.0), q)
    if not best:
        return False  # only separators (',', ';'): no preference stated
    st = best.get(SAFETENSORS, 0.0)
    js = max(best.get("application/json", 0.0), best.get("application/*", 0.0),
             best.get("*/*", 0.0))
    if st <= 0 and js <= 0:
        raise NotAcceptable(
            f"Accept: {accept[:120]!r} names no media type this endpoint produces; use "
            f"application/json or {SAFETENSORS}", "Accept",
        )
    return st > js or (st > 0 and st == js and "application/json" not in best)


def _array_bytes(obj: Any) -> int:
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, (str, Base64Text)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(_array_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_array_bytes(v) for v in obj) if len(obj) < 4096 else 8 * len(obj)
    return 0


def _split_big(obj: Any, big: dict, nonce: str) -> Any:
    """Replace big arrays/strings by sentinel strings (collected into ``big``)."""
    if isinstance(obj, np.ndarray) and obj.nbytes > CHUNK_BYTES or (
        isinstance(obj, str) and len(obj) > CHUNK_BYTES
    ) or (isinstance(obj, Base64Text) and len(obj) > CHUNK_BYTES) or (
        isinstance(obj, list) and len(obj) > 256
    ):
        key = f"\x00{nonce}:{len(big)}\x00"
        big[key] = obj
        return key
    if isinstance(obj, dict):
        return {k: _split_big(v, big, nonce) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_split_big(v, big, nonce) for v in obj]
    return obj


def _iter_value(v: Any) -> Iterator[bytes | memoryview]:
    if isinstance(v, Base64Text):  # verbatim: zero-copy slices of the ASCII bytes
        yield b'"'
        mv = memoryview(v.raw)
        for i in range(0, len(mv), CHUNK_BYTES):
            yield mv[i : i + CHUNK_BYTES]
        yield b'"'
    elif isinstance(v, str):
        yield b'"'
        for i in range(0, len(v), CHUNK_BYTES):
            yield dumps(v[i : i + CHUNK_BYTES])[1:-1]
        yield b'"'
    elif isinstance(v, np.ndarray) and v.nbytes > CHUNK_BYTES and v.ndim > 1:
        yield b"["
        for i, sub in enumerate(v):
            if i:
                yield b","
            yield from _iter_value(sub)
        yield b"]"
    elif isinstance(v, np.ndarray) and v.nbytes > CHUNK_BYTES and v.size:
        step = max(1, CHUNK_BYTES // v.itemsize)
        yield b"["
        for i in range(0, v.size, step):
            if i:
                yield b","
            yield dumps(v[i : i + step])[1:-1]
        yield b"]"
    elif isinstance(v, list) and len(v) > 256:
        yield b"["
        for i in range(0, len(v), 256):
            if i:
                yield b","
            yield from (dumps(v[i : i + 256])[1:-1],)
        yield b"]"
    else:
        yield dumps(v)


def iter_json(body: Any) -> Iterator[bytes]:
    """The JSON of ``body`` as ~CHUNK_BYTES pieces (same bytes as :func:`dumps`)."""
    big: dict[str, Any] = {}
    skeleton = dumps(_split_big(body, big, uuid.uuid4().hex))
    buf: list[bytes] = []
    size = 0
    pos = 0
    for key, v in big.items():
        marker = dumps(key)
        at = skeleton.index(marker, pos)
        pieces = [skeleton[pos:at]]
        pos = at + len(marker)
        for piece in _iter_value(v):
            pieces.append(piece)
            size += len(piece)
            buf.extend(pieces)
            pieces = []
            if size >= CHUNK_BYTES:
                yield b"".join(buf)
                buf, size = [], 0
        buf.extend(pieces)
    buf.append(skeleton[pos:])
    yield b"".join(buf)


def _collect_binary(obj: Any, out: list) -> Any:
    if isinstance(obj, BinaryTensor):
        out.append(obj)
        return obj.ref()
    if isinstance(obj, dict):
        return {k: _collect_binary(v, out) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_collect_binary(v, out) for v in obj]
    if isinstance(obj, np.ndarray):  # a small json-encoded array in a binary response
        return obj.tolist()
    return obj


def safetensors_parts(body: Any) -> list[bytes | memoryview]:
    """``body`` as a safetensors file: [header, tensor bytes...] (concatenate to get the file).

    Header: u64 little-endian length + JSON ``{name: {"dtype", "shape", "data_offsets"},
    "__metadata__": {"attnscope": <JSON body with BinaryTensorRef in place of tensors>}}``,
    space-padded to a multiple of 8 (safetensors spec). Readable by ``safetensors.numpy.load``
    and by ``clients/python/attnscope/client/wire.py`` (numpy only).
    """
    tensors: list[BinaryTensor] = []
    meta = _collect_binary(body, tensors)
    header: dict[str, Any] = {"__metadata__": {"attnscope": dumps(meta).decode("utf-8")}}
    off = 0
    for bt in tensors:
        n = bt.array.nbytes
        header[bt.name] = {"dtype": _ST_DTYPE[bt.dtype], "shape": list(bt.array.shape),
                           "data_offsets": [off, off + n]}
        off += n
    h = dumps(header)
    h += b" " * (-(len(h)) % 8)
    parts: list[bytes | memoryview] = [len(h).to_bytes(8, "little") + h]
    for bt in tensors:
        mv = memoryview(np.ascontiguousarray(bt.array)).cast("B")
        for i in range(0, len(mv), 16 * CHUNK_BYTES):
            parts.append(mv[i : i + 16 * CHUNK_BYTES])
    return parts


async def tensor_response(
    build: Callable[[], Any], binary: bool = False, status_code: int = 200,
    run: Callable[[Callable[[], Any]], Awaitable[Any]] | None = None,
) -> Response:
    """Run ``build()`` (all tensor work: selection, encode_tensor) off the event loop, with
    ``run`` (e.g. on the device thread: DeviceSlot.run) or else in a worker thread, and return
    its body: safetensors when ``binary``, else JSON (streamed in chunks when big).

    Errors raised by ``build`` (NonFiniteValues, ...) propagate before any byte is sent.
    """
    body = await (run(build) if run is not None else anyio.to_thread.run_sync(build))
    if binary:
        parts = await anyio.to_thread.run_sync(safetensors_parts, body)
        del body
        length = sum(len(p) for p in parts)
        return StreamingResponse(_then_release(iter(parts)), status_code=status_code,
                                 media_type=SAFETENSORS, headers={"content-length": str(length)})
    if _array_bytes(body) < STREAM_MIN_BYTES:
        return ORJSONResponse(body, status_code=status_code)
    return StreamingResponse(_then_release(iter_json(body)), status_code=status_code,
                             media_type="application/json")


def _then_release(chunks: Iterator[Any]) -> Iterator[Any]:
    """Yield ``chunks``; once they are all sent (the body freed), trim the heap."""
    from attnscope.service.serving.core.memory import release_memory

    yield from chunks
    if isinstance(chunks, list):
        chunks.clear()
    del chunks
    release_memory()
