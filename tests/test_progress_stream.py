"""Streamed progress (issue 27 item 4): ``Accept: application/x-ndjson`` to /v1/patch (head
grids, hook grids) and /v1/path-patch answers NDJSON progress lines while the job runs and the
normal body as the last line (the same bytes as the plain answer); a job that fails after the
200 ends with an error line; a client that disconnects mid-stream stops the job; the Python
client's ``on_progress``. The real app in-process (starlette's TestClient, raw ASGI for the
disconnect), the bundled GPT-2."""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest

from asgi_gone import GoneClient
from attnscope.client import Client

NDJSON = "application/x-ndjson"
SEG = [211, 1030, 77, 1499, 603, 1877, 342, 958]
CLEAN = [0] + SEG + SEG
CORRUPT = [0] + [1210, 45, 1600, 388, 1777, 90, 1402, 633] + SEG
T = len(CLEAN)
LD = {"kind": "logit_diff", "terms": [{"position": T - 2, "target": SEG[-1],
                                       "distractor": CORRUPT[-1]}]}
HEAD_GRIDS = {"clean_tokens": CLEAN, "corrupted_tokens": CORRUPT, "metric": "loss",
              "per_position": True, "residual": True}
HOOK_GRID = {"clean_tokens": CLEAN, "corrupted_tokens": CORRUPT, "metric": LD, "hook": "z",
             "by_position": True}


@pytest.fixture(scope="module")
def sc(gpt2_runtime):
    """A client of the real app whose progress lines are throttled by the 1% step only."""
    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app
    from attnscope.service.config import Settings

    app = create_app(Settings(model="bundled"), runtime=gpt2_runtime)
    with TestClient(app, raise_server_exceptions=False) as c:
        app.state.progress_interval_s = 0.0
        yield c


def streamed(c, path: str, body: dict):
    with c.stream("POST", path, json=body, headers={"accept": NDJSON}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith(NDJSON)
        lines = [ln for ln in r.iter_lines() if ln]
    return [json.loads(ln) for ln in lines[:-1]], lines[-1]


def check_progress(progress: list[dict], total: int, unit: str) -> None:
    """Progress lines: only progress, one unit, one total (= ``total``, counted independently),
    ``done`` strictly increasing from 0 to the total."""
    assert progress and all(set(p) == {"progress"} for p in progress), progress
    ps = [p["progress"] for p in progress]
    assert {p["unit"] for p in ps} == {unit}
    assert {p["total"] for p in ps} == {total}, (ps, total)
    done = [p["done"] for p in ps]
    assert done[0] == 0 and done[-1] == total, done
    assert all(b > a for a, b in zip(done, done[1:])), done


def head_grid_cells(body: dict) -> int:
    """Cells of /v1/patch's head grids from the response's own shapes."""
    heads = np.array(body["heads"], dtype=float)
    per = np.array(body["heads_per_position"], dtype=float)
    resid = np.array(body["residual"], dtype=float)
    return heads.size + per.size + resid.size


def test_head_grids_stream_progress_and_the_same_body(sc, gpt2_runtime):
    plain = sc.post("/v1/patch", json=HEAD_GRIDS)
    assert plain.status_code == 200 and plain.headers["content-type"] == "application/json"
    progress, last = streamed(sc, "/v1/patch", HEAD_GRIDS)
    assert last.encode() == plain.content  # the final line is the plain answer, byte for byte
    a = gpt2_runtime.adapter
    total = head_grid_cells(plain.json())
    assert total == a.n_layers * a.n_heads * (1 + T) + a.n_layers * T
    check_progress(progress, total, "cells")
    assert len(progress) >= 2 + a.n_layers  # a line per layer of each head grid at least


def test_hook_grid_streams_progress_and_the_same_body(sc):
    plain = sc.post("/v1/patch", json=HOOK_GRID)
    assert plain.status_code == 200, plain.text
    progress, last = streamed(sc, "/v1/patch", HOOK_GRID)
    assert last.encode() == plain.content
    grid = plain.json()["grid"]
    check_progress(progress, int(np.prod(grid["shape"])), "cells")
    # a subset: the total is the cells asked (the rest are null in the grid)
    sub = dict(HOOK_GRID, patch_layers=[1], patch_heads=[0, 2])
    plain = sc.post("/v1/patch", json=sub)
    progress, last = streamed(sc, "/v1/patch", sub)
    assert last.encode() == plain.content
    raw = np.array([[[np.nan if v is None else v for v in row] for row in lyr]
                    for lyr in plain.json()["grid"]["raw"]], dtype=float)
    check_progress(progress, int(np.isfinite(raw).sum()), "cells")


def test_planted_fault_a_wrong_total_is_caught(sc, monkeypatch):
    """The check above fails on a service whose progress total is off by one (patch_cells
    made to count one cell too many)."""
    from attnscope.service.runtime import interventions as I

    good = I.patch_cells
    monkeypatch.setattr(I, "patch_cells", lambda *a, **k: good(*a, **k) + 1)
    plain = sc.post("/v1/patch", json=HOOK_GRID)
    progress, last = streamed(sc, "/v1/patch", HOOK_GRID)
    with pytest.raises(AssertionError):
        check_progress(progress, int(np.prod(plain.json()["grid"]["shape"])), "cells")


def test_path_patch_streams_pairs(sc, monkeypatch):
    from attnscope.service.serving import path_patch as PP

    rng = np.random.default_rng(1)
    pairs = []
    for _ in range(5):
        seg = rng.choice(np.arange(100, 2000), 6, replace=False).tolist()
        alt = rng.choice(np.arange(100, 2000), 6, replace=False).tolist()
        pairs.append({"clean_tokens": [0] + seg + seg, "corrupted_tokens": [0] + alt + seg})
    body = {"pairs": pairs, "grid": True, "metric": {"kind": "logit_diff", "terms": [
        {"position": -1, "target": 5, "distractor": 6}]}}
    monkeypatch.setattr(PP, "CHUNK_BYTES", 1 << 20)  # small chunks of pairs: several lines
    plain = sc.post("/v1/path-patch", json=body)
    assert plain.status_code == 200, plain.text
    progress, last = streamed(sc, "/v1/path-patch", body)
    assert last.encode() == plain.content
    check_progress(progress, len(pairs), "pairs")
    assert len(progress) > 2


def test_other_endpoints_and_plain_accepts_are_unchanged(sc):
    from attnscope.service.serving.core.routes import wants_ndjson

    assert not wants_ndjson(None) and not wants_ndjson("application/json")
    assert not wants_ndjson("*/*") and not wants_ndjson(f"application/json, {NDJSON};q=0.5")
    assert not wants_ndjson(f"{NDJSON};q=0") and not wants_ndjson(f"{NDJSON};q=x")
    assert wants_ndjson(NDJSON) and wants_ndjson(f"{NDJSON}, application/json;q=0.5")
    a = sc.post("/v1/patch", json=HOOK_GRID, headers={"accept": "application/json"})
    b = sc.post("/v1/patch", json=HOOK_GRID)
    assert a.headers["content-type"] == "application/json" and a.content == b.content
    r = sc.post("/v1/predictions", json={"text": "Then I tried"}, headers={"accept": NDJSON})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    # an error before the job starts keeps its status (no stream)
    r = sc.post("/v1/patch", json=dict(HOOK_GRID, corrupted_tokens=CORRUPT[:-1]),
                headers={"accept": NDJSON})
    assert r.status_code == 422 and r.json()["error"]["param"] == "corrupted_tokens"


# --- a job of the table that reports progress, then fails or spins -----------------------------

def _progress_app(gpt2_runtime):
    """The real app with one more endpoint: ``fail`` reports 2 of 4 cells, then raises
    NonFiniteValues; else it reports progress until it is cancelled. ``started`` is set at
    its first report; ``ended`` records how it ended."""
    from pydantic import BaseModel

    from attnscope.service.app import create_app
    from attnscope.service.config import Settings
    from attnscope.service.errors import NonFiniteValues
    from attnscope.service.serving.core.cancel import progress
    from attnscope.service.serving.core.engine import Plan
    from attnscope.service.serving.core.table import Endpoint, default_table

    class JobRequest(BaseModel):
        fail: bool = False

    class JobResponse(BaseModel):
        done: bool

    started = threading.Event()
    ended: list = []

    def plan(rt, req, items):
        def job(_):
            try:
                progress(0, 4)
                started.set()
                progress(2, 4)
                if req.fail:
                    raise NonFiniteValues("the patched metric grid holds NaN", "metric")
                i = 0
                while True:
                    i += 1
                    progress(2, 4)  # a checkpoint: sees the cancel
            except BaseException as exc:
                ended.append(type(exc).__name__)
                raise
        return Plan([], job, response_bytes=1 << 20, progress="cells")

    ep = Endpoint(path="/v1/progress-job", name="progress_job", request=JobRequest,
                  response=JobResponse, summary="job", description="job", plan=plan,
                  tokenize=False, order=999)
    app = create_app(Settings(model="bundled"), runtime=gpt2_runtime,
                     endpoints=[*default_table(), ep])
    app.state.progress_interval_s = 0.0
    return app, started, ended


def test_a_job_failing_mid_stream_ends_with_an_error_line(gpt2_runtime):
    from fastapi.testclient import TestClient

    app, _, ended = _progress_app(gpt2_runtime)
    with TestClient(app, raise_server_exceptions=False) as c:
        plain = c.post("/v1/progress-job", json={"fail": True})
        assert plain.status_code == 500 and plain.json()["error"]["type"] == "non_finite_values"
        progress, last = streamed(c, "/v1/progress-job", {"fail": True})
        assert [p["progress"]["done"] for p in progress] == [0, 2]
        err = json.loads(last)
        assert err == {**plain.json(), "status": 500}
        assert ended == ["NonFiniteValues", "NonFiniteValues"]
        assert app.state.slot.depth == 0 and app.state.engine.budget.in_use == 0
        assert c.get("/healthz").status_code == 200
        # the Python client raises the typed error of the status the job would have had
        from attnscope.client import NonFiniteValuesError

        seen = []
        cl = Client("http://testserver", http_client=c, max_retries=0)
        with pytest.raises(NonFiniteValuesError):
            cl._call_stream("POST", "/v1/progress-job", {"fail": True}, None,
                            lambda *a: seen.append(a))
        assert seen == [(0, 4, "cells"), (2, 4, "cells")]


def test_a_client_that_disconnects_mid_stream_stops_the_job(gpt2_runtime):
    """The ASGI conversation of a client that reads the first progress line and goes away:
    the job stops (JobCancelled), the device, the budget and the job set are free."""
    app, started, ended = _progress_app(gpt2_runtime)

    async def main():
        async with app.router.lifespan_context(app):
            gc = GoneClient("/v1/progress-job", b'{"fail": false}', [(b"accept", NDJSON.encode())],
                            on_send=lambda m: m["type"] == "http.response.body"
                            and b"progress" in m.get("body", b""))
            await gc(app)
            while not ended:  # the job sees the cancel at its next report
                await asyncio.sleep(0.01)
            for _ in range(1000):  # the ticket goes back once the job's task ended
                if app.state.engine.budget.in_use == 0 and app.state.slot.depth == 0:
                    break
                await asyncio.sleep(0.01)
            assert ended == ["JobCancelled"]
            assert app.state.slot.depth == 0 and app.state.engine.budget.in_use == 0
            assert not app.state.jobs
            return gc.sent, gc.statuses()

    sent, statuses = asyncio.run(main())
    assert started.is_set()
    assert statuses == [200]
    # no last line was sent: the stream stopped with the client
    assert not any(b'"done":true' in m.get("body", b"") for m in sent)


def test_client_on_progress_gets_the_lines_and_the_same_result(sc):
    cl = Client("http://testserver", http_client=sc, max_retries=0)
    seen = []
    kw = dict(clean_tokens=CLEAN, corrupted_tokens=CORRUPT, metric=LD, hook="z",
              by_position=True)
    a = cl.patch(**kw, on_progress=lambda d, t, u: seen.append((d, t, u)))
    b = cl.patch(**kw)
    assert a.model_dump() == b.model_dump()
    total = int(np.prod(b.grid.shape))
    assert seen[0] == (0, total, "cells") and seen[-1] == (total, total, "cells")
    pp = []
    r = cl.path_patch(pairs=[(CLEAN, CORRUPT)], senders=[(0, 1)], receivers=[(1, "k")],
                      metric=LD, on_progress=lambda *x: pp.append(x))
    assert r.patched.n == 1 and pp == [(0, 1, "pairs"), (1, 1, "pairs")]


# --- over a real uvicorn: the CLI's progress line ---------------------------------------------

@pytest.mark.e2e
def test_cli_progress_line_over_uvicorn(capsys, monkeypatch, live_server, tmp_path):
    """``attnscope patch --progress`` / ``path-patch --progress`` against a real uvicorn: the
    progress line on stderr ends at the total; the saved JSON equals the plain answer;
    ``--no-progress`` prints none."""
    from attnscope.client import cli as cli_mod

    monkeypatch.setenv("ATTNSCOPE_BASE_URL", live_server.url)
    clean, corrupted = "the cat sat on the mat and the cat sat", \
        "the dog sat on the mat and the cat sat"
    f = tmp_path / "p.json"
    capsys.readouterr()
    rc = cli_mod.main(["patch", clean, corrupted, "--metric", "loss", "--hook", "z",
                       "--by-position", "--progress", "--output", str(f)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    with Client(live_server.url) as c:
        ref = c.patch(clean, corrupted, metric="loss", hook="z", by_position=True)
    total = int(np.prod(ref.grid.shape))
    assert f"patch: {total}/{total} cells (100%)\n" in out.err
    assert json.loads(f.read_text())["grid"]["raw"] == ref.grid.raw
    rc = cli_mod.main(["patch", clean, corrupted, "--metric", "loss", "--no-progress"])
    out = capsys.readouterr()
    assert rc == 0 and "cells" not in out.err
    rc = cli_mod.main(["path-patch", clean, corrupted, "--senders", "0:1", "--receivers",
                       "1:k", "--progress"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "path-patch: 1/1 pairs (100%)\n" in out.err


def test_async_client_on_progress_takes_a_coroutine_function(gpt2_runtime):
    """The AsyncClient over httpx's ASGI transport (the real app in-process): a coroutine
    ``on_progress`` is awaited for each line and the result equals the plain call's."""
    import httpx

    from attnscope.client import AsyncClient
    from attnscope.service.app import create_app
    from attnscope.service.config import Settings

    app = create_app(Settings(model="bundled"), runtime=gpt2_runtime)
    seen = []

    async def cb(done, total, unit):
        seen.append((done, total, unit))

    async def main():
        async with app.router.lifespan_context(app):
            app.state.progress_interval_s = 0.0
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://app") as http:
                c = AsyncClient(http_client=http, max_retries=0)
                a = await c.path_patch(pairs=[(CLEAN, CORRUPT)], senders=[(0, 1)],
                                       receivers=[(1, "k")], metric=LD, on_progress=cb)
                b = await c.path_patch(pairs=[(CLEAN, CORRUPT)], senders=[(0, 1)],
                                       receivers=[(1, "k")], metric=LD)
                return a, b

    a, b = asyncio.run(main())
    assert a.model_dump() == b.model_dump()
    assert seen == [(0, 1, "pairs"), (1, 1, "pairs")]


def test_the_ndjson_200_is_in_the_openapi_and_every_line_validates(sc):
    """/openapi.json documents the streamed 200 of /v1/patch and /v1/path-patch (content
    application/x-ndjson, each line ProgressLine | the response | ErrorResponse); every line
    of a real stream validates against it, a progress line with a string ``done`` does not,
    and endpoints that do not stream have no NDJSON content."""
    import jsonschema

    spec = sc.get("/openapi.json").json()
    for path, resp in (("/v1/patch", "PatchResponse"), ("/v1/path-patch", "PathPatchResponse")):
        content = spec["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", NDJSON}
        refs = [x["$ref"].rsplit("/", 1)[-1] for x in content[NDJSON]["schema"]["anyOf"]]
        assert refs == ["ProgressLine", resp, "ErrorResponse"]
    for path in ("/v1/attention", "/v1/ablate", "/v1/run"):
        assert NDJSON not in spec["paths"][path]["post"]["responses"]["200"]["content"]
    schema = spec["paths"]["/v1/patch"]["post"]["responses"]["200"]["content"][NDJSON]["schema"]
    v = jsonschema.Draft202012Validator({**schema, "components": spec["components"]})
    line = jsonschema.Draft202012Validator({"$ref": "#/components/schemas/ProgressLine",
                                            "components": spec["components"]})
    progress, last = streamed(sc, "/v1/patch", HOOK_GRID)
    for doc in [*progress, json.loads(last)]:
        assert [e.message for e in v.iter_errors(doc)] == []
    assert all(line.is_valid(p) for p in progress) and not line.is_valid(json.loads(last))
    assert not line.is_valid({"progress": {"done": "1", "total": 2, "unit": "cells"}})
