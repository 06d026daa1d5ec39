"""Request helpers shared by routers: model-aware validation and the forward call."""

from __future__ import annotations

import anyio.to_thread
import numpy as np

from attnscope.schemas.common import TextOrTexts
from attnscope.service.errors import BatchTooLarge, InvalidRequest, OutOfRange
from attnscope.service.runtime import ForwardResult, Runtime, TokenizedText
from attnscope.service.runtime.slot import DeviceSlot
from attnscope.service.runtime.memory import check_memory, release_memory


def check_indices(values: list[int] | None, limit: int, field: str, what: str) -> None:
    """422 unless every index is in [0, limit) and none repeats (so the list has at most
    ``limit`` entries: a repeated index would only multiply the work and the response)."""
    if values is None:
        return
    if len(values) == 0:
        raise OutOfRange(f"{field} must hold at least one {what} index (or be null for all)", field)
    # vectorised (issue 17: a 3.9 MB list took 1.1 s of event-loop time element by element):
    # the first index out of range, in order, then the first repeat, as the loop reported them
    # distinct indices in [0, limit) are at most ``limit``: among the first limit + 1 there is
    # an out-of-range index or a repeat, so only those are looked at (O(limit) for any length)
    values = values[: limit + 1]
    arr = _as_int64(values)
    if arr is None:  # an integer beyond int64: out of range, found by a plain scan
        i = next(i for i, v in enumerate(values) if not 0 <= v < limit)
        check_index(values[i], limit, what, f"{field}[{i}]", f"{field}.{i}")
    bad = (arr < 0) | (arr >= limit)
    if bad.any():
        i = int(bad.argmax())
        check_index(values[i], limit, what, f"{field}[{i}]", f"{field}.{i}")
    check_distinct(values, field, arr)


def check_index(value: int | None, limit: int, what: str, name: str, param: str | None = None) -> None:
    """422 ``out_of_range`` unless ``value`` (a layer/head index; None = not given) is in
    [0, limit). ``name`` is how the message shows the field, ``param`` the envelope's param
    (default ``name``)."""
    if value is not None and not 0 <= value < limit:
        raise OutOfRange(
            f"{name} = {value} is out of range: the model has {limit} {what}s "
            f"(valid indices 0..{limit - 1})",
            param or name,
        )


def _as_int64(values) -> np.ndarray | None:
    try:
        return np.asarray(values, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        return None


def check_distinct(values, field: str, arr: np.ndarray | None = None) -> None:
    """422 (validation_error, param ``field.<i>``) at the first value that repeats an earlier
    one. O(n log n) in numpy (``arr``: ``values`` as int64, when already converted)."""
    if values is None or len(values) < 2:
        return
    arr = _as_int64(values) if arr is None else arr
    if arr is None:  # beyond int64: a dictionary scan
        seen: dict[int, int] = {}
        for i, v in enumerate(values):
            if v in seen:
                raise InvalidRequest(
                    f"{field}[{i}] = {v} repeats {field}[{seen[v]}]; each index may appear once",
                    f"{field}.{i}",
                )
            seen[v] = i
        return
    _, first, inverse = np.unique(arr, return_index=True, return_inverse=True)
    firsts = first[inverse.reshape(-1)]
    repeats = firsts != np.arange(arr.size)
    if repeats.any():
        i = int(repeats.argmax())
        raise InvalidRequest(
            f"{field}[{i}] = {values[i]} repeats {field}[{int(firsts[i])}]; each index may "
            "appear once", f"{field}.{i}",
        )


async def tokenize_request(rt: Runtime, req: TextOrTexts) -> list[TokenizedText]:
    """Tokenize every text (off the event loop), checking batch size and context length."""
    texts = req.all_texts()
    if req.texts is not None and len(texts) > rt.settings.max_batch:
        raise BatchTooLarge(
            f"texts holds {len(texts)} texts; the limit is {rt.settings.max_batch} (max_batch)",
            "texts",
        )

    def work():
        if req.text is not None:
            return [rt.tokenize(req.text, req.add_bos, "text")]
        return [rt.tokenize(t, req.add_bos, f"texts.{i}") for i, t in enumerate(texts)]

    if req.text is not None:  # already tokenized (another analysis of this text): no thread hop
        hit = rt.tokenize(req.text, req.add_bos, "text", cached_only=True)
        if hit is not None:
            return [hit]
    return await anyio.to_thread.run_sync(work)


async def forward_request(
    rt: Runtime, slot: DeviceSlot, items: list[TokenizedText], response_bytes: int = 0,
    detail: str = "",
) -> list[ForwardResult]:
    """One recorded forward per distinct text, through the device slot (429 when full);
    texts whose forwards are all cached are answered at once, without the slot.

    First the memory check (service/runtime/memory.py): 422 ``memory_limit_exceeded`` when the
    forwards plus ``response_bytes`` (the endpoint's estimate of its response) would exceed
    ``max_request_bytes``; no forward runs then (``detail``: added to the message's text count).
    """
    check_memory(rt, [len(it) for it in items], response_bytes, limit=slot.max_request_bytes,
                 detail=detail)
    hits = rt.cached_forwards(items)  # all cached (a further analysis of a text): no device wait
    if hits is not None:
        return hits
    return await slot.run(_forward_and_release, rt, items)


async def on_device(slot: DeviceSlot, forwards: list[ForwardResult], fn, *args):
    """Run an analysis's tensor work ``fn(*args)`` on the device thread (slot.run). A request
    whose forwards all came from the cache has not been admitted yet: this is its admission
    (429 when the queue is full); one that waited for a forward is never refused now."""
    return await slot.run(fn, *args, admit=all(fw.cached for fw in forwards), record=False)


def _forward_and_release(rt: Runtime, items: list[TokenizedText]) -> list[ForwardResult]:
    results = rt.forward_many(items)
    if not all(r.cached for r in results):
        release_memory()  # the forward's transient tensors go back to the OS
    return results


def error_responses(invalid: str = "Invalid request (field, limit and value named).",
                    *, device: bool = True) -> dict:
    """OpenAPI ``responses`` of a /v1 route: every status it can answer besides 200, each with
    the error envelope. ``invalid`` describes the route's own 422 cases; ``device=False`` for
    routes that never wait for the device (no 429)."""
    from attnscope.schemas import ErrorResponse

    out = {
        401: {"model": ErrorResponse, "description": "API keys are configured and none was valid."},
        413: {"model": ErrorResponse, "description": "Request body too large."},
        422: {"model": ErrorResponse, "description": invalid},
        429: {"model": ErrorResponse, "description": "Overloaded: the device queue is full."},
        503: {"model": ErrorResponse, "description": "The model is not loaded yet."},
        504: {"model": ErrorResponse, "description": "The request ran past request_timeout_s."},
    }
    if not device:
        del out[429]
    return out
