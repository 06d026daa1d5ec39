"""Verification, mode ``recorded_qkv``: the attention step re-run from the RECORDED q/k/v.

The cheap consistency check (the default mode, ``from_scratch``, is in
:mod:`attnscope.service.analysis.verify`): attention recomputed from the model's OWN q, k and v
(the outputs of its q/k/v projections, recorded by the runtime's hooks) with the scaled
dot-product formula and the causal mask, then the output projection; max absolute difference
per layer and head against the model's own attention; pass/fail at a tolerance. It checks
only the step ``q, k, v -> pattern -> output`` with the same torch operations in the model's
dtype, so its differences are usually exactly 0; it cannot see a wrong embedding, position,
LayerNorm or MLP, nor a q/k/v weight change made after the forward (unless ``projections``).

The formula is ``attention(Q, K, V, mask)`` of 000_1c89b6c8c2a32040.txt, multi-head as in
001_92e9928af52718c3.txt, written in numbered steps like nanoGPT's manual attention branch. It
honours every switch Hugging Face's eager attention honours, read from the model's config in
:class:`AttentionParams` (``y = x @ W + b`` layout): the
scaling (GPT-2 ``scale_attn_weights``, ``scale_attn_by_inverse_layer_idx``), the float32 upcast
of the scores (``reorder_and_upcast_attn``) and the mask value (an additive
``torch.finfo(dtype).min`` on future keys, as transformers' eager mask; a softmax gives exactly
0 there, as with -inf). The output projection uses the model's CURRENT ``W_o``, ``b_o``.

Three links of one layer's attention, each checked on its own:

* ``x -> q, k, v`` (only with ``projections=True``): the recorded attention input through the
  CURRENT q/k/v weights against the recorded q, k, v. Three ``d_model x d_model`` matmuls per
  layer -- about three quarters of the cost, so it is opt-in.
* ``q, k -> pattern``: softmax of the scaled, masked scores against the recorded pattern.
* ``pattern, v -> output``: ``(pattern @ v)`` heads merged, through ``W_o``/``b_o``, against
  the recorded attention output (after the output projection, before dropout/residual).

Because the default path starts from the recorded q/k/v, a change of the q/k/v weights after
the forward is NOT seen by it (the recorded q/k/v are what the model used); a change of the
output projection is. ``projections=True`` sees both.

Rotary families (Llama, Mistral, Qwen2, Gemma, Gemma 2, GPT-NeoX): the recorded q and k are
AFTER rotary (where the attention function receives them) and k/v are on the key/value heads;
the recomputation repeats key/value head ``h // (n_heads // n_kv_heads)`` for query head h
(``repeat_kv``), soft-caps the scores (Gemma 2: ``c * tanh(s / c)``, before the mask), masks
keys outside the layer's sliding window (``query_pos - window < key_pos <= query_pos``) and
takes the softmax in float32 as their eager functions do; ``projections=True`` rotates the
projected q/k with the model's own ``inv_freq`` (positions ``0..T-1``, rotate-half layout,
the first ``rotary_dim`` dimensions of each head) before comparing.

Differences: ``max |recomputed - recorded|`` per layer and head (pattern), per layer (output,
q/k/v), overall. A NaN anywhere (recomputed or recorded) fails the check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionParams:
    """One layer's attention parameters in ONE layout, whatever the family (for verification).

    Every projection is ``y = x @ W + b`` with ``W`` stored ``[d_in, d_out]`` (GPT-2's Conv1D
    layout; BERT's ``nn.Linear`` weights ``[d_out, d_in]`` are transposed into it). The tensors
    are detached views of the model's CURRENT parameters (not copies): read them, never write.
    ``scaling`` and ``upcast`` are derived from the model's config switches, independently of
    the attention module's own precomputed ``scaling``.
    """

    W_q: torch.Tensor  # [d_model, n_heads * d_head]
    b_q: torch.Tensor  # [n_heads * d_head]
    W_k: torch.Tensor  # [d_model, n_heads * d_head]
    b_k: torch.Tensor  # [n_heads * d_head]
    W_v: torch.Tensor  # [d_model, n_heads * d_head]
    b_v: torch.Tensor  # [n_heads * d_head]
    W_o: torch.Tensor  # [n_heads * d_head, d_model], output projection
    b_o: torch.Tensor  # [d_model]
    n_heads: int
    d_head: int
    scaling: float  # q.k multiplier
    upcast: bool  # scores and softmax in float32 (GPT-2 reorder_and_upcast_attn)
    causal: bool
    #: key/value heads (grouped-query attention: W_k/W_v ``[d_model, n_kv_heads * d_head]``,
    #: query head h reads key/value head ``h // (n_heads // n_kv_heads)``); None = n_heads
    n_kv_heads: int | None = None
    window: int | None = None  # sliding key window (keys query_pos - window < k <= query_pos)
    softcap: float | None = None  # attention logit soft-cap c: scores -> c * tanh(scores / c)
    softmax_float32: bool = False  # softmax computed in float32, then cast (rotary families)
    #: rotary embedding (``inv_freq [rotary_dim / 2]``, ``attention_scaling``, ``rotary_dim``):
    #: the recorded q/k are the projections rotated by position; None = no rotary
    rotary: dict | None = None

    @property
    def kv_groups(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // (self.n_kv_heads or self.n_heads)

    @classmethod
    def of(cls, adapter, layer: int) -> "AttentionParams":
        """Layer ``layer``'s parameters from a runtime adapter's ``attention_weights(layer)``
        (plain values; duck-typed, so the analysis imports nothing of the runtime)."""
        return cls(**adapter.attention_weights(layer))



DEFAULT_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10, torch.float16: 1e-2,
                     torch.bfloat16: 1e-2}


class RecordedForward(Protocol):
    """What :func:`verify` reads from a recorded forward (``ForwardResult.tensors``)."""

    q: torch.Tensor  # [layer, head, pos, d_head]
    k: torch.Tensor  # [layer, kv_head, pos, d_head]
    v: torch.Tensor  # [layer, kv_head, pos, d_head]
    pattern: torch.Tensor  # [layer, head, query_pos, key_pos]
    attn_input: torch.Tensor  # [layer, pos, d_model] (read only with projections=True)
    attn_output: torch.Tensor  # [layer, pos, d_model], after the output projection


def causal_mask(T: int, dtype: torch.dtype, device, window: int | None = None) -> torch.Tensor:
    """Additive ``[query_pos, key_pos]`` mask: 0 on visible keys (key_pos <= query_pos, and
    ``query_pos - window < key_pos`` with a sliding ``window``), ``torch.finfo(dtype).min``
    elsewhere -- transformers' eager causal (sliding-window) mask."""
    hidden = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)
    if window is not None:
        hidden |= torch.ones(T, T, dtype=torch.bool, device=device).tril(-window)
    return torch.zeros(T, T, dtype=dtype, device=device).masked_fill_(hidden, torch.finfo(dtype).min)


def apply_rotary(x: torch.Tensor, rotary: dict) -> torch.Tensor:
    """RoPE (Su et al. 2021) as Hugging Face applies it (``apply_rotary_pos_emb``, rotate-half
    layout): ``x [head, pos, d_head]`` at positions ``0..pos-1``; the first ``rotary_dim``
    dimensions become ``x * cos + rotate_half(x) * sin`` with ``cos``/``sin`` of ``pos *
    inv_freq`` (float32, duplicated over the two halves, times ``attention_scaling``), the rest
    pass unchanged."""
    T = x.shape[-2]
    inv = rotary["inv_freq"].to(x.device, torch.float32)
    pos = torch.arange(T, device=x.device)
    freqs = pos[:, None].float() * inv  # [pos, rotary_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * rotary["attention_scaling"]).to(x.dtype)
    sin = (emb.sin() * rotary["attention_scaling"]).to(x.dtype)
    r = rotary["rotary_dim"]
    x_rot, x_pass = x[..., :r], x[..., r:]
    half = torch.cat((-x_rot[..., r // 2:], x_rot[..., : r // 2]), dim=-1)
    return torch.cat(((x_rot * cos) + (half * sin), x_pass), dim=-1)


def recompute_layer(
    q: torch.Tensor,  # [head, pos, d_head], the model's own queries
    k: torch.Tensor,  # [head, pos, d_head], the model's own keys
    v: torch.Tensor,  # [head, pos, d_head], the model's own values
    p: AttentionParams,
    mask: torch.Tensor | None = None,  # [pos, pos] additive, from causal_mask; built if None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's attention from scratch, from its q, k, v.

    Returns ``(pattern [head, query_pos, key_pos], output [pos, d_model])``: the pattern in
    v's dtype (computed in float32 under ``p.upcast``, then cast, as HF does), rows summing to
    1, exactly 0 on future keys of a causal model; the output after the output projection in
    model units. Runs on the device and dtype of ``p.W_o``. Source: 000_1c89b6c8c2a32040.txt
    (scaled dot-product attention), 001_92e9928af52718c3.txt (heads), HF ``eager_attention_forward``.
    """
    dev, dt = p.W_o.device, p.W_o.dtype
    q, k, v = (t.to(dev, dt) for t in (q, k, v))
    H, T, dh = q.shape
    # 0. grouped-query attention: key/value head h // G serves query head h (repeat_kv)
    if k.shape[0] != H:
        G = H // k.shape[0]
        k, v = k.repeat_interleave(G, dim=0), v.repeat_interleave(G, dim=0)
    # 1. compare every query with every key, scaled by the model's own multiplier
    if p.upcast:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(p.scaling)  # [H, T, T] f32
    else:
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(p.scaling)  # [H, T, T]
    # 1b. logit soft-cap (Gemma 2): c * tanh(s / c), before the mask
    if p.softcap is not None:
        scores = torch.tanh(scores / p.softcap) * p.softcap
    # 2. causal (sliding-window) mask: hidden keys get the dtype's most negative value
    if p.causal:
        if mask is None or mask.dtype != scores.dtype:
            mask = causal_mask(T, scores.dtype, scores.device, p.window)
        scores.add_(mask)
    # 3. softmax over the keys -> attention weights, in v's dtype
    if p.softmax_float32:
        pattern = torch.softmax(scores.float(), dim=-1).to(v.dtype)  # [H, T, T]
    else:
        pattern = torch.softmax(scores, dim=-1).to(v.dtype)  # [H, T, T]
    # 4. weighted sum of the values, heads concatenated back: [H, T, dh] -> [T, H*dh]
    z = torch.matmul(pattern, v).transpose(0, 1).reshape(T, H * dh)
    # 5. output projection with the CURRENT weights: y = z @ W_o + b_o
    out = torch.addmm(p.b_o, z, p.W_o)  # [T, d_model]
    return pattern, out


def project_qkv(
    x: torch.Tensor,  # [pos, d_model], the layer's attention input
    p: AttentionParams,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[head, pos, d_head]``, k, v ``[kv_head, pos, d_head]`` from the attention input with
    the CURRENT weights (``y = x @ W + b``, as GPT-2's Conv1D / BERT's Linear), split into
    heads; rotary families: q and k then rotated (:func:`apply_rotary`, positions 0..T-1).
    Runs on the weights' device and dtype. Three ``[pos, d_model] x [d_model, width]``
    matmuls."""
    x = x.to(p.W_q.device, p.W_q.dtype)
    T = x.shape[0]
    kv = p.n_kv_heads or p.n_heads
    q, k, v = (
        torch.addmm(b, x, W).view(T, n, p.d_head).transpose(0, 1)
        for W, b, n in ((p.W_q, p.b_q, p.n_heads), (p.W_k, p.b_k, kv), (p.W_v, p.b_v, kv))
    )
    if p.rotary is not None:
        q, k = apply_rotary(q, p.rotary), apply_rotary(k, p.rotary)
    return q, k, v


def _diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|a - b|`` on a's device, in at least float32 (a NaN in either stays NaN)."""
    dt = torch.promote_types(a.dtype, torch.float32)
    return (a.to(dt) - b.to(a.device, dt)).abs_()


def _num(x: float) -> float | None:
    """float, or None for NaN (JSON-safe)."""
    return None if math.isnan(x) else float(x)


def _fmt(x: float | None) -> str:
    return "NaN" if x is None or math.isnan(x) else f"{x:.3g}"


def _bad(x: float, tol: float) -> bool:
    return not (math.isfinite(x) and x <= tol)


def verify(
    t: RecordedForward,
    params: dict[int, AttentionParams],  # layer -> that layer's current weights
    tolerance: float | None = None,
    projections: bool = False,
) -> dict:
    """Recompute each layer in ``params`` from the recorded q/k/v and compare.

    Args:
        t: a recorded forward (``ForwardResult.tensors``): ``q``/``k``/``v``
            ``[layer, head, pos, d_head]``, ``pattern`` ``[layer, head, query_pos, key_pos]``,
            ``attn_output`` ``[layer, pos, d_model]``; ``attn_input`` ``[layer, pos, d_model]``
            when ``projections``.
        params: the layers to check, in order, with the model's current weights.
        tolerance: largest absolute difference that passes; None = ``DEFAULT_TOLERANCE`` of
            the weights' dtype (1e-5 for float32).
        projections: also recompute q/k/v from ``attn_input`` with the current q/k/v weights
            and compare them with the recorded ones (``qkv_max_abs_diff``; counts toward
            pass/fail). Costs three extra ``d_model x d_model`` matmuls per layer (about 3x
            the default's time on GPT-2 small).

    Returns:
        dict with ``passed`` (bool: every difference finite and <= tolerance), ``max_abs_diff``
        (float or None for NaN), ``tolerance``, ``dtype``, ``projections``, ``failed_layers``
        (ascending), ``message`` (names the first failing layer and head), and ``layers``: per
        layer ``{layer, pattern_max_abs_diff, output_max_abs_diff, qkv_max_abs_diff, heads:
        [{head, pattern_max_abs_diff}], passed}``. Differences are absolute, in probability
        units (pattern) or model units (output, q/k/v); None stands for NaN, which always
        fails (``qkv_max_abs_diff`` is also None when ``projections`` is False).
    """
    dtype = next(iter(params.values())).W_o.dtype if params else t.pattern.dtype
    tol = float(tolerance if tolerance is not None else DEFAULT_TOLERANCE.get(dtype, 1e-5))
    sizes: list[tuple[int, bool]] = []  # per layer: (n_heads, q/k/v checked)
    vecs: list[torch.Tensor] = []  # per layer: [head diffs..., output diff, (q/k/v diff)]
    masks: dict = {}
    with torch.inference_mode():
        for layer, p in params.items():
            dev = p.W_o.device
            # the model's own q, k, v [head, pos, d_head] (recorded by the runtime's hooks)
            q, k, v = (getattr(t, n)[layer].to(dev) for n in ("q", "k", "v"))
            parts = []
            mdt = torch.float32 if p.upcast else p.W_o.dtype
            mkey = (mdt, dev, p.window)
            if p.causal and mkey not in masks:
                masks[mkey] = causal_mask(q.shape[1], mdt, dev, p.window)
            pattern, out = recompute_layer(q, k, v, p, masks.get(mkey))
            parts.append(_diff(pattern, t.pattern[layer]).amax(dim=(-2, -1)))  # [head]
            parts.append(_diff(out, t.attn_output[layer]).amax().view(1))
            if projections:
                # the projections: the recorded attention input through the current weights
                rq, rk, rv = project_qkv(t.attn_input[layer], p)
                parts.append(torch.stack([_diff(r, m).amax()
                                          for r, m in ((rq, q), (rk, k), (rv, v))]).amax().view(1))
            vec = torch.cat(parts)  # one dtype: float32, or float64 for a float64 model (MPS has none)
            vecs.append(vec.to(vecs[0].device) if vecs else vec)
            sizes.append((parts[0].numel(), projections))
        # one transfer for all layers (no device sync per layer)
        flat = torch.cat(vecs).cpu().tolist() if vecs else []

    layers_out, failed, first_failure, allv = [], [], None, []
    i = 0
    for layer, (n, has_qkv) in zip(params, sizes):
        heads = flat[i: i + n]
        out_d = flat[i + n]
        qkv_d = flat[i + n + 1] if has_qkv else None
        i += n + 1 + has_qkv
        pat_d = (math.nan if any(math.isnan(d) for d in heads) else max(heads)) if heads else 0.0
        checked = heads + [out_d] + ([qkv_d] if has_qkv else [])
        allv.extend(checked)
        ok = not any(_bad(d, tol) for d in checked)
        if not ok:
            failed.append(layer)
            if first_failure is None:
                what = []
                if has_qkv and _bad(qkv_d, tol):
                    what.append(f"q/k/v projections differ by {_fmt(qkv_d)}")
                bad_heads = [h for h, d in enumerate(heads) if _bad(d, tol)]
                if bad_heads:
                    h = bad_heads[0]
                    what.append(f"pattern of head {h} differs by {_fmt(heads[h])} "
                                f"(heads failing: {bad_heads})")
                if _bad(out_d, tol):
                    what.append(f"output differs by {_fmt(out_d)}")
                first_failure = f"layer {layer}: " + "; ".join(what)
        layers_out.append({
            "layer": layer,
            "pattern_max_abs_diff": _num(pat_d),
            "output_max_abs_diff": _num(out_d),
            "qkv_max_abs_diff": None if qkv_d is None else _num(qkv_d),
            "heads": [{"head": h, "pattern_max_abs_diff": _num(d)} for h, d in enumerate(heads)],
            "passed": ok,
        })
    max_diff = (float("nan") if any(math.isnan(d) for d in allv) else max(allv)) if allv else 0.0
    passed = not failed
    if passed:
        message = (f"passed: {len(layers_out)} layer(s) match to {_fmt(max_diff)} "
                   f"(tolerance {tol:g})")
    else:
        message = (f"failed in layer(s) {sorted(failed)} at tolerance {tol:g}; first: "
                   f"{first_failure}")
    return {
        "passed": passed,
        "max_abs_diff": _num(max_diff),
        "tolerance": tol,
        "dtype": str(dtype).replace("torch.", ""),
        "projections": bool(projections),
        "failed_layers": sorted(failed),
        "message": message,
        "layers": layers_out,
    }
