"""Eager attention that writes each layer's pattern straight into the recording buffer.

Used where the runtime records through Hugging Face's modules: encoders (BERT) and the causal
configurations the hooked forward does not implement (``Runtime.hooked_parts``: GPT-2's
``reorder_and_upcast_attn``, a GPT-2 without its LM head, dynamic RoPE). Every other causal LM
records through service/runtime/hooked.py ``record`` (the same in-place scores buffer and
softmax into the buffer, ``hooked._Run``), the forward its other endpoints run.

Hugging Face's eager attention (``eager_attention_forward`` of GPT-2 and BERT) computes, per
layer, ``pattern = softmax(q.k^T * scaling + mask)`` (Vaswani et al. 2017, eq. 1; S000) into a
fresh tensor, which the runtime then copied into the text's ``[layer, head, query_pos,
key_pos]`` buffer: at T = 1024 on GPT-2-small shapes a 604 MB copy into memory faulted in for
it (~0.15 s of a ~2.4 s forward) and two copies of every pattern alive at once.

:func:`install` registers :func:`attention_into_buffer` with the transformers
``AttentionInterface`` under :data:`NAME` (and Hugging Face's own eager mask under the same
name) and points the served model's config at it. For a module with a recording target (set
by the runtime for the duration of one forward, on its own thread, see :func:`recording`) the
function runs the eager operations in the eager order, the pre-softmax scores in one
scratch buffer that every layer of the forward reuses (the product with ``out=``, the scaling
and the mask in place) and the softmax written into the target (``torch.softmax(...,
out=)``): the same kernels, bit for bit; every other call (no target,
a batch of several texts, another device, dtype or shape) runs the family's own
``eager_attention_forward`` unchanged. Rotary families (Llama, Mistral, Qwen2, Gemma, Gemma 2,
GPT-NeoX) follow their eager function too: ``repeat_kv`` for grouped-query attention, Gemma 2's
soft-cap ``c * tanh(s / c)`` in its order (in place: the same elementwise kernels), the
sliding window through the mask; their softmax is in float32, so a float16/bfloat16 model runs
the family's function. The same function keeps each layer's q/k/v as it receives them: the
only place a rotary family's q and k exist after rotary. ``tests/test_runtime.py`` compares patterns, hidden
states and logits bit for bit with Hugging Face's eager forward.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

#: the attention implementation name the served model's config carries once installed
NAME = "attnscope_eager"

_local = threading.local()


def attention_into_buffer(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: torch.Tensor | None,
                          scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """Eager attention (the transformers ``AttentionInterface`` signature): ``query``
    ``[batch, head, pos, d_head]``, ``key``, ``value`` ``[batch, kv_head, pos, d_head]`` (kv_head
    = head without grouped-query attention), additive ``attention_mask`` ``[batch | 1, 1,
    query_pos, key_pos]`` (causal, padding and sliding-window masking in one) or None. Returns
    ``(attn_output [batch, query_pos, head, d_head], pattern [batch, head, query_pos,
    key_pos])``.

    For a module registered by :func:`recording` with a q/k/v slot, ``(query, key, value)``
    are kept there as received (rotary families: q and k after rotary, k/v on the key/value
    heads). The pattern is a view of the module's recording target when it has one (batch of
    one, same device/dtype/shape, and the family's softmax dtype is the input's), computed
    as the family's eager function does: ``repeat_kv`` (each key/value head repeated for
    ``module.num_key_value_groups`` consecutive query heads), ``q.k^T * scaling``, Gemma 2's
    soft-cap ``c * tanh(s / c)`` (``softcap``), ``+ mask``, softmax; else the family's own eager
    function's result."""
    slots = getattr(_local, "qkv", None)
    slot = slots.get(module) if slots else None
    if slot is not None:
        slot[:] = (query, key, value)
    targets = getattr(_local, "targets", None)
    out = targets.get(module) if targets else None
    softcap = kwargs.get("softcap")
    if out is None or query.shape[0] != 1 or out.device != query.device \
            or out.dtype != query.dtype or out.shape != (query.shape[1], query.shape[2],
                                                         key.shape[2]) \
            or (getattr(module, "_attnscope_softmax_float32", False)
                and query.dtype != torch.float32):
        return module._attnscope_eager(module, query, key, value, attention_mask,
                                       scaling=scaling, dropout=dropout, **kwargs)
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    if groups > 1:  # Hugging Face's repeat_kv: [b, kv, t, d] -> [b, kv * groups, t, d]
        b, kv, t, d = key.shape
        key = key[:, :, None].expand(b, kv, groups, t, d).reshape(b, kv * groups, t, d)
        value = value[:, :, None].expand(b, kv, groups, t, d).reshape(b, kv * groups, t, d)
    scores = _scratch(out).unsqueeze(0)  # [1, head, query_pos, key_pos], reused by every layer
    torch.matmul(query, key.transpose(-1, -2), out=scores)
    scores.mul_(scaling)
    if softcap is not None:  # Gemma 2: s / c, tanh, * c (its eager order, in place)
        scores.div_(softcap).tanh_().mul_(softcap)
    if attention_mask is not None:
        if attention_mask.dtype == scores.dtype and \
                torch.broadcast_shapes(attention_mask.shape, scores.shape) == scores.shape:
            scores.add_(attention_mask)
        else:
            scores = scores + attention_mask
    pattern = torch.softmax(scores, dim=-1, out=out.unsqueeze(0))
    del scores
    pattern = pattern.type(value.dtype)
    pattern = nn.functional.dropout(pattern, p=dropout, training=module.training)
    return torch.matmul(pattern, value).transpose(1, 2), pattern


def _scratch(like: torch.Tensor) -> torch.Tensor:
    """This thread's pre-softmax scores buffer of ``like``'s shape, dtype and device for the
    forward being recorded (:func:`recording`): made at the first layer, written by every
    layer's ``q.k^T``, scaling and mask in place (the same kernels as Hugging Face's
    out-of-place operations, bit for bit). Hugging Face's eager attention makes three fresh
    ``[head, query_pos, key_pos]`` tensors per layer (the product, the scaled scores, the
    masked scores); at T = 1024 on GPT-2-small shapes each is 50 MB, past glibc's mmap
    threshold, so every one was mapped and faulted in afresh: 36 of them, 1.8 GB of page
    faults, per forward."""
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.shape != like.shape or buf.dtype != like.dtype \
            or buf.device != like.device:
        buf = _local.scratch = torch.empty_like(like)
    return buf


def install(model: nn.Module, attention_modules: list[nn.Module],
            softmax_float32: bool = False) -> bool:
    """Serve ``model`` through :func:`attention_into_buffer` when it is safe: the config asks
    for 'eager', every attention module's Python module defines ``eager_attention_forward``
    (kept on the module as its fallback) and no GPT-2 ``reorder_and_upcast_attn`` (its eager
    path is another function). ``softmax_float32``: the family's eager softmax runs in float32
    (``dtype=torch.float32``, the rotary families), so the in-place pattern is computed only
    for float32 inputs (others run the family's function). Returns whether it was installed
    (else nothing changes)."""
    cfg = model.config
    if getattr(cfg, "_attn_implementation", None) != "eager" or \
            getattr(cfg, "reorder_and_upcast_attn", False):
        return False
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask
    except ImportError:  # pragma: no cover - older transformers: the copy stays
        return False
    fallbacks = []
    for m in attention_modules:
        fn = getattr(sys.modules.get(type(m).__module__), "eager_attention_forward", None)
        if fn is None:
            return False
        fallbacks.append(fn)
    for m, fn in zip(attention_modules, fallbacks):
        m._attnscope_eager = fn
        m._attnscope_softmax_float32 = bool(softmax_float32)
    AttentionInterface.register(NAME, attention_into_buffer)
    AttentionMaskInterface.register(NAME, eager_mask)
    cfg._attn_implementation = NAME
    return True


@contextmanager
def recording(targets: dict[nn.Module, torch.Tensor],
              qkv: dict[nn.Module, list] | None = None) -> Iterator[None]:
    """For the forward run inside: each attention module of ``targets`` writes its pattern
    ``[head, query_pos, key_pos]`` into its target, and each module of ``qkv`` puts the
    ``(query, key, value)`` it receives into its list (this thread only)."""
    _local.targets = targets
    _local.qkv = qkv
    _local.scratch = None
    try:
        yield
    finally:
        _local.targets = None
        _local.qkv = None
        _local.scratch = None  # freed with the forward
