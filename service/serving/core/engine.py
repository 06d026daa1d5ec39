"""The engine: the one object an endpoint calls (docs/architecture.md, "Layers").

It owns the runtime (the resident model), the device slot, the memory limit and the metrics.
An endpoint hands it a request and the feature's ``plan`` function; the engine

1. resolves ``add_bos`` (null -> the model's convention, service/serving/core/inputs.py) and
   tokenizes the request's ``text``/``texts`` or takes its ``tokens``/``token_lists`` as given
   (off the event loop unless already cached),
2. calls ``plan(runtime, request, items)``: the feature's model-aware checks, its response
   estimate and its ``job`` (a pure analysis over recorded forwards, see service/serving/),
3. checks memory (422 ``memory_limit_exceeded`` over ``max_request_bytes``; the recorded
   forwards plus the plan's ``response_bytes``) before any forward runs,
4. in ONE device turn: takes the cached forwards or runs the missing ones, then runs the job,
5. returns the response (JSON, streamed when big, or safetensors) through the encoding layer;
   or, for a request that asked for NDJSON (``Accept: application/x-ndjson``) to a plan that
   reports progress (``Plan.progress``), streams progress lines while the job runs and the
   body as the last line (:meth:`Engine.stream`, docs/api.md "Streamed progress").

So one request makes one engine call and one device turn: router -> engine(serving(analysis(
recorded forwards))) -> response.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import anyio.to_thread
from fastapi import Response

from ...analysis._blas import torch_threads_for
from ...encoding import dumps, respond
from ...errors import (
    AttnscopeError, BatchTooLarge, DeviceLimitExceeded, NotReady, ShuttingDown, Timeout,
    envelope,
)
from . import cancel
from .budget import MemoryBudget, Ticket, default_budget
from .estimates import check_device, forward_flops
from .inputs import resolve_add_bos, with_add_bos
from .memory import check_memory, release_memory
from ...runtime.model import Runtime
from ...runtime.results import ForwardResult, TokenizedText


@dataclass
class Plan:
    """What a feature needs from one device turn.

    ``items``: the tokenized texts whose recorded forwards ``job`` reads (cache first; may be
    empty: a job that needs no forward, still admitted through the device slot).
    ``job(forwards) -> body``: runs on the device thread, ``forwards`` in ``items`` order; it
    returns the response body (a dict whose tensors went through ``encoding.encode_tensor``).
    ``response_bytes``: the estimated size of the response and the job's own tensors, in bytes
    (counted with the forwards against ``max_request_bytes``). ``device_flops``: the job's own
    device work (floating-point operations; service/serving/core/estimates.py), counted with
    the recorded forwards of ``items`` against ``max_request_flops`` (422 naming
    ``device_param``, default ``text``/``texts``). ``detail``: text added to a
    memory refusal's text count (e.g. ", one of them the induction probe"). ``small_ops``: the
    job is many small torch ops; it runs them on one intra-op thread when its longest text has
    at most ``SMALL_JOB_TOKENS`` tokens (``analysis._blas.torch_threads_for``).
    """

    items: list[TokenizedText]
    job: Callable[[list[ForwardResult]], Any]
    response_bytes: int = 0
    device_flops: float = 0.0
    device_param: str | None = None
    detail: str = ""
    status_code: int = 200
    headers: dict = field(default_factory=dict)
    small_ops: bool = False
    #: the unit of the job's progress reports (``"cells"``, ``"pairs"``; cancel.progress), or
    #: None: the job reports none and a request for NDJSON gets the plain JSON response
    progress: str | None = None

    def run_job(self, forwards: list[ForwardResult]) -> Any:
        """``job(forwards)``, on one intra-op thread where ``small_ops`` says so."""
        if not (self.small_ops and self.items):
            return self.job(forwards)
        with torch_threads_for(max(len(it) for it in self.items)):
            return self.job(forwards)


class Engine:
    """Reads its parts from the app's state (``runtime``, ``slot``, ``metrics``,
    ``settings``), so apps built around an existing Runtime (tests) need nothing more."""

    def __init__(self, state):
        self._state = state

    # ------------------------------------------------------------------ parts
    @property
    def runtime(self) -> Runtime:
        """The resident model. Raises :class:`NotReady` (503) until it is loaded."""
        rt = getattr(self._state, "runtime", None)
        if rt is None:
            err = getattr(self._state, "load_error", None)
            raise NotReady("the model is not loaded" + (f": {err}" if err else " yet; retry shortly"))
        return rt

    @property
    def slot(self):
        return self._state.slot

    @property
    def max_request_bytes(self) -> int:
        return self.slot.max_request_bytes

    # ------------------------------------------------------------------ the one call
    async def serve(self, req, plan: Callable[[Runtime | None, Any, list[TokenizedText]], Plan],
                    *, check: Callable[[Runtime, Any], None] | None = None,
                    binary: bool = False, tokenize: bool = True,
                    needs_model: bool = True, request=None, stream: bool = False) -> Response:
        """Answer ``req`` with ``plan``'s job, in one device turn (module docstring).

        ``check(runtime, req)``: the feature's token-independent checks, made before
        tokenizing (cheapest first). ``tokenize=False``: the request has no ``text``/``texts`` (``items`` is empty).
        ``needs_model=False``: the plan may run before the model is loaded (it gets None for
        the runtime). ``binary``: the response as one safetensors file. ``request``: the
        Starlette request; its deadline (``request_timeout_s``) and its client's disconnect
        cancel the job (service/serving/core/cancel.py). ``stream``: the client asked for
        NDJSON; where the plan reports progress the answer is :meth:`stream`'s.

        Raises (each becomes the error envelope): the plan's own 4xx checks,
        :class:`BatchTooLarge` / context-length 422s from tokenizing,
        ``MemoryLimitExceeded`` / ``DeviceLimitExceeded`` (422), ``Overloaded`` (429),
        :class:`NotReady` / ``ShuttingDown`` (503), ``Timeout`` (504, the job stopped at the
        deadline, or the client went away: never sent, logged as 499).
        """
        rt = self.runtime if needs_model else getattr(self._state, "runtime", None)
        req = self.resolve(rt, req)
        if check is not None:
            check(rt, req)
        items = await self.tokenize(rt, req) if tokenize else []
        p = plan(rt, req, items)
        token = self.token_for(request)
        ticket = await self.admit(rt, p)  # held until the response's last byte (or cut)
        try:
            if stream and p.progress is not None and not binary:
                return await self.stream(req, rt, p, token, ticket, request)
            async with self.watching(request, token):
                body = await self.run(rt, p, admitted=True, token=token)
            body = with_add_bos(body, req)
            return await respond(body, binary, p.status_code, p.headers, on_close=ticket.release)
        except BaseException:
            ticket.release()
            raise

    # ------------------------------------------------------------------ streamed progress
    async def stream(self, req, rt: Runtime | None, p: Plan, token: cancel.CancelToken,
                     ticket: Ticket, request=None) -> Response:
        """``p``'s job as an NDJSON stream (media type :data:`NDJSON`): one line
        ``{"progress": {"done": n, "total": N, "unit": p.progress}}`` per report of the job
        (``cancel.progress``), throttled by :class:`ProgressLines`, then one last line: the
        normal response body (the same bytes as the JSON answer) or, when the job fails after
        the stream began, the error envelope ``{"error": {"type", "message", "param"}}`` (the
        HTTP status is 200 by then).

        The 200 is sent once the job has the device (its first progress report or its start):
        errors before that (admission 429, the queue, a cancelled wait) keep their status.
        The client's disconnect (:meth:`watching`, and the response's own watch) cancels the
        job; the budget ``ticket`` is given back once both the job and the response ended."""
        loop = asyncio.get_running_loop()
        lines: asyncio.Queue = asyncio.Queue()
        started = asyncio.Event()
        interval = float(getattr(self._state, "progress_interval_s", PROGRESS_INTERVAL_S))

        def put(item) -> None:  # any thread
            loop.call_soon_threadsafe(lines.put_nowait, item)

        token.progress = ProgressLines(lambda b: (put(b), loop.call_soon_threadsafe(started.set)),
                                       p.progress, interval)
        job = p.job

        def job_started(forwards):
            loop.call_soon_threadsafe(started.set)
            return job(forwards)

        turn = dataclasses.replace(p, job=job_started)

        async def work():
            async with self.watching(request, token):
                body = await self.run(rt, turn, admitted=True, token=token)
            return with_add_bos(body, req)

        task = loop.create_task(work())
        task.add_done_callback(lambda _t: lines.put_nowait(_DONE))
        waiter = loop.create_task(started.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            token.cancel(cancel.DISCONNECT)
            raise
        finally:
            waiter.cancel()
        if task.done() and not started.is_set():
            task.result()  # raises the error from before the job began: its own status
        return ProgressResponse(lines, task, token, ticket.release, p.headers)

    # ------------------------------------------------------------------ cancelling
    def token_for(self, request) -> cancel.CancelToken:
        """A cancel token for ``request``'s job: its deadline (the TimeoutMiddleware's,
        ``request_timeout_s``) when it has one. Raises ``ShuttingDown`` while draining."""
        if getattr(self._state, "draining", False):
            raise ShuttingDown("the service is shutting down; retry (another replica answers)")
        deadline = None
        if request is not None:
            from ...encoding import DEADLINE_KEY

            deadline = request.scope.get(DEADLINE_KEY)
        s = getattr(self._state, "settings", None)
        limit = float(getattr(s, "max_request_flops", 0) or 0)
        return cancel.CancelToken(deadline, RUN_FLOPS_SLACK * limit)

    @property
    def jobs(self) -> set:
        """The tokens of the jobs admitted and not finished (the drain cancels them)."""
        jobs = getattr(self._state, "jobs", None)
        if jobs is None:
            jobs = self._state.jobs = set()
        return jobs

    def cancel_all(self, reason: str = cancel.SHUTDOWN) -> int:
        """Cancel every job in flight (the server's drain); returns how many."""
        jobs = list(self.jobs)
        for t in jobs:
            t.cancel(reason)
        return len(jobs)

    @asynccontextmanager
    async def watching(self, request, token: cancel.CancelToken):
        """While the body runs: ``token`` is in :attr:`jobs`, and a task waits for the
        client's ``http.disconnect`` (the body was read already, so the next ``receive``
        returns only when the connection ends) and cancels ``token``."""
        jobs = self.jobs
        jobs.add(token)
        watcher = None
        if request is not None:
            receive = request.receive

            async def watch():
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        token.cancel(cancel.DISCONNECT)
                        return

            watcher = asyncio.get_running_loop().create_task(watch())
        try:
            yield token
        finally:
            jobs.discard(token)
            if watcher is not None:
                watcher.cancel()
                try:
                    await watcher
                except BaseException:  # noqa: BLE001 - its cancellation
                    pass

    def check_device(self, rt: Runtime | None, p: Plan) -> float:
        """The device-work check of one request (422 ``device_limit_exceeded`` over
        ``max_request_flops``): the recorded forwards of its items not in the cache plus the
        job's own ``device_flops``. Returns the estimate."""
        s = getattr(self._state, "settings", None) or getattr(rt, "settings", None)
        limit = float(getattr(s, "max_request_flops", 0) or 0)
        fwd = 0.0
        if rt is not None and p.items and rt.cached_forwards(p.items) is None:
            dims = model_dims(rt)
            fwd = sum(forward_flops(len(it), **dims) for it in
                      {it.input_ids: it for it in p.items}.values()
                      if not in_cache(rt, it.input_ids))
        return check_device(fwd, float(p.device_flops or 0), limit, len(p.items),
                            max((len(it) for it in p.items), default=0), p.detail,
                            device_param(p))

    @property
    def budget(self) -> MemoryBudget:
        """The global memory budget (service/serving/core/budget.py), made on first use (after the
        model loaded: the auto budget subtracts the process's memory with the model)."""
        b = getattr(self._state, "budget", None)
        if b is None:
            s = getattr(self._state, "settings", None)
            total = getattr(s, "memory_budget_bytes", -1) if s is not None else -1
            if total == 0:
                total = default_budget(getattr(s, "cache_bytes", 0))
            state = self._state

            def held() -> int:  # memory owned on purpose: the forward cache's tensors
                rt = getattr(state, "runtime", None)
                cache = getattr(rt, "cache", None)
                return int(getattr(cache, "nbytes", 0) or 0)
            b = self._state.budget = MemoryBudget(max(total, 0), getattr(s, "budget_wait_s", 5.0),
                                                  held=held)
        return b

    async def admit(self, rt: Runtime | None, p: Plan) -> Ticket:
        """The memory check of one request (422 over ``max_request_bytes``), its device-work
        check (422 over ``max_request_flops``), then its room in the global budget (waits;
        429 ``overloaded`` with Retry-After when none comes)."""
        total = check_memory(rt, [len(it) for it in p.items], p.response_bytes,
                             limit=self.max_request_bytes, detail=p.detail)
        self.check_device(rt, p)
        return await self.budget.acquire(total)

    @staticmethod
    def resolve(rt: Runtime | None, req):
        """``req`` with its model-dependent defaults: ``add_bos`` null -> the model's
        convention (service/serving/core/inputs.py; one rule for every endpoint)."""
        return resolve_add_bos(rt, req)

    async def tokenize(self, rt: Runtime, req) -> list[TokenizedText]:
        """Every input of a ``TextOrTexts`` request: ``text`` / ``texts`` tokenized (BOS per
        the resolved ``add_bos``), ``tokens`` / ``token_lists`` taken as given (off the event
        loop unless the text was tokenized before), with the batch-size, context-length and
        vocabulary checks (422)."""
        if req.add_bos is None:
            req = self.resolve(rt, req)
        add_bos = bool(req.add_bos)
        many = "texts" if req.texts is not None else (
            "token_lists" if req.token_lists is not None else None)
        if many is not None and len(getattr(req, many)) > rt.settings.max_batch:
            n = len(getattr(req, many))
            raise BatchTooLarge(
                f"{many} holds {n} {'texts' if many == 'texts' else 'sequences'}; the limit is "
                f"{rt.settings.max_batch} (max_batch)", many,
            )
        if req.text is not None:  # already tokenized (another analysis of this text): no hop
            hit = rt.tokenize(req.text, add_bos, "text", cached_only=True)
            if hit is not None:
                return [hit]

        def work():
            if req.text is not None:
                return [rt.tokenize(req.text, add_bos, "text")]
            if req.tokens is not None:
                return [rt.tokenized_from_ids(req.tokens, "tokens")]
            if req.texts is not None:
                return [rt.tokenize(t, add_bos, f"texts.{i}") for i, t in enumerate(req.texts)]
            return [rt.tokenized_from_ids(ids, f"token_lists.{i}")
                    for i, ids in enumerate(req.token_lists)]

        return await anyio.to_thread.run_sync(work)

    async def run(self, rt: Runtime | None, p: Plan, admitted: bool = False,
                  token: cancel.CancelToken | None = None) -> Any:
        """Memory check, then the forwards (cached or new) and ``p.job`` in one device turn.

        A request whose forwards are all cached is admitted like any other (429 when the
        queue is full) and its turn runs only the job. ``admitted``: :meth:`admit` was done
        by the caller (who holds the ticket); else the budget is held for this turn only.
        ``token``: the turn runs under it (service/serving/core/cancel.py): a cancelled job
        stops at its next torch op or checkpoint and its turn ends at once (504 ``timeout``,
        503 ``shutting_down``; a client gone: never sent)."""
        if not admitted:
            ticket = await self.admit(rt, p)
            try:
                return await self.run(rt, p, admitted=True, token=token)
            finally:
                ticket.release()
        try:
            return await self._turn(rt, p, token)
        except cancel.JobCancelled as exc:
            raise stopped(exc.reason, token, device_param(p)) from None

    async def _turn(self, rt: Runtime | None, p: Plan, token) -> Any:
        hits = rt.cached_forwards(p.items) if (rt is not None and p.items) else None
        if hits is not None or not p.items:
            def job_only():
                with cancel.running(token):
                    return p.run_job(hits or [])

            return await self.slot.run(job_only)
        metrics = getattr(self._state, "metrics", None)
        queued = time.perf_counter()

        def turn():
            with cancel.running(token):
                start = time.perf_counter()
                try:
                    # every torch op of the forwards checks the token (cancel.py)
                    forwards = rt.forward_many(p.items)
                finally:
                    if metrics is not None:
                        metrics.queue_seconds.observe(start - queued)
                        metrics.device_seconds.observe(time.perf_counter() - start)
                    release_memory()  # the forward's transient tensors go back to the OS
                return p.run_job(forwards)

        return await self.slot.run(turn)


#: the media type of a streamed response (one JSON document a line, "\n" after each)
NDJSON = "application/x-ndjson"
#: progress lines are sent at most this often (seconds; app.state.progress_interval_s
#: overrides it) and at most once per :data:`PROGRESS_STEP` of the total
PROGRESS_INTERVAL_S = 0.5
PROGRESS_STEP = 0.01
_DONE = object()
log = logging.getLogger("attnscope.engine")


class ProgressLines:
    """The progress sink of a streamed job (``CancelToken.progress``, called on the device
    thread): turns ``(done, total)`` into NDJSON progress lines for ``put``. Sent: the first
    report, the one reaching ``total``, and others only when both ``interval`` seconds and
    :data:`PROGRESS_STEP` of the total have passed since the last line sent (so a job sends at
    most ~1/PROGRESS_STEP + 2 lines and at most one per ``interval``); ``done`` never goes
    back (a report below the last one sent is dropped)."""

    def __init__(self, put: Callable[[bytes], Any], unit: str, interval: float):
        self.put, self.unit, self.interval = put, unit, interval
        self.last = -1
        self.last_t = 0.0
        self.sent = 0

    def __call__(self, done: int, total: int) -> None:
        if done <= self.last:
            return
        now = time.monotonic()
        if self.last >= 0 and done < total and (
                done - self.last < PROGRESS_STEP * total or now - self.last_t < self.interval):
            return
        self.last, self.last_t = done, now
        self.sent += 1
        self.put(dumps({"progress": {"done": done, "total": total, "unit": self.unit}}) + b"\n")


def error_line(exc: BaseException) -> bytes:
    """The NDJSON line of a job that failed after its stream began: the error envelope the
    plain request would have got (docs/api.md "Errors") and, as ``status``, its HTTP status
    then; internals never leak."""
    if isinstance(exc, cancel.JobCancelled):
        exc = stopped(exc.reason)
    if isinstance(exc, AttnscopeError):
        body, status = envelope(exc.type, exc.message, exc.param), exc.status
    else:
        log.error("unhandled error in a streamed job", exc_info=exc)
        body = envelope("internal_error", "internal error; the service keeps serving")
        status = 500
    return dumps({**body, "status": status}) + b"\n"


class ProgressResponse(Response):
    """The NDJSON response of :meth:`Engine.stream`: the queued progress lines as they come,
    then the job's body (or :func:`error_line`) as the last line. A client that disconnects
    cancels the job (``token``); ``on_close`` runs once the job and the response ended."""

    media_type = NDJSON

    def __init__(self, lines: asyncio.Queue, task: asyncio.Task, token, on_close, headers=None):
        self.lines, self.task, self.token, self.on_close = lines, task, token, on_close
        self.status_code = 200
        self.background = None
        self.init_headers(dict(headers or {}))
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]

    async def __call__(self, scope, receive, send) -> None:
        import anyio

        task = self.task
        try:
            async with anyio.create_task_group() as tg:
                async def watch():
                    while True:
                        if (await receive())["type"] == "http.disconnect":
                            self.token.cancel(cancel.DISCONNECT)
                            tg.cancel_scope.cancel()
                            return

                tg.start_soon(watch)
                await send({"type": "http.response.start", "status": 200,
                            "headers": self.raw_headers})
                while True:
                    item = await self.lines.get()
                    if item is _DONE:
                        break
                    await send({"type": "http.response.body", "body": item, "more_body": True})
                exc = task.exception()
                if exc is None:
                    last = await anyio.to_thread.run_sync(dumps, task.result()) + b"\n"
                else:
                    last = error_line(exc)
                await send({"type": "http.response.body", "body": last, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        finally:
            if not task.done():
                self.token.cancel(cancel.DISCONNECT)
            on_close, self.on_close = self.on_close, None

            def ended(t):
                if not t.cancelled():
                    t.exception()  # retrieved: a stopped job is no unhandled error
                if on_close is not None:
                    on_close()

            if task.done():
                ended(task)  # now: the response's end is the ticket's end
            else:
                task.add_done_callback(ended)


def in_cache(rt: Runtime, key) -> bool:
    """Whether the forward cache holds ``key``'s forward now (no hit or miss counted)."""
    data = getattr(getattr(rt, "cache", None), "_data", None)
    return data is not None and key in data


#: a job may run this many times ``max_request_flops`` of matrix products (counted as it runs)
#: before it is stopped: room for the estimates' own error, a bound for jobs without one
RUN_FLOPS_SLACK = 1.5


def device_param(p: Plan) -> str:
    """The request field a device-work refusal names (before the job or while it runs): the
    plan's ``device_param``, else ``texts`` / ``text`` (estimates.check_device's rule)."""
    return p.device_param or ("texts" if len(p.items) > 1 else "text")


def stopped(reason: str, token: cancel.CancelToken | None = None,
            param: str | None = None) -> Exception:
    """The request's error for a job stopped for ``reason`` (service/serving/core/cancel.py);
    ``param``: the field a device-limit stop names (:func:`device_param`)."""
    if reason == cancel.OVER_LIMIT:
        from .estimates import fmt_flops

        ran = token.flops if token is not None else 0.0
        limit = token.flops_limit / RUN_FLOPS_SLACK if token is not None else 0.0
        return DeviceLimitExceeded(
            f"this request's device work passed {fmt_flops(ran)} of matrix products and was "
            f"stopped: the limit is {fmt_flops(limit)} (max_request_flops = {limit:.4g}; a job "
            f"may run {RUN_FLOPS_SLACK:g}x it). Send fewer or shorter texts, fewer positions, "
            "layers or variants", param)
    if reason == cancel.SHUTDOWN:
        return ShuttingDown("the service is shutting down and stopped this request's work at "
                            "the end of its grace period; retry (another replica answers)")
    if reason == cancel.DISCONNECT:  # never sent (nobody listens); the access log says 499
        return Timeout("the client went away; its work was stopped")
    return Timeout("the request ran past its time limit (request_timeout_s); its work was "
                   "stopped and the device given to the next request")


def model_dims(rt: Runtime) -> dict:
    """The resident model's sizes for :func:`~.estimates.forward_flops`: layers, d_model,
    d_mlp (config ``n_inner`` / ``intermediate_size``, else 4 d_model)."""
    a = rt.adapter
    cfg = getattr(getattr(rt, "model", None), "config", None)
    d_mlp = getattr(cfg, "n_inner", None) or getattr(cfg, "intermediate_size", None) or \
        4 * a.d_model
    return {"n_layers": a.n_layers, "d_model": a.d_model, "d_mlp": int(d_mlp)}
