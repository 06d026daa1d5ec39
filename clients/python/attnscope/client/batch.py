"""``attnscope batch``: run analyses over a JSONL corpus, resumably.

Input: one JSON object per line, ``{"id": ..., "text": "..."}`` (other keys are ignored).
Output: one line per input id, ``{"id": ..., "results": {"<analysis>": <response JSON>}}``,
in completion order. Failed items go to a separate file (default ``OUTPUT.failures.jsonl``)
as ``{"id", "analysis", "error": {"type", "message", "status", "param"}}`` and never stop the
run. Each line is written with one ``write`` on an ``O_APPEND`` file, so a run killed at any
moment leaves at worst a torn last line, which the next run removes.

Resume: ids already in the output or the failures file are skipped, so after any number of
interruptions every id ends up exactly once in one of the two files. ``--retry-failed``
removes the recorded failures first and runs those ids again. What a run asks for (the
analyses and their options, defaults included) is recorded beside the output in
``OUTPUT.batch.json``; a run that asks for something else refuses to resume into that output
(exit 2, naming both) unless ``--force`` is given, since skipping "done" ids would otherwise
leave results of different analyses in one file. (An output from before this record is
checked by the analyses named in its lines.) Ctrl-C stops the run: the lines written stay,
the items in flight are not recorded, and the summary ends with the command that resumes.

Concurrency: ``--concurrency`` requests in flight (default 4; the service runs one forward
at a time, so more mainly hides network latency). Transient errors (429, 5xx, connection)
are retried by the client; an item that still times out is recorded as failed
('client_timeout'), one answered with a body that is not the service's JSON (e.g. a proxy's
page) as 'invalid_response'; when the service stays unreachable the run stops with exit 3
(the items in flight are not recorded, so the next run does them). Behind a load balancer
the client's retries of 502/503/504 are what carry an item over a replica that died with it
in flight (docs/scaling.md).

A progress bar goes to stderr (``--no-progress`` turns it off); the summary at the end says
done, skipped, failed and throughput (``--json`` prints it as JSON on stdout too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import pydantic

from ._errors import pydantic_problem

ANALYSES = {
    # name: (path, request model import path, default options)
    "tokenize": ("/v1/tokenize", "attnscope.schemas.tokenize:TokenizeRequest", {}),
    "attention": ("/v1/attention", "attnscope.schemas.attention:AttentionRequest", {}),
    "heads": ("/v1/heads", "attnscope.schemas.heads:HeadsRequest", {}),
    "links": ("/v1/links", "attnscope.schemas.links:LinksRequest", {"layer": 0}),
    "trajectories": ("/v1/trajectories", "attnscope.schemas.trajectories:TrajectoriesRequest", {}),
    "verify": ("/v1/verify", "attnscope.schemas.verify:VerifyRequest", {}),
    "predictions": ("/v1/predictions", "attnscope.schemas.interventions:PredictionsRequest", {}),
    "norms": ("/v1/attention-norms", "attnscope.schemas.norms:NormsRequest", {}),
    "rollout": ("/v1/rollout", "attnscope.schemas.rollout:RolloutRequest", {}),
    "logit_lens": ("/v1/logit-lens", "attnscope.schemas.lens:LogitLensRequest", {}),
    # needs a target: --params '{"logit_attribution": {"target": " the"}}'
    "logit_attribution": ("/v1/logit-attribution",
                          "attnscope.schemas.lens:LogitAttributionRequest", {}),
    # every head ablated alone by default (a scan); --params for heads / method / metric
    "ablate": ("/v1/ablate", "attnscope.schemas.interventions:AblateRequest", {"scan": True}),
}
"""Analyses ``batch`` can run: endpoint, request schema, default options."""


def _request_model(name: str):
    import importlib

    mod, cls = ANALYSES[name][1].split(":")
    return getattr(importlib.import_module(mod), cls)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="JSONL file of {\"id\", \"text\"} objects ('-' = stdin)")
    p.add_argument("-o", "--output", required=True, help="JSONL results file (appended to)")
    p.add_argument("--failures", default=None,
                   help="JSONL file of failed items (default OUTPUT.failures.jsonl)")
    p.add_argument("-a", "--analysis", action="append", choices=sorted(ANALYSES),
                   help="analysis to run, repeatable (default: attention)")
    p.add_argument("--params", default=None, metavar="JSON",
                   help='options per analysis, e.g. \'{"attention": {"layers": [0], "round": 3}}\'')
    p.add_argument("-c", "--concurrency", type=int, default=4, help="requests in flight (4)")
    p.add_argument("--retry-failed", action="store_true",
                   help="run the ids in the failures file again")
    p.add_argument("--force", action="store_true",
                   help="resume into an output made with other analyses or options anyway")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass
class Summary:
    """What a batch run did (also the ``--json`` output)."""

    done: int = 0
    skipped: int = 0
    failed: int = 0
    duplicates: int = 0
    total: int = 0
    seconds: float = 0.0
    items_per_second: float = 0.0
    stopped: str | None = None
    output: str = ""
    failures: str = ""
    failed_types: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        s = (f"done {self.done}, skipped {self.skipped}, failed {self.failed}"
             + (f", duplicate ids {self.duplicates}" if self.duplicates else "")
             + f" of {self.total} in {self.seconds:.1f} s ({self.items_per_second:.1f} items/s)")
        if self.failed_types:
            s += " | failures: " + ", ".join(f"{k} {v}" for k, v in sorted(self.failed_types.items()))
        if self.stopped:
            s += f" | STOPPED: {self.stopped}"
        return s


def _key(id_: Any) -> str:
    return json.dumps(id_, sort_keys=True)


def _load_ids(path: str) -> set[str]:
    """Ids in a JSONL file; a torn last line (killed mid-write) is cut off the file."""
    ids: set[str] = set()
    if not os.path.exists(path):
        return ids
    with open(path, "rb") as f:
        data = f.read()
    good = data.rfind(b"\n") + 1
    if good < len(data):  # torn tail
        with open(path, "rb+") as f:
            f.truncate(good)
        data = data[:good]
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and "id" in obj:
            ids.add(_key(obj["id"]))
    return ids


def _drop_ids(path: str, drop: set[str]) -> int:
    """Rewrite ``path`` without the lines whose id is in ``drop`` (atomically); returns count."""
    if not os.path.exists(path):
        return 0
    kept, n = [], 0
    with open(path, "rb") as f:
        for line in f:
            try:
                if _key(json.loads(line)["id"]) in drop:
                    n += 1
                    continue
            except (ValueError, KeyError, TypeError):
                pass
            kept.append(line)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return n


class _Appender:
    """Append whole lines with one ``os.write`` each (O_APPEND)."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, obj: Any) -> None:
        data = (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]

    def close(self) -> None:
        os.close(self.fd)


class _Progress:
    def __init__(self, total: int, enabled: bool, stream=None):
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.monotonic()
        self.last = 0.0

    def update(self, s: Summary, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not final and now - self.last < (0.1 if self.tty else 2.0):
            return
        self.last = now
        n = s.done + s.failed
        rate = n / max(now - self.t0, 1e-9)
        frac = n / self.total if self.total else 1.0
        width = 30
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        eta = (self.total - n) / rate if rate > 0 else float("inf")
        msg = (f"batch {frac:4.0%} |{bar}| {n}/{self.total} failed {s.failed} "
               f"{rate:.1f}/s eta {eta:.0f}s" if eta != float("inf") else
               f"batch {frac:4.0%} |{bar}| {n}/{self.total} failed {s.failed}")
        if self.tty:
            self.stream.write("\r" + msg + ("\n" if final else ""))
        else:
            self.stream.write(msg + "\n")
        self.stream.flush()


def _read_input(path: str) -> list[str]:
    if path == "-":
        return sys.stdin.read().splitlines()
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def _error_record(id_: Any, analysis: str | None, etype: str, message: str,
                  status: int | None = None, param: str | None = None, line: int | None = None):
    rec = {"id": id_, "analysis": analysis,
           "error": {"type": etype, "message": message, "status": status, "param": param}}
    if line is not None:
        rec["line"] = line
    return rec


def settings_path(output: str) -> str:
    """Where the run's analyses and options are recorded: ``OUTPUT.batch.json``."""
    return output + ".batch.json"


def _settings(analyses: dict[str, dict]) -> dict:
    """What a run asks for, every option of every analysis spelled out (the request model's
    defaults filled in), so an option given at its default asks for the same."""
    return {"analyses": {n: _with_defaults(n, analyses[n]) for n in sorted(analyses)}}


def _with_defaults(name: str, opts: Any) -> Any:
    """``opts`` of analysis ``name`` with every option its request model has, defaults
    filled in (as JSON); ``opts`` as given where it does not fit the model (an unknown
    analysis, or a record from another version)."""
    try:
        model = _request_model(name)
    except (KeyError, ValueError, AttributeError, ImportError):
        return opts
    try:
        req = model(text="check", **opts)
    except (TypeError, ValueError):  # (pydantic's ValidationError is a ValueError)
        if not isinstance(opts, dict):
            return opts
        # options this version does not take: the defaults under them, so only they differ
        defaults = model.model_construct().model_dump(mode="json", exclude={"text", "texts"})
        return {**defaults, **opts}
    return req.model_dump(mode="json", exclude={"text", "texts"})


def _analyses_in(path: str, limit: int = 1000) -> set[str]:
    """Analyses named in an output's first ``limit`` lines (``results`` keys)."""
    names: set[str] = set()
    if not os.path.exists(path):
        return names
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            if i >= limit:
                break
            try:
                res = json.loads(line).get("results")
            except (ValueError, AttributeError):
                continue
            if isinstance(res, dict):
                names |= set(res)
    return names


def resume_conflict(output: str, failures: str, analyses: dict[str, dict]) -> str | None:
    """Why this run may not append to ``output`` (None when it may): the output or the failures
    file already holds items made with other analyses or options than ``analyses``."""
    if not (_load_ids(output) or _load_ids(failures)):
        return None  # nothing to resume: a fresh output
    want = _settings(analyses)
    rec = settings_path(output)
    if os.path.exists(rec):
        try:
            with open(rec, encoding="utf-8") as f:
                have = json.load(f)
        except (OSError, ValueError) as exc:
            return f"{rec} cannot be read ({exc}); cannot tell what {output} was made with"
        if not isinstance(have, dict):
            return (f"{rec} holds {type(have).__name__} JSON, not a settings record; cannot "
                    f"tell what {output} was made with")
        had = have.get("analyses")
        if isinstance(had, dict):  # a record written with only the options typed: as full
            had = {n: _with_defaults(n, o) for n, o in had.items()}
        if had != want["analyses"]:
            return (f"{output} was made with {_differences(had, want['analyses'])}")
        return None
    found = _analyses_in(output)
    if found and found != set(analyses):
        return (f"{output} holds results of {sorted(found)}; this run asks for "
                f"{sorted(analyses)}")
    return None


def _differences(had: Any, want: dict) -> str:
    """What differs between the recorded and the requested analyses, option by option."""
    if not isinstance(had, dict) or set(had) != set(want):
        names = sorted(had) if isinstance(had, dict) else had
        return f"the analyses {json.dumps(names)}; this run asks for {json.dumps(sorted(want))}"
    diffs = []
    for n in sorted(want):
        a, b = had[n], want[n]
        if not (isinstance(a, dict) and isinstance(b, dict)):
            diffs.append(f"{n} {json.dumps(a)} (this run: {json.dumps(b)})")
            continue
        for k in sorted(set(a) | set(b)):
            if a.get(k, "<unset>") != b.get(k, "<unset>"):
                diffs.append(f"{n}.{k} = {json.dumps(a.get(k, '<unset>'))} (this run: "
                             f"{json.dumps(b.get(k, '<unset>'))})")
    return "; ".join(diffs)


def record_settings(output: str, analyses: dict[str, dict]) -> None:
    """Write ``OUTPUT.batch.json`` (atomically)."""
    rec = settings_path(output)
    tmp = rec + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_settings(analyses), f, sort_keys=True, indent=1)
        f.write("\n")
    os.replace(tmp, rec)


async def run_batch(client, lines: list[str], output: str, failures: str,
                    analyses: dict[str, dict], concurrency: int = 4,
                    retry_failed: bool = False, progress: bool = True,
                    summary: Summary | None = None) -> Summary:
    """Run ``analyses`` (name -> options) over the JSONL ``lines`` with ``client`` (an
    :class:`attnscope.client.AsyncClient`); see the module docstring for the files written.
    ``summary`` (optional) is filled in as the run goes, so a caller still has the counts
    when the run is interrupted."""
    from ._errors import (
        APIConnectionError,
        APIResponseValidationError,
        APIStatusError,
        APITimeoutError,
    )

    t0 = time.monotonic()
    if summary is None:
        summary = Summary()
    summary.output, summary.failures = output, failures
    done_ids = _load_ids(output)
    failed_ids = _load_ids(failures)
    if retry_failed:
        _drop_ids(failures, failed_ids - done_ids)
        failed_ids = _load_ids(failures)
    seen = done_ids | failed_ids
    out, err = _Appender(output), _Appender(failures)
    models = {name: _request_model(name) for name in analyses}

    def fail(rec):
        err.write(rec)
        summary.failed += 1
        t = rec["error"]["type"]
        summary.failed_types[t] = summary.failed_types.get(t, 0) + 1

    work: list[tuple[Any, str]] = []
    queued: set[str] = set()
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        summary.total += 1
        try:
            obj = json.loads(raw)
            if not isinstance(obj, dict) or "id" not in obj:
                raise ValueError("each line must be an object with 'id' and 'text'")
            id_ = obj["id"]
        except ValueError as exc:
            id_ = f"line:{i}"
            if _key(id_) in seen:
                summary.skipped += 1
            else:
                fail(_error_record(id_, None, "invalid_input", str(exc), line=i))
                seen.add(_key(id_))
            continue
        k = _key(id_)
        if k in seen:
            summary.skipped += 1
            continue
        if k in queued:
            summary.duplicates += 1
            continue
        queued.add(k)
        text = obj.get("text")
        if not isinstance(text, str):
            fail(_error_record(id_, None, "invalid_input",
                               f"'text' must be a string, got {type(text).__name__}", line=i))
            continue
        work.append((id_, text))

    bar = _Progress(len(work) + summary.failed, progress)
    queue: asyncio.Queue = asyncio.Queue()
    for item in work:
        queue.put_nowait(item)
    stop = asyncio.Event()

    async def one(id_, text):
        results = {}
        for name, opts in analyses.items():
            path = ANALYSES[name][0]
            try:
                body = models[name](text=text, **opts).model_dump(mode="json", exclude_unset=True)
            except pydantic.ValidationError as exc:
                e = exc.errors()[0]
                fail(_error_record(id_, name, "validation_error", pydantic_problem(e),
                                   param=".".join(map(str, e["loc"])) or None))
                return
            try:
                results[name] = await client.request("POST", path, body)
            except APIStatusError as exc:
                fail(_error_record(id_, name, exc.type or f"http_{exc.status_code}",
                                   exc.message, exc.status_code, exc.param))
                return
            except APITimeoutError as exc:  # this item is too slow: record it, go on
                fail(_error_record(id_, name, "client_timeout",
                                   f"{exc.message} (--timeout {client.timeout})"))
                return
            except APIResponseValidationError as exc:  # e.g. a proxy's HTML page with 200
                fail(_error_record(id_, name, "invalid_response", exc.message, exc.status_code))
                return
        out.write({"id": id_, "results": results})
        summary.done += 1

    async def worker():
        while not stop.is_set():
            try:
                id_, text = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                await one(id_, text)
            except APIConnectionError as exc:
                summary.stopped = f"connection failure: {exc.message}"
                stop.set()
                return
            except BaseException:  # a bug: no new items; the others in flight still finish
                stop.set()
                raise
            bar.update(summary)

    # return_exceptions: one worker's unexpected error must not leave the others running
    # (their items unrecorded, then cancelled) while the files are closed under them.
    try:
        outcomes = await asyncio.gather(*(worker() for _ in range(max(1, concurrency))),
                                        return_exceptions=True)
    finally:
        out.close()
        err.close()
        summary.seconds = time.monotonic() - t0
        summary.items_per_second = (summary.done + summary.failed) / max(summary.seconds, 1e-9)
    for o in outcomes:
        if isinstance(o, BaseException):
            raise o
    bar.update(summary, final=True)
    return summary


def run_cli(args) -> int:
    """``attnscope batch``: exit 0 all done, 4 some items failed, 3 service unreachable,
    2 usage error (a resume into an output made with other analyses or options included),
    130 interrupted (Ctrl-C)."""
    import shlex

    import httpx

    from . import AsyncClient
    from .cli import (
        EXIT_CONNECTION, EXIT_INTERRUPTED, EXIT_NEGATIVE, EXIT_OK, UsageError, default_url)

    names = args.analysis or ["attention"]
    try:
        params = json.loads(args.params) if args.params else {}
    except json.JSONDecodeError as exc:
        raise UsageError(f"--params is not valid JSON: {exc}")
    if not isinstance(params, dict) or not all(isinstance(v, dict) for v in params.values()):
        raise UsageError("--params must map analysis names to option objects")
    unknown = set(params) - set(names)
    if unknown:
        raise UsageError(f"--params names analyses not requested with -a: {sorted(unknown)}")
    for n, opts in params.items():
        given = sorted({"text", "texts"} & set(opts))
        if given:
            raise UsageError(f"--params {n}: {', '.join(given)} is not an option here: each "
                             "input line's text is the request's text")
    analyses = {n: {**ANALYSES[n][2], **params.get(n, {})} for n in names}
    for n, opts in analyses.items():  # bad options: a usage error now, not N failures later
        try:
            _request_model(n)(text="check", **opts)
        except pydantic.ValidationError as exc:
            raise UsageError(f"--params {n}: {pydantic_problem(exc.errors()[0])}")
    if args.concurrency < 1:
        raise UsageError(f"--concurrency must be >= 1, got {args.concurrency}")
    try:
        lines = _read_input(args.input)
    except OSError as exc:
        raise UsageError(f"cannot read {args.input}: {exc}")
    failures = args.failures or args.output + ".failures.jsonl"
    conflict = resume_conflict(args.output, failures, analyses)
    if conflict and not args.force:
        raise UsageError(f"will not resume: {conflict}. Write to a new --output, or give "
                         "--force to append anyway")
    if conflict:
        print(f"attnscope batch: --force: appending anyway ({conflict})", file=sys.stderr)
    record_settings(args.output, analyses)
    summary = Summary()

    async def go():
        limits = httpx.Limits(max_connections=args.concurrency)
        async with httpx.AsyncClient(limits=limits) as http:
            client = AsyncClient(args.url or default_url(), api_key=args.api_key,
                                 timeout=args.timeout, max_retries=args.max_retries,
                                 http_client=http)
            return await run_batch(client, lines, args.output, failures, analyses,
                                   args.concurrency, args.retry_failed, not args.no_progress,
                                   summary)

    try:
        asyncio.run(go())
    except KeyboardInterrupt:
        summary.stopped = "interrupted (Ctrl-C); the items in flight were not recorded"
        print("\nattnscope batch: " + summary.line(), file=sys.stderr)
        argv = getattr(args, "argv", None)
        again = ("attnscope " + shlex.join(argv)) if argv else "the same command"
        print(f"attnscope batch: to resume, run {again} again: the ids already in "
              f"{args.output} or {failures} are skipped", file=sys.stderr)
        if args.json:
            print(json.dumps(asdict(summary)))
        return EXIT_INTERRUPTED
    print("attnscope batch: " + summary.line(), file=sys.stderr)
    if args.json:
        print(json.dumps(asdict(summary)))
    if summary.stopped:
        return EXIT_CONNECTION
    return EXIT_NEGATIVE if summary.failed else EXIT_OK
