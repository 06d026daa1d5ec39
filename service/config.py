"""Configuration: one pydantic-settings class, environment prefix ``ATTNSCOPE_``.

Every option is documented once, here, with its default. Bad values fail at start-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

BUNDLED_MODEL_DIR = Path(__file__).resolve().parent / "bundled_model"
BUNDLED_MODEL_ID = "attnscope-tiny-gpt2"


class Settings(BaseSettings):
    """attnscope settings. Each maps to ``ATTNSCOPE_<NAME>`` and to a ``serve`` flag."""

    model_config = SettingsConfigDict(env_prefix="ATTNSCOPE_", extra="ignore")

    model: str = Field(
        "gpt2",
        description="Hub id or local directory of the model. 'bundled' = the bundled checkpoint. "
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
    max_batch: int = Field(32, ge=1, le=4096, description="Most texts in one request.")
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
        16, ge=1, description="Most texts per padded forward pass (a batch request is chunked)."
    )
    padding_side: Literal["right", "left"] = Field(
        "right", description="Padding side for batched forwards (results never depend on it)."
    )
    cache_entries: int = Field(128, ge=0, description="Most forward results kept in the LRU cache.")
    cache_bytes: int = Field(
        1_073_741_824, ge=0, description="Most bytes of tensors kept in the forward cache."
    )
    exit_on_load_failure: bool = Field(
        True, description="Exit the process when the model fails to load (start-up error)."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info")
