"""Random small checkpoints of every served family, saved locally with transformers.

Each is a real Hugging Face ``*ForCausalLM`` of its family with tiny shapes and random weights
(``initializer_range`` larger than the default so attention is peaked, not uniform), saved
with safetensors and the bundled GPT-2 tokenizer beside it (vocabulary 2,048), so the loader,
the runtime and every endpoint run on it offline. Shapes exercise what the family changes:
grouped-query attention (4 query heads, 2 key/value heads), partial rotary (GPT-NeoX 0.25),
a sliding window shorter than the test texts (Mistral 8; Gemma 2 on alternate layers),
soft-capping (Gemma 2), q/k/v biases (Qwen2), ``1 + weight`` RMSNorm and ``sqrt(d_model)``
embedding scale (Gemma).

    path = family_checkpoint("llama", tmp_path)        # -> Path of the saved directory
    FAMILIES                                          # the family names, in a stable order
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from attnscope.service.config import BUNDLED_MODEL_DIR

FAMILIES = ("llama", "mistral", "qwen2", "gemma", "gemma2", "gpt_neox")

#: shared shapes: 2 layers, d_model 64, 4 query heads of 16, 2 key/value heads, MLP 128
COMMON = dict(vocab_size=2048, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=128, max_position_embeddings=256, bos_token_id=0,
              eos_token_id=0, pad_token_id=None, initializer_range=0.2,
              tie_word_embeddings=False)


def family_config(family: str, **overrides):
    """The transformers config of ``family``'s test checkpoint (``overrides`` win)."""
    import transformers as tf

    c = dict(COMMON)
    if family == "llama":
        cfg = dict(c, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-6)
        cls = tf.LlamaConfig
    elif family == "mistral":
        cfg = dict(c, num_key_value_heads=2, rope_theta=10000.0, sliding_window=8)
        cls = tf.MistralConfig
    elif family == "qwen2":
        cfg = dict(c, num_key_value_heads=2, rope_theta=1000000.0, use_sliding_window=False)
        cls = tf.Qwen2Config
    elif family == "gemma":
        cfg = dict(c, num_key_value_heads=2, head_dim=16, hidden_act="gelu_pytorch_tanh",
                   hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
        cls = tf.GemmaConfig
    elif family == "gemma2":
        cfg = dict(c, num_key_value_heads=2, head_dim=16, hidden_activation="gelu_pytorch_tanh",
                   sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   query_pre_attn_scalar=16, tie_word_embeddings=True)
        cls = tf.Gemma2Config
    elif family == "gpt_neox":
        cfg = dict(c, rotary_pct=0.25, use_parallel_residual=True, hidden_act="gelu",
                   layer_norm_eps=1e-5)
        cfg.pop("pad_token_id")
        cls = tf.GPTNeoXConfig
    else:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    cfg.update(overrides)
    return cls(**cfg)


def family_checkpoint(family: str, root: Path, seed: int = 0, **overrides) -> Path:
    """Save a random ``family`` checkpoint (float32, safetensors, eager attention) and the
    bundled tokenizer under ``root / family``; returns that directory (reused if present)."""
    import transformers as tf

    tag = hashlib.sha256(json.dumps(overrides, sort_keys=True, default=str).encode()).hexdigest()
    path = Path(root) / (family if not overrides else f"{family}-{tag[:12]}")
    if (path / "model.safetensors").exists():
        return path
    torch.manual_seed(seed)
    config = family_config(family, **overrides)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL_DIR / name, path / name)
    return path
