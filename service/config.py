"""Configuration: one pydantic-settings class, environment prefix ``ATTNSCOPE_``.

Every option is documented once, here, with its default. Bad values fail at start-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from attnscope.schemas.common import MAX_TEXTS

BUNDLED_MODEL_DIR = Path(__file__).resolve().parent / "bundled_model"
BUNDLED_MODEL_ID = "attnscope-tiny-gpt2"
#: the second bundled checkpoint: a LlamaForCausalLM (RoPE, GQA 4/2, RMSNorm, SwiGLU)
BUNDLED_LLAMA_DIR = Path(__file__).resolve().parent / "bundled_llama"
BUNDLED_LLAMA_ID = "attnscope-tiny-llama"
#: model names that mean a bundled checkpoint -> (directory, model id, its training recipe)
BUNDLED = {
    "bundled": (BUNDLED_MODEL_DIR, BUNDLED_MODEL_ID, "training/train_bundled_gpt2.py"),
    BUNDLED_MODEL_ID: (BUNDLED_MODEL_DIR, BUNDLED_MODEL_ID, "training/train_bundled_gpt2.py"),
    "bundled-llama": (BUNDLED_LLAMA_DIR, BUNDLED_LLAMA_ID, "training/train_bundled_llama.py"),
    BUNDLED_LLAMA_ID: (BUNDLED_LLAMA_DIR, BUNDLED_LLAMA_ID, "training/train_bundled_llama.py"),
}


class Settings(BaseSettings):
    """attnscope settings. Each maps to ``ATTNSCOPE_<NAME>`` and to a ``serve`` flag."""

    model_config = SettingsConfigDict(env_prefix="ATTNSCOPE_", extra="ignore")

    model: str = Field(
        "gpt2",
        description="Hub id or local directory of the model. 'bundled' = the bundled checkpoint "
        "(GPT-2), 'bundled-llama' = the bundled Llama (RoPE, grouped-query attention). "
        "When the default 'gpt2' cannot be had (no network, not cached) the service falls back to "
        "the bundled checkpoint unless strict_model is set.",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    strict_model: bool = Field(
        False, description="Fail at start-up instead of falling back to the bundled checkpoint."
    )
    device: Literal["auto", "cpu", "cuda", "mps"] | str = Field(
        "auto", description="'auto' = cuda, then mps, then cpu; or a torch device string."
    )
    dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "float32", description="Weights/activation dtype."
    )
    host: str = Field("127.0.0.1", description="Bind address for `attnscope serve`.")
    port: int = Field(8000, ge=0, le=65535, description="Port for `attnscope serve`.")
    max_batch: int = Field(32, ge=1, le=MAX_TEXTS, description="Most texts in one request "
                           f"(texts, reference_texts); at most {MAX_TEXTS}, the request "
                           "schemas' own bound.")
    max_text_chars: int = Field(
        100_000, ge=1, description="Most characters in one text (checked before tokenizing)."
    )
    max_body_bytes: int = Field(
        4_000_000, ge=1024, description="Largest accepted request body, bytes (413 beyond)."
    )
    max_queue: int = Field(
        64, ge=0, description="Requests that may wait for the device; beyond this, 429 at once."
    )
    forward_batch_size: int = Field(
        1,
        ge=1,
        description="Most texts per padded forward pass (a batch request is chunked). The "
        "default 1 makes every answer bitwise identical whatever else was requested; larger "
        "values raise throughput on GPUs, and a text's numbers then agree with its numbers alone "
        "to float rounding (below 1e-6 in float32), not bit for bit.",
    )
    padding_side: Literal["right", "left"] = Field(
        "right", description="Padding side for batched forwards (results never depend on it)."
    )
    cache_entries: int = Field(128, ge=0, description="Most forward results kept in the LRU cache.")
    cache_bytes: int = Field(
        1_073_741_824, ge=0, description="Most bytes of tensors kept in the forward cache."
    )
    max_request_bytes: int = Field(
        6_442_450_944, ge=0, description="Most memory one request may need, bytes, as estimated "
        "from n_layers, n_heads, tokens, d_model, dtype, batch size and the response encoding "
        "(service/serving/core/memory.py); beyond it 422 'memory_limit_exceeded' before any forward. "
        "0 = no limit.",
    )
    memory_budget_bytes: int = Field(
        0, ge=-1, description="Memory budget of ALL requests in flight together, bytes: a "
        "request is admitted only while the estimates of those in flight (until their last "
        "byte is sent) plus its own fit; otherwise it waits up to budget_wait_s, then 429 "
        "with Retry-After (service/serving/core/budget.py). 0 = derived at start-up: the memory "
        "the process may use (cgroup limit or MemTotal) minus its RSS with the model loaded, "
        "minus cache_bytes, minus 10% of that memory. -1 = no global budget.",
    )
    max_request_flops: float = Field(
        1e13, ge=0, description="Most device work one request may need, floating-point "
        "operations, as estimated from the forwards it runs (tokens x layers x d_model, d_mlp) "
        "and its job's own work (service/serving/core/estimates.py); beyond it 422 "
        "'device_limit_exceeded' before any forward. The default is ~110 s of a 2-core CPU "
        "(~90 GFLOP/s measured); raise it on a GPU. 0 = no limit.",
    )
    budget_wait_s: float = Field(
        5.0, ge=0, description="Most seconds a request waits for room in the memory budget "
        "before 429.",
    )
    trim_free_bytes: int = Field(
        268_435_456, ge=0, description="After a forward or a large response, free heap memory "
        "is given back to the OS (glibc malloc_trim) once the allocator holds more than this many "
        "free bytes. Lower = smaller resident memory, higher = fewer page faults on the next "
        "request (trimming after every forward costs ~25 ms per GPT-2-small forward at 128 "
        "tokens). 0 = trim every time.",
    )
    numpy_hugepages: bool = Field(
        False, description="Let numpy ask the kernel for transparent huge pages "
        "(madvise MADV_HUGEPAGE) for its arrays of 4 MiB and more, numpy's own default. Off: on "
        "the 2-core VM the service is measured on, a huge-page fault cost 2-4 ms per 2 MiB (perf: "
        "zeroing the page, clear_page_erms), so the float64 copies of /v1/trajectories "
        "took 45-60 ms instead of 28-38 ms, and /v1/attention at 128 tokens (GPT-2 small) 239 ms "
        "instead of 210 ms in one A/B run (the advice stays on heap ranges torch reuses later). "
        "Turn on where huge pages are cheap.",
    )
    exit_on_load_failure: bool = Field(
        True, description="Exit the process when the model fails to load (start-up error)."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info")
    log_format: Literal["json", "text"] = Field(
        "json", description="Log lines: one JSON object per line (with request_id), or text."
    )
    api_keys: Annotated[list[str], NoDecode] = Field(
        [], repr=False,
        description="API keys, comma-separated; when set, /v1/... needs 'Authorization: Bearer "
        "<key>' (401 otherwise). Health, readiness and /metrics stay open. Empty = no keys.",
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(
        [], description="Origins allowed by CORS, comma-separated (e.g. https://lab.example); "
        "'*' = any. Empty = no CORS headers (browsers on other origins are refused).",
    )
    request_timeout_s: float = Field(
        120.0, ge=0, description="Per-request time limit, seconds (504 'timeout' beyond; the "
        "forward already running finishes in the background). 0 = no limit.",
    )

    max_connections: int = Field(
        1024, ge=1, le=1_000_000, description="Most open client connections (`attnscope "
        "serve`). Beyond it the connection idle the longest is closed to make room, or, when "
        "none is idle, the newcomer gets 503 with Retry-After at once (service/server.py). "
        "Must leave 256 file descriptors under `ulimit -n` (raised to its hard limit at start).",
    )
    max_client_connections: int = Field(
        512, ge=0, description="Most open connections from one client address (`attnscope "
        "serve`); beyond it that client's idle (then slowest) connection is closed to make "
        "room, or the newcomer gets 503 with Retry-After. Behind a proxy every connection has "
        "the proxy's address: raise it or set 0 (no limit).",
    )
    slow_sender_s: float = Field(
        0.25, ge=0, description="When max_connections or max_client_connections is reached "
        "and no connection is idle, of the connections whose request has been arriving "
        "(headers, or a body the server reads) at least this many seconds the one that sent "
        "the fewest bytes per second is evicted with 408 to make room, before a newcomer is "
        "refused (slow-loris clients cannot hold every slot).",
    )
    shutdown_grace_s: float = Field(
        30.0, ge=1, description="On SIGTERM/SIGINT: seconds the requests in flight may take "
        "to finish (uvicorn timeout_graceful_shutdown); new requests get 503 "
        "'shutting_down' at once, and jobs still running 2 s before the end are stopped and "
        "answered 503 too.",
    )
    health_port: int = Field(
        0, ge=0, le=65535, description="A port of its own for /healthz and /readyz "
        "(`attnscope serve`; service/server.py health_listener), answered while the main "
        "listener is saturated; point the liveness/readiness probes at it. 0 = none (the main "
        "port serves them as always).",
    )
    header_timeout_s: float = Field(
        10.0, ge=0, description="Most seconds from a connection's start (or a request's first "
        "byte) to the end of the request's headers; beyond it 408 and the connection is closed "
        "(slow, trickling clients). 0 = no limit.",
    )
    body_timeout_s: float = Field(
        30.0, ge=0, description="Most seconds from the end of a request's headers to the end "
        "of its body (at the default max_body_bytes, an upload of at least ~133 kB/s); beyond "
        "it 408 and the connection is closed (slow, trickling bodies; `attnscope serve`). Time "
        "while the server itself does not read is not counted. 0 = no limit.",
    )
    keep_alive_timeout_s: float = Field(
        5.0, ge=1, description="Seconds an idle kept-alive connection stays open after a "
        "response (uvicorn timeout_keep_alive).",
    )
    max_header_bytes: int = Field(
        32_768, ge=1024, description="Largest request line + headers, bytes; beyond it 431 and "
        "the connection is closed.",
    )

    @field_validator("api_keys", "cors_origins", mode="before")
    @classmethod
    def _split_commas(cls, v):
        if isinstance(v, str):
            return [x.strip() for x in v.split(",") if x.strip()]
        return v
