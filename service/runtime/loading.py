"""Loading a model: by hub id or local directory, safetensors only, eager attention, never
remote code; the device choice, the offline check and the revision of a local checkpoint.

:func:`_load_pretrained` raises :class:`ModelLoadError` (a start-up error) with a message
that names the model; ``Runtime.load`` (service/runtime/model.py) falls back to the bundled
checkpoint for the default ``gpt2`` when that one cannot be loaded.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from ..config import BUNDLED, Settings
from .adapters import ADAPTERS, CAUSAL_TYPES

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
log = logging.getLogger("attnscope.runtime")

#: config.json keys by which a checkpoint asks for an attention implementation (Hugging Face
#: reads ``_attn_implementation``; the others are spellings seen in saved configs). Only
#: "eager" returns the attention weights every analysis needs (``output_attentions``), so the
#: loader always asks for eager and says which key it overrode.
ATTN_KEYS = ("_attn_implementation", "attn_implementation", "_attn_implementation_internal")


class ModelLoadError(RuntimeError):
    """The model could not be loaded or fails the start-up probe (a start-up error)."""


def choose_device(setting: str) -> torch.device:
    """cuda, then mps, then cpu (source 001_92e9928af52718c3.txt), or the configured device."""
    if setting != "auto":
        return torch.device(setting)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


#: Files of a local checkpoint that change the numbers it serves (the revision hashes them):
#: the weights, the config (scales, activation, eps, ...), the tokenizer (ids, framing) and
#: the generation config. README, model card and other files are not hashed.
REVISION_FILES = ("*.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
                  "merges.txt", "added_tokens.json")


def _weights_revision(path: Path) -> str:
    """``sha256:<12 hex>`` over every file of a local checkpoint that changes the numbers
    (:data:`REVISION_FILES`: weights, config, tokenizer files), each hashed with its name, in
    name order; ``"unknown"`` when the directory has no weights."""
    if not any(path.glob("*.safetensors")):
        return "unknown"
    files = sorted({f for pat in REVISION_FILES for f in path.glob(pat) if f.is_file()},
                   key=lambda f: f.name)
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return "sha256:" + h.hexdigest()[:12]


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers at all (DNS + TCP), so an offline machine falls back
    at once instead of waiting through huggingface_hub's retries."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _attn_keys_overridden(source: str, kw: dict, local: bool) -> dict[str, object]:
    """The :data:`ATTN_KEYS` of the checkpoint's raw config.json (the file as saved, before
    ``AutoConfig`` drops or applies them) whose value is not "eager": key -> value. Empty when
    the file cannot be read (the load itself then says why)."""
    from transformers import PretrainedConfig

    try:
        raw, _ = PretrainedConfig.get_config_dict(source, local_files_only=True, **kw)
    except Exception:
        if local:
            return {}
        try:
            raw, _ = PretrainedConfig.get_config_dict(source, **kw)
        except Exception:
            return {}
    found = {}
    for cfg in [raw, *(v for v in raw.values() if isinstance(v, dict))]:  # + sub-configs
        for key in ATTN_KEYS:
            if cfg.get(key) not in (None, "eager"):
                found[key] = cfg[key]
    return found


def _force_eager_config(config) -> None:
    """Set eager attention on ``config`` and its sub-configs (text/vision configs of composite
    models), whatever config.json said: an implementation kept there would override the
    ``attn_implementation="eager"`` given to ``from_pretrained`` in some transformers
    versions (issue 29: ``"_attn_implementation": "sdpa"`` broke start-up)."""
    for cfg in [config, *(getattr(config, k, None) for k in getattr(config, "sub_configs", {}))]:
        if cfg is None:
            continue
        for key in ("attn_implementation", "_attn_implementation_internal"):
            if key in cfg.__dict__:
                cfg.__dict__.pop(key)
        try:
            cfg._attn_implementation = "eager"
        except Exception:  # a version without the setter: the kwarg decides
            pass


def _load_pretrained(name: str, settings: Settings):
    """Load (model, tokenizer, identity) by hub id or local directory. Safetensors only,
    eager attention, never remote code."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    if name in BUNDLED:
        path, model_id, recipe = BUNDLED[name]
        if not (path / "model.safetensors").exists():
            raise ModelLoadError(f"bundled checkpoint missing at {path}: run {recipe}")
    else:
        path, model_id = Path(name).expanduser(), name
    local = path.is_dir()
    if not local and (path.is_absolute() or name.startswith(("./", "../", "~", ".\\"))
                      or path.exists()):
        # spelled as a path (a hub id is "name" or "org/name"): no hub lookup to blame
        raise ModelLoadError(
            f"could not load model {name!r}: "
            + ("it is a file, not a checkpoint directory" if path.exists()
               else "no such directory")
        )
    source = str(path) if local else name
    kw: dict = {"trust_remote_code": False}
    if not local:
        kw["revision"] = settings.revision
        os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
        os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    elif name not in BUNDLED:
        # the directory's name (not its full path); a generic name keeps its parent's
        resolved = path.resolve()
        model_id = resolved.name
        if model_id in ("model", "models", "checkpoint", "snapshot") and resolved.parent.name:
            model_id = f"{resolved.parent.name}/{model_id}"
    try:
        try:
            config = AutoConfig.from_pretrained(source, local_files_only=True, **kw)
        except Exception as exc:
            if local:
                raise
            if not _hub_reachable():
                raise ModelLoadError(
                    f"could not load model {name!r}: not in the local Hugging Face cache and the "
                    "hub is unreachable (offline)"
                ) from exc
            config = AutoConfig.from_pretrained(source, **kw)
        if config.model_type not in ADAPTERS:
            raise ModelLoadError(
                f"model {name!r} has model_type {config.model_type!r}; supported: "
                f"{sorted(ADAPTERS)}"
            )
        cls = AutoModelForCausalLM if config.model_type in CAUSAL_TYPES else AutoModel
        overridden = _attn_keys_overridden(source, kw, local)
        for key, value in overridden.items():
            log.warning("model %s: config.json asks for %s=%r; overridden: attention is eager "
                        "(the only implementation that returns attention weights)",
                        name, key, value)
        _force_eager_config(config)
        common = dict(kw, config=config, attn_implementation="eager", use_safetensors=True,
                      dtype=DTYPES[settings.dtype])
        try:
            model = cls.from_pretrained(source, local_files_only=True, **common)
            tok = AutoTokenizer.from_pretrained(source, local_files_only=True, **kw)
        except Exception:
            if local:
                raise
            model = cls.from_pretrained(source, **common)
            tok = AutoTokenizer.from_pretrained(source, **kw)
    except ModelLoadError:
        raise
    except Exception as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"could not load model {name!r}: {type(exc).__name__}: {msg}") from exc
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in (None, "eager"):
        keys = ", ".join(f"{k}={v!r}" for k, v in overridden.items()) or "none found"
        raise ModelLoadError(
            f"model {name!r} loaded with attention implementation {impl!r}, not 'eager' "
            f"(config.json attention keys: {keys}); attention weights need eager")
    if not getattr(tok, "is_fast", False):
        raise ModelLoadError(f"model {name!r}: a fast tokenizer is required (character offsets)")
    device = choose_device(settings.device)
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    revision = getattr(config, "_commit_hash", None) if not local else None
    if not revision:
        revision = _weights_revision(path) if local else "unknown"
    return model, tok, {"id": model_id, "revision": revision}
