"""Verification: the model's attention against a from-scratch recomputation.

For every layer, the model's own attention input (recorded by the runtime) goes through the
textbook scaled dot-product attention -- ``attention(Q, K, V, mask)`` of
000_1c89b6c8c2a32040.txt, multi-head as in 001_92e9928af52718c3.txt, written in numbered steps
like nanoGPT's manual attention branch -- with the model's CURRENT weights in the one layout of
:class:`attnscope.service.runtime.adapters.AttentionParams` (``y = x @ W + b``). It honours
every switch Hugging Face's eager attention honours: the scaling (GPT-2
``scale_attn_weights``, ``scale_attn_by_inverse_layer_idx``), the float32 upcast of the scores
(``reorder_and_upcast_attn``), and the mask value (an additive ``torch.finfo(dtype).min`` on
future keys, as transformers' eager mask; a softmax gives exactly 0 there, as with -inf).

The result is compared with the recorded pattern ``[layer, head, query_pos, key_pos]`` and the
recorded attention output after the output projection ``[layer, pos, d_model]``: max absolute
difference per layer and head, per layer, overall; pass/fail at a tolerance. A NaN anywhere
fails the check.
"""

from __future__ import annotations

import math

import torch

from attnscope.service.runtime.adapters import AttentionParams

DEFAULT_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10, torch.float16: 1e-2,
                     torch.bfloat16: 1e-2}


def recompute_layer(
    x: torch.Tensor,  # [pos, d_model], the layer's attention input
    p: AttentionParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's attention from scratch.

    Returns ``(pattern [head, query_pos, key_pos], output [pos, d_model])`` in the dtype of the
    weights (the pattern in float32 under ``p.upcast`` before the cast to v's dtype, as HF does).
    Runs on the weights' device.
    """
    x = x.to(p.W_q.device, p.W_q.dtype)
    T = x.shape[0]
    H, dh = p.n_heads, p.d_head
    # 1. project the attention input to queries, keys and values: y = x @ W + b
    q = x @ p.W_q + p.b_q  # [T, H*dh]
    k = x @ p.W_k + p.b_k  # [T, H*dh]
    v = x @ p.W_v + p.b_v  # [T, H*dh]
    # 2. split heads: [T, H*dh] -> [H, T, dh]
    q, k, v = (t.view(T, H, dh).transpose(0, 1) for t in (q, k, v))
    # 3. compare every query with every key, scaled by the model's own multiplier
    if p.upcast:
        scores = (q.float() @ k.float().transpose(-1, -2)) * p.scaling  # [H, T, T] float32
    else:
        scores = (q @ k.transpose(-1, -2)) * p.scaling  # [H, T, T]
    # 4. causal mask: future keys get the dtype's most negative value (HF's additive mask)
    if p.causal:
        visible = torch.ones(T, T, dtype=torch.bool, device=scores.device).tril()
        mask = torch.zeros(T, T, dtype=scores.dtype, device=scores.device)
        mask = mask.masked_fill(~visible, torch.finfo(scores.dtype).min)
        scores = scores + mask
    # 5. softmax over the keys -> attention weights, in v's dtype
    pattern = torch.softmax(scores, dim=-1).to(v.dtype)  # [H, T, T]
    # 6. weighted sum of the values, heads concatenated back: [H, T, dh] -> [T, H*dh]
    z = (pattern @ v).transpose(0, 1).reshape(T, H * dh)
    # 7. output projection
    out = z @ p.W_o + p.b_o  # [T, d_model]
    return pattern, out


def _max_abs(a: torch.Tensor, b: torch.Tensor, dims=None) -> torch.Tensor:
    """max |a - b| in float64; NaN (in either) propagates to the result."""
    d = (a.detach().to("cpu", torch.float64) - b.detach().to("cpu", torch.float64)).abs()
    if d.numel() == 0:
        return torch.zeros(() if dims is None else d.shape[0], dtype=torch.float64)
    if dims is None:
        return d.amax()
    return d.amax(dim=dims)


def _num(x: torch.Tensor | float) -> float | None:
    """float, or None for NaN (JSON-safe)."""
    f = float(x)
    return None if math.isnan(f) else f


def verify(
    attn_input: torch.Tensor,  # [layer, pos, d_model]
    pattern: torch.Tensor,  # [layer, head, query_pos, key_pos]
    attn_output: torch.Tensor,  # [layer, pos, d_model]
    params: dict[int, AttentionParams],  # layer -> that layer's current weights
    tolerance: float | None = None,
) -> dict:
    """Recompute each layer in ``params`` and compare with the recorded pattern and output.

    Args:
        attn_input, pattern, attn_output: a recorded forward (``ForwardResult.tensors``).
        params: the layers to check, in order, with the model's current weights.
        tolerance: largest absolute difference that passes; None = ``DEFAULT_TOLERANCE`` of
            the weights' dtype (1e-5 for float32).

    Returns:
        dict with ``passed`` (bool: every difference finite and <= tolerance), ``max_abs_diff``
        (float or None for NaN), ``tolerance``, ``dtype``, ``failed_layers`` (ascending),
        ``message`` (names the first failing layer and head), and ``layers``: per layer
        ``{layer, pattern_max_abs_diff, output_max_abs_diff, heads: [{head,
        pattern_max_abs_diff}], passed}``. Differences are absolute, in probability units
        (pattern) or model units (output); None stands for NaN, which always fails.
    """
    dtype = next(iter(params.values())).W_q.dtype if params else attn_input.dtype
    tol = float(tolerance if tolerance is not None else DEFAULT_TOLERANCE.get(dtype, 1e-5))
    layers_out = []
    overall: list[torch.Tensor] = []
    failed: list[int] = []
    first_failure = None
    with torch.inference_mode():
        for layer, p in params.items():
            rec_pattern, rec_out = recompute_layer(attn_input[layer], p)
            head_diff = _max_abs(rec_pattern, pattern[layer], dims=(-2, -1))  # [head]
            pat_diff = head_diff.amax() if head_diff.numel() else torch.tensor(0.0)
            out_diff = _max_abs(rec_out, attn_output[layer])
            both = torch.stack([pat_diff.to(torch.float64), out_diff])
            ok = bool(torch.isfinite(both).all() and (both <= tol).all())
            overall.append(both)
            if not ok:
                failed.append(layer)
                if first_failure is None:
                    bad_heads = [
                        h for h, d in enumerate(head_diff.tolist())
                        if math.isnan(d) or d > tol
                    ]
                    what = []
                    if bad_heads:
                        h = bad_heads[0]
                        what.append(f"pattern of head {h} differs by "
                                    f"{_fmt(head_diff[h])} (heads failing: {bad_heads})")
                    if not (math.isfinite(float(out_diff)) and float(out_diff) <= tol):
                        what.append(f"output differs by {_fmt(out_diff)}")
                    first_failure = f"layer {layer}: " + "; ".join(what)
            layers_out.append({
                "layer": layer,
                "pattern_max_abs_diff": _num(pat_diff),
                "output_max_abs_diff": _num(out_diff),
                "heads": [{"head": h, "pattern_max_abs_diff": _num(d)}
                          for h, d in enumerate(head_diff)],
                "passed": ok,
            })
    if overall:
        allv = torch.cat(overall)
        max_diff = float("nan") if torch.isnan(allv).any() else float(allv.max())
    else:
        max_diff = 0.0
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
        "failed_layers": sorted(failed),
        "message": message,
        "layers": layers_out,
    }


def _fmt(x) -> str:
    f = float(x)
    return "NaN" if math.isnan(f) else f"{f:.3g}"
