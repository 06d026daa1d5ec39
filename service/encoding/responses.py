"""Responses: a body (plain dict with numpy arrays and the lazy wire forms of :mod:`.codecs`)
-> JSON or safetensors bytes, streamed in bounded chunks, off the event loop.

* :func:`dumps` / :class:`ORJSONResponse`: one orjson call, for small bodies;
* :func:`iter_json`: the same bytes as ``dumps(body)`` in pieces of ~``CHUNK_BYTES``: it walks
  the body's dicts and lists and writes every array and lazy form through its own bounded
  ``pieces`` (one vectorised orjson / base64 call per piece, never one per element);
* :func:`safetensors_parts`: a binary body as a safetensors file (header + zero-copy slices);
* :class:`ChunkedResponse`: sends such an iterator, producing every chunk in a worker thread
  (the GIL is released between chunks and memory holds about one chunk), and
  - stops at the request's deadline (``request_timeout_s``, put in the scope by
    ``service.ops.middlewares.TimeoutMiddleware``): the response is cut, a warning logged, and
    the connection closed without the end of the body, so the client sees an *incomplete* body
    (chunked JSON: no final chunk; safetensors: fewer bytes than Content-Length; httpx raises
    ``RemoteProtocolError``), never a truncated body that parses;
  - stops when the client disconnects, and in both cases closes the iterator (dropping the
    body) and gives the freed heap back to the OS (``release_memory(0)``).
* :func:`tensor_response`: run the build off the event loop and pick one of the above.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Awaitable, Callable, Iterable, Iterator

import anyio
import anyio.to_thread
import numpy as np
import orjson
from fastapi.responses import JSONResponse, Response

from .codecs import (
    _ST_DTYPE, LAZY, Base64Text, BinaryTensor, RoundedArray, TrilRows, array_pieces,
)
from .negotiation import SAFETENSORS

log = logging.getLogger("attnscope.encoding")

STREAM_MIN_BYTES = 4 << 20  # JSON bodies whose arrays exceed this are streamed in chunks
CHUNK_BYTES = 1 << 20
#: scope key holding the request's deadline (``time.monotonic()`` seconds), set by
#: service.ops.middlewares.TimeoutMiddleware when request_timeout_s > 0
DEADLINE_KEY = "attnscope.deadline"


def _default(obj: Any) -> Any:
    if isinstance(obj, Base64Text):
        return orjson.Fragment(b'"' + obj.raw + b'"')
    if isinstance(obj, (RoundedArray, TrilRows)):
        return orjson.Fragment(b"".join(obj.pieces(1 << 62)))
    raise TypeError(f"Type is not JSON serializable: {type(obj).__name__}")


def dumps(content: Any) -> bytes:
    return orjson.dumps(content, default=_default,
                        option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)


class ORJSONResponse(JSONResponse):  # a JSONResponse, so OpenAPI documents response models
    """JSON response rendered by orjson (numpy-aware, lazy wire forms included)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)


# ---------------------------------------------------------------------------- JSON pieces
_SCALARS = (int, float, bool, type(None))
_SCALAR_TYPES = frozenset(_SCALARS)  # exact types (a subclass, e.g. np.float64, walks the slow path)


def _array_bytes(obj: Any) -> int:
    """About how many bytes of arrays/strings ``obj`` holds (decides streaming and pieces):
    an array's or lazy wire form's ``nbytes``, a string's length, 8 per scalar or other leaf,
    24 per item of a list of 4096 or more scalars. One iterative walk that counts the scalars
    of a dict or list in place (a /v1/heads body of ~10k scalars: ~1.2 ms instead of ~2.6 ms
    for one call per value, on the event loop)."""
    total = 0
    stack = [obj]
    while stack:
        x = stack.pop()
        if type(x) in _SCALAR_TYPES:
            total += 8
            continue
        if isinstance(x, (np.ndarray, *LAZY)):
            total += x.nbytes
            continue
        if isinstance(x, (str, bytes)):
            total += len(x)
            continue
        if isinstance(x, dict):
            x = list(x.values())
        elif not isinstance(x, (list, tuple)):
            total += 8
            continue
        elif len(x) >= 4096 and isinstance(x[0], _SCALARS):
            total += 24 * len(x)
            continue
        inner = [v for v in x if type(v) not in _SCALAR_TYPES]
        total += 8 * (len(x) - len(inner))
        stack.extend(inner)
    return total


def _pieces(obj: Any, chunk: int) -> Iterator[bytes | memoryview]:
    """JSON of ``obj`` as pieces (concatenated: exactly ``dumps(obj)``)."""
    if isinstance(obj, LAZY):
        if isinstance(obj, Base64Text):
            yield b'"'
            yield from obj.pieces(chunk)
            yield b'"'
        else:
            yield from obj.pieces(chunk)
    elif isinstance(obj, np.ndarray):
        yield from array_pieces(obj, chunk)
    elif isinstance(obj, str):
        if len(obj) <= chunk:
            yield dumps(obj)
        else:
            yield b'"'
            for i in range(0, len(obj), chunk):
                yield dumps(obj[i : i + chunk])[1:-1]
            yield b'"'
    elif isinstance(obj, dict):
        if _array_bytes(obj) <= chunk:
            yield dumps(obj)
            return
        yield b"{"
        for i, (k, v) in enumerate(obj.items()):
            yield (b"," if i else b"") + dumps({k: 0})[1:-2]  # '"key":' as orjson writes it
            yield from _pieces(v, chunk)
        yield b"}"
    elif isinstance(obj, (list, tuple)):
        if len(obj) <= 256 and _array_bytes(obj) <= chunk:
            yield dumps(obj)
            return
        yield b"["
        first = True
        lo, size = 0, 0
        for i, v in enumerate(obj):  # runs of small items: one dumps per run (<= 256 items)
            s = _array_bytes(v)
            if s > chunk:
                if lo < i:
                    yield (b"" if first else b",") + dumps(obj[lo:i])[1:-1]
                    first = False
                if not first:
                    yield b","
                first = False
                yield from _pieces(v, chunk)
                lo, size = i + 1, 0
                continue
            if i - lo >= 256 or size + s > chunk:
                yield (b"" if first else b",") + dumps(obj[lo:i])[1:-1]
                first = False
                lo, size = i, 0
            size += s
        if lo < len(obj):
            yield (b"" if first else b",") + dumps(obj[lo:])[1:-1]
        yield b"]"
    else:
        yield dumps(obj)


def iter_json(body: Any, chunk: int | None = None) -> Iterator[bytes]:
    """The JSON of ``body`` as ~``chunk`` (default CHUNK_BYTES) pieces: the same bytes as
    :func:`dumps`, linear in the body's size, each piece one bounded orjson/base64 call."""
    chunk = CHUNK_BYTES if chunk is None else chunk
    buf: list = []
    size = 0
    for piece in _pieces(body, chunk):
        buf.append(piece)
        size += len(piece)
        if size >= chunk:
            yield b"".join(buf)
            buf, size = [], 0
    if buf:
        yield b"".join(buf)


# ---------------------------------------------------------------------------- safetensors
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
    and by ``clients/python/attnscope/client/wire.py`` (numpy only). The tensor parts are
    zero-copy slices of the arrays (16 x CHUNK_BYTES each).
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


# ---------------------------------------------------------------------------- the response
def _no_release(min_free_bytes: int | None = None) -> bool:
    return False


#: Gives freed heap memory back to the OS once a body is gone; the app wires in the runtime's
#: ``release_memory`` (service/app.py) so this layer imports nothing above it.
_release_heap: Callable[..., object] = _no_release


def set_heap_release(fn: Callable[..., object] | None) -> None:
    """Set the function called with ``0`` (trim now) after an early-ended stream and with no
    argument after a completed one (None: do nothing)."""
    global _release_heap
    _release_heap = fn or _no_release


class ChunkedResponse(Response):
    """Send ``chunks`` (a sync iterator of bytes), each produced in a worker thread.

    Bounded in time and memory: past the request's deadline (scope[DEADLINE_KEY]) or when the
    client disconnects the iterator is closed, its body dropped and the heap trimmed; a cut
    response ends without its last chunk (see the module docstring for what the client
    sees). ``content_length``: sent as Content-Length (safetensors), else chunked encoding.
    """

    def __init__(self, chunks: Iterable, status_code: int = 200,
                 media_type: str = "application/json", content_length: int | None = None,
                 headers: dict | None = None, on_close: Callable[[], None] | None = None):
        self.chunks = iter(chunks)
        self.on_close = on_close
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        h = dict(headers or {})
        if content_length is not None:
            h["content-length"] = str(content_length)
        self.init_headers(h)
        if content_length is None:  # init_headers added content-length: 0 for no body
            self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]

    async def __call__(self, scope, receive, send) -> None:
        deadline = scope.get(DEADLINE_KEY)
        it = self.chunks
        state = {"sent": 0, "why": None}
        try:
            async with anyio.create_task_group() as tg:
                async def watch():
                    while True:
                        msg = await receive()
                        if msg["type"] == "http.disconnect":
                            state["why"] = state["why"] or "disconnect"
                            tg.cancel_scope.cancel()
                            return

                tg.start_soon(watch)
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                with anyio.move_on_after(timeout) as scope_t:
                    await send({"type": "http.response.start", "status": self.status_code,
                                "headers": self.raw_headers})
                    while True:
                        # not cancellable while a chunk is being made: never two threads in
                        # one generator, and the close below runs after it
                        chunk = await anyio.to_thread.run_sync(next, it, None)
                        if chunk is None:
                            break
                        await send({"type": "http.response.body", "body": chunk,
                                    "more_body": True})
                        state["sent"] += len(chunk)
                    state["why"] = "done"
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                if scope_t.cancelled_caught and state["why"] is None:
                    state["why"] = "deadline"
                tg.cancel_scope.cancel()
        finally:
            self.chunks = None
            close = getattr(it, "close", None)
            del it
            if close is not None:
                close()  # drops the generator's frame: the body it walked
            del close
            if state["why"] != "done":
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(_release_heap, 0)
            if self.on_close is not None:
                self.on_close()  # e.g. the memory budget's ticket: the body is gone
        if state["why"] == "deadline":
            log.warning("response cut at the request's deadline (request_timeout_s) after %d "
                        "bytes; the connection is closed without the end of the body",
                        state["sent"], extra={"fields": {"path": scope.get("path"),
                                                         "bytes_sent": state["sent"]}})
        elif state["why"] == "disconnect":
            log.info("client disconnected mid-response after %d bytes; its body was freed",
                     state["sent"], extra={"fields": {"path": scope.get("path"),
                                                      "bytes_sent": state["sent"]}})


def _then_release(chunks: Iterable) -> Iterator:
    """Yield ``chunks``; once they are all sent, trim the heap (the body is freed). A stream
    that stops early is trimmed by :class:`ChunkedResponse` (in a worker thread)."""
    yield from chunks
    del chunks
    _release_heap()


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
    return await respond(body, binary, status_code)


class _ClosingResponse(Response):
    """A one-shot Response that calls ``on_close`` once sent (or when sending failed)."""

    def __init__(self, content: bytes, status_code: int, headers: dict | None,
                 on_close: Callable[[], None] | None):
        super().__init__(content, status_code=status_code, media_type="application/json",
                         headers=headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.body = b""
            if self.on_close is not None:
                self.on_close()


#: True puts :func:`respond`'s size walk back on the event loop (bench/loop_stalls.py's
#: "before" and the planted fault of tests/test_loop_stalls.py); never set in service
SIZE_ON_LOOP = False


def _is_small(body: Any) -> bool:
    """Whether ``body`` is sent in one piece (its arrays under STREAM_MIN_BYTES)."""
    return _array_bytes(body) < STREAM_MIN_BYTES


async def respond(body: Any, binary: bool = False, status_code: int = 200,
                  headers: dict | None = None,
                  on_close: Callable[[], None] | None = None) -> Response:
    """The response for a finished ``body`` (a dict whose tensors went through
    ``encode_tensor``): one safetensors file when ``binary``; one-shot JSON when its arrays
    are under STREAM_MIN_BYTES (rendered in a worker thread); else JSON streamed in bounded
    chunks (:class:`ChunkedResponse`: each chunk made in a worker thread, cut at the
    deadline, freed on disconnect). ``on_close``: called on the event loop once the response
    is over (sent, cut, or its client gone), e.g. to give back a memory-budget ticket."""
    if binary:
        parts = await anyio.to_thread.run_sync(safetensors_parts, body)
        del body
        length = sum(len(p) for p in parts)
        return ChunkedResponse(_then_release(parts), status_code, SAFETENSORS, length, headers,
                               on_close)
    # the size walk visits every object of the body (a links body: a million dicts, ~1 s):
    # in a worker thread, which gives the GIL back every switch interval, not on the loop
    small = (_array_bytes(body) < STREAM_MIN_BYTES if SIZE_ON_LOOP else
             await anyio.to_thread.run_sync(_is_small, body))
    if small:
        content = await anyio.to_thread.run_sync(dumps, body)
        return _ClosingResponse(content, status_code, headers, on_close)
    return ChunkedResponse(_then_release(iter_json(body)), status_code, "application/json",
                           None, headers, on_close)


body_response = respond
