"""Intervention forwards of the resident causal LM: head ablation and activation patching.

The runtime owns torch and the model; this module runs the model's own blocks (GPT-2 family:
``transformer.h[i]``, then ``ln_f`` and the LM head) on a batch of residual streams, starting at
any layer, with chosen heads' outputs edited. Analyses and serving never touch modules.

Vocabulary (TransformerLens): a head's output **z** is its attention-weighted value vectors
before the output projection, ``z[pos, head, :] = sum_k pattern[head, pos, k] * v[head, k, :]``
(TransformerLens ``hook_z``, shape ``[batch, pos, head, d_head]``). In Hugging Face's GPT-2 it is
the input of ``attn.c_proj`` with the heads merged (``[batch, pos, head * d_head]``), which is
where the edit is applied. The **residual stream** entering layer ``l`` (TransformerLens
``resid_pre``) is the recorded ``hidden_states[l]`` for ``l < n_layers`` (index 0 is the
embedding output).

A run starts from a residual stream ``[batch, pos, d_model]`` at layer ``start`` (the cached
``hidden_states[start]`` of the text, so the layers below are the text's own and are not run
again) and applies, at each layer, ``z = where(mask, value, z)`` for the edits of that layer.
The edits are arguments of one call: the forward pre-hooks that apply them are registered for
that call only and removed before it returns (one call at a time on the device thread), never
module state two requests could share. Logits come from the model's own ``ln_f`` and LM head
applied to the final residual stream this module computes, so they do not depend on how the
recorded forward lays out its last hidden state.

Causal LMs only (GPT-2 family): an encoder has no LM head to read a metric from.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from ..errors import InvalidRequest


class NoLanguageModelHead(InvalidRequest):
    """The loaded model has no language-model head (an encoder): predictions, ablation and
    patching read next-token logits and cannot run (422, type ``unsupported_model``)."""

    type = "unsupported_model"


@dataclass
class ZEdit:
    """An edit of the head outputs z at one layer, for every row of a batch of variants.

    ``mask``: bool, broadcastable to ``[batch, pos, head]``: True where z is replaced.
    ``value``: broadcastable to ``[batch, pos, head, d_head]``: the replacement (0 for zero
    ablation, a mean, another run's z, the clean run's z). Rows whose mask is all False are
    left bit for bit as they were.
    """

    mask: torch.Tensor
    value: torch.Tensor


@dataclass
class RunOutput:
    """What one intervention run returns (tensors on the runtime's device or CPU, see caller).

    ``logits``: ``[batch, len(positions), vocab]`` (all positions when ``positions`` is None),
    or None when ``logits=False``. ``final``: the residual stream after the last block
    ``[batch, pos, d_model]`` (before ``ln_f``). ``z``: per layer from ``start`` (index
    ``layer - start``), the z the next projection received ``[batch, pos, head, d_head]`` when
    ``capture_z`` (after the edit). ``patterns``: per layer from ``start``,
    ``[batch, head, query_pos, key_pos]`` when ``capture_patterns``.
    """

    logits: torch.Tensor | None
    final: torch.Tensor
    start: int
    z: list[torch.Tensor] = field(default_factory=list)
    patterns: list[torch.Tensor] = field(default_factory=list)


def lm_parts(rt):
    """``(blocks, ln_f, lm_head)`` of a causal LM, or raise :class:`NoLanguageModelHead`."""
    if not rt.adapter.causal:
        raise NoLanguageModelHead(
            f"{rt.info.get('id')} is an encoder ({rt.adapter.family}) without a language-model "
            "head: predictions, ablation and patching need next-token logits (causal LMs such "
            "as GPT-2)", "text",
        )
    head = rt.model.get_output_embeddings() if hasattr(rt.model, "get_output_embeddings") else None
    base = rt.adapter.base()
    if head is None or not hasattr(base, "ln_f"):
        raise NoLanguageModelHead(
            f"{rt.info.get('id')} was loaded without a language-model head (no next-token "
            "logits): predictions, ablation and patching are unavailable", "text",
        )
    return base.h, base.ln_f, head


def causal_mask(n_tokens: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive causal mask ``[1, 1, query_pos, key_pos]``: 0 where ``key_pos <= query_pos``,
    the dtype's most negative finite value elsewhere (Hugging Face's eager mask)."""
    allowed = torch.ones(n_tokens, n_tokens, dtype=torch.bool, device=device).tril()
    mask = torch.zeros(n_tokens, n_tokens, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def logits_of(rt, final: torch.Tensor, positions: Sequence[int] | None = None) -> torch.Tensor:
    """Next-token logits ``[batch, P, vocab]`` from final residual streams ``[batch, pos,
    d_model]`` through the model's own ``ln_f`` and LM head, at ``positions`` (all if None)."""
    _, ln_f, head = lm_parts(rt)
    x = final if positions is None else final[:, list(positions)]
    return head(ln_f(x))


def head_z(pattern: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """z ``[layer, pos, head, d_head]`` from a recorded pattern ``[layer, head, query_pos,
    key_pos]`` and values ``[layer, head, pos, d_head]``: ``pattern @ v`` (the attention's own
    product; TransformerLens ``hook_z`` layout)."""
    return torch.matmul(pattern, v).transpose(1, 2)


@contextmanager
def _hooks(rt, start: int, z_edits: dict[int, ZEdit], capture_z: bool, capture_patterns: bool,
           out: RunOutput) -> Iterator[None]:
    """Register, for this call only, the pre-hooks on each layer's output projection that
    apply ``z_edits`` and capture z, and the hooks on attention that capture patterns."""
    a = rt.adapter
    H, dh = a.n_heads, a.d_head
    handles = []

    def z_hook(layer: int):
        edit = z_edits.get(layer)

        def fn(module, args):
            x = args[0]
            z = x.view(*x.shape[:-1], H, dh)  # [batch, pos, head, d_head]
            if edit is not None:
                z = torch.where(edit.mask[..., None], edit.value.to(z.dtype), z)
            if capture_z:
                out.z.append(z)
            return (z.reshape(x.shape),) + tuple(args[1:])
        return fn

    def pattern_hook(module, args, output):
        out.patterns.append(output[1])

    try:
        for layer in range(start, a.n_layers):
            h = rt._handles[layer]
            if layer in z_edits or capture_z:
                handles.append(h.out_proj.register_forward_pre_hook(z_hook(layer)))
            if capture_patterns:
                handles.append(h.attn.register_forward_hook(pattern_hook))
        yield
    finally:
        for hd in handles:
            hd.remove()


def run_from_layer(
    rt,
    resid: torch.Tensor,
    start: int,
    z_edits: dict[int, ZEdit] | None = None,
    positions: Sequence[int] | None = None,
    *,
    logits: bool = True,
    capture_z: bool = False,
    capture_patterns: bool = False,
) -> RunOutput:
    """Run blocks ``start .. n_layers-1`` of the model on residual streams ``resid``
    ``[batch, pos, d_model]`` (what enters layer ``start``), with the edits ``z_edits``
    (layer -> :class:`ZEdit`) applied to the head outputs z, then ``ln_f`` and the LM head.

    No padding: every row has ``pos`` real tokens (variants of one text, or texts of equal
    length). Runs under the caller's grad mode (``torch.inference_mode`` for exact patching,
    ``torch.enable_grad`` for attribution). ``positions`` restricts the logits (the big
    ``[batch, pos, vocab]`` tensor) to the positions a metric reads.

    Raises:
        NoLanguageModelHead: the model is an encoder or has no LM head.
        InvalidRequest: ``start`` outside ``[0, n_layers]``.
    """
    blocks, _, _ = lm_parts(rt)
    L = rt.adapter.n_layers
    if not 0 <= start <= L:
        raise InvalidRequest(f"start layer {start} outside 0..{L}", "layers")
    z_edits = z_edits or {}
    resid = resid.to(rt.device)
    out = RunOutput(None, resid, start)
    mask = causal_mask(resid.shape[1], resid.dtype, resid.device)
    x = resid
    with _hooks(rt, start, z_edits, capture_z, capture_patterns, out):
        for layer in range(start, L):
            x = blocks[layer](x, attention_mask=mask)
            if isinstance(x, tuple):  # older transformers return (hidden_states, ...)
                x = x[0]
    out.final = x
    if logits:
        out.logits = logits_of(rt, x, positions)
    return out


def clean_final(rt, hidden_states: torch.Tensor) -> torch.Tensor:
    """The final residual stream ``[pos, d_model]`` (before ``ln_f``) of a recorded forward,
    recomputed from its cached ``hidden_states[n_layers - 1]`` through the last block only."""
    L = rt.adapter.n_layers
    with torch.inference_mode():
        return run_from_layer(rt, hidden_states[L - 1][None], L - 1, logits=False).final[0]


def recorded_logits(rt, ft, positions: Sequence[int] | None = None) -> torch.Tensor:
    """Next-token logits ``[P, vocab]`` of a recorded forward ``ft`` (ForwardTensors) at
    ``positions`` (all if None): its last block re-run from the cached residual stream, then
    ``ln_f`` and the LM head. Equal to Hugging Face's ``GPT2LMHeadModel`` logits to float
    rounding."""
    final = clean_final(rt, ft.hidden_states)
    with torch.inference_mode():
        return logits_of(rt, final[None], positions)[0]


def embedding_output(rt, input_ids: Sequence[int]) -> torch.Tensor:
    """The residual stream entering layer 0 ``[pos, d_model]`` (GPT-2: token plus position
    embeddings, ``hidden_states[0]`` of a recorded forward) without running any block."""
    base = rt.adapter.base()
    ids = torch.tensor(list(input_ids), dtype=torch.long, device=rt.device)
    with torch.inference_mode():
        return base.wte(ids) + base.wpe(torch.arange(len(ids), device=rt.device))


def attribution_grads(
    rt, resid0: torch.Tensor, metric_fn, positions: Sequence[int] | None = None,
    with_z: bool = False,
):
    """One forward and one backward of a text from its embedding output ``resid0`` ``[pos,
    d_model]``: returns ``(metric, grads)``, the scalar ``metric_fn(logits)`` (logits ``[1, P,
    vocab]`` at ``positions``) and its gradient with respect to every layer's z, each
    ``[pos, head, d_head]`` (the total derivative: paths through all later layers included);
    with ``with_z`` also the z themselves ``[layer, pos, head, d_head]`` (so the corrupted run
    needs no recorded forward of its own).

    Used by attribution patching (Nanda 2023; Kramár et al. 2024, AtP): the gradient on the
    corrupted run times the clean-minus-corrupted z is the first-order estimate of each
    patch's effect.
    """
    with torch.inference_mode(False), torch.enable_grad():
        x = resid0.detach().clone()[None].requires_grad_(True)  # a graph from the embeddings up
        out = run_from_layer(rt, x, 0, positions=positions, capture_z=True)
        metric = metric_fn(out.logits)
        grads = torch.autograd.grad(metric, out.z)
    grads = [g[0].detach() for g in grads]
    if with_z:
        return metric.detach(), grads, torch.stack([z[0].detach() for z in out.z])
    return metric.detach(), grads


# ------------------------------------------------------------------ memory estimates
def variant_batch_bytes(rt, n_variants: int, n_tokens: int, n_positions: int,
                        grad: bool = False) -> int:
    """Estimated peak bytes of one intervention batch: ``n_variants`` rows of ``n_tokens``
    tokens through the blocks (one block's transients at a time: residual, ln, q/k/v, z and
    output ``~8*T*D``, the MLP ``~8*T*D``, scores + pattern ``2*H*T^2``, the z edit's mask and
    value), plus logits, log-probabilities and probabilities at ``n_positions`` positions
    (``3*P*vocab``), in the model's dtype (float32 for the metric math). ``grad``: every
    layer's activations kept for the backward (attribution patching)."""
    a = rt.adapter
    es = max(4, next(rt.model.parameters()).element_size())
    T, D, H = n_tokens, a.d_model, a.n_heads
    block = 16 * T * D + 3 * H * T * T
    vocab = int(rt.info.get("vocab_size") or rt.model.config.vocab_size)
    per_row = (block * (a.n_layers if grad else 1) + 3 * n_positions * vocab + 2 * T * D)
    return es * n_variants * per_row


# ------------------------------------------------------------------ grids and ablations
def _one_hot_heads(n_heads: int, n_tokens: int | None, device) -> torch.Tensor:
    """Masks of one variant per head ``[head, 1, head]`` (all positions), or per (head, pos)
    ``[head * pos, pos, head]`` (row ``h * T + p`` patches head h at position p only)."""
    eye = torch.eye(n_heads, dtype=torch.bool, device=device)
    if n_tokens is None:
        return eye[:, None, :]
    T = n_tokens
    m = torch.zeros(n_heads, T, T, n_heads, dtype=torch.bool, device=device)
    for h in range(n_heads):
        m[h, torch.arange(T), torch.arange(T), h] = True
    return m.reshape(n_heads * T, T, n_heads)


def head_patch_grid(rt, clean, corrupted, metric, positions: Sequence[int] | None,
                    per_position: bool = False, layers: Sequence[int] | None = None) -> torch.Tensor:
    """Activation patching of head outputs, clean -> corrupted (TransformerLens
    ``get_act_patch_attn_head_out_all_pos``, or ``..._by_pos`` with ``per_position``).

    ``clean``, ``corrupted``: recorded forwards (ForwardTensors) of two texts of equal length.
    For each layer l, one batch of variants starts from the corrupted run's cached residual
    stream entering l (layers below are the corrupted run's own) with one head's z (all
    positions, or one position) replaced by the clean run's; ``metric(logits [batch, P,
    vocab]) -> [batch]`` reads the logits at ``positions``. Returns the raw metric
    ``[layer, head]`` or ``[layer, head, pos]`` (float32, CPU; layers not in ``layers`` NaN).
    """
    a = rt.adapter
    L, H, T = a.n_layers, a.n_heads, clean.hidden_states.shape[1]
    z_clean = head_z(clean.pattern, clean.v).to(rt.device)  # [layer, pos, head, d_head]
    mask = _one_hot_heads(H, T if per_position else None, rt.device)
    out = torch.full((L, H * T) if per_position else (L, H), float("nan"))
    with torch.inference_mode():
        for layer in (range(L) if layers is None else layers):
            B = mask.shape[0]
            resid = corrupted.hidden_states[layer][None].expand(B, -1, -1)
            run = run_from_layer(rt, resid, layer, {layer: ZEdit(mask, z_clean[layer][None])},
                                 positions)
            out[layer] = metric(run.logits).float().cpu()
    return out.reshape(L, H, T) if per_position else out


def resid_patch_grid(rt, clean, corrupted, metric, positions: Sequence[int] | None) -> torch.Tensor:
    """Activation patching of the residual stream entering each layer at each position
    (TransformerLens ``get_act_patch_resid_pre``): for layer l, a batch of T variants of the
    corrupted run's cached ``hidden_states[l]``, row p with position p taken from the clean
    run, run from layer l. Returns the raw metric ``[layer, pos]`` (float32, CPU)."""
    L, T = rt.adapter.n_layers, clean.hidden_states.shape[1]
    out = torch.empty(L, T)
    idx = torch.arange(T)
    with torch.inference_mode():
        for layer in range(L):
            resid = corrupted.hidden_states[layer][None].repeat(T, 1, 1)
            resid[idx, idx] = clean.hidden_states[layer][idx]
            out[layer] = metric(run_from_layer(rt, resid, layer, None, positions).logits).float().cpu()
    return out


def mean_z(fts: Sequence) -> torch.Tensor:
    """Mean head output z ``[layer, head, d_head]`` over every position of the recorded
    forwards ``fts`` (one text, or a list of reference texts; all positions pooled)."""
    zs = [head_z(ft.pattern, ft.v) for ft in fts]  # each [layer, pos, head, d_head]
    return torch.cat(zs, dim=1).mean(dim=1)


def ablation_value(method: str, ft, references: Sequence = (), resample=None) -> torch.Tensor:
    """The replacement z of an ablation, broadcastable to ``[layer, pos, head, d_head]``:
    ``zero`` -> 0; ``mean`` -> the mean z over the text's own positions (or over the
    ``references``' positions) ``[layer, 1, head, d_head]``; ``resample`` -> the z of the
    other text ``resample`` (same length) ``[layer, pos, head, d_head]``."""
    if method == "zero":
        L, H, _, dh = ft.v.shape
        return torch.zeros(L, 1, H, dh, dtype=ft.v.dtype)
    if method == "mean":
        return mean_z(list(references) or [ft])[:, None]
    if method == "resample":
        return head_z(resample.pattern, resample.v)
    raise InvalidRequest(f"unknown ablation method {method!r}", "method")


def ablate(rt, ft, heads: Sequence[tuple[int, int]], value: torch.Tensor,
           positions: Sequence[int] | None = None, capture_patterns: bool = False) -> RunOutput:
    """One text's forward with the ``heads`` ``[(layer, head), ...]`` ablated: their z set to
    ``value`` (see :func:`ablation_value`) at every position, from the cached residual stream
    entering the lowest ablated layer. ``RunOutput.logits`` ``[1, P, vocab]``; with
    ``capture_patterns`` the patterns of the layers from ``RunOutput.start`` up."""
    H = rt.adapter.n_heads
    start = min(layer for layer, _ in heads)
    edits: dict[int, ZEdit] = {}
    for layer in sorted({layer for layer, _ in heads}):
        m = torch.zeros(1, 1, H, dtype=torch.bool, device=rt.device)
        for lyr, h in heads:
            if lyr == layer:
                m[0, 0, h] = True
        edits[layer] = ZEdit(m, value[layer][None].to(rt.device))
    with torch.inference_mode():
        return run_from_layer(rt, ft.hidden_states[start][None], start, edits, positions,
                              capture_patterns=capture_patterns)


def ablation_scan(rt, ft, value: torch.Tensor, metric, positions: Sequence[int] | None) -> torch.Tensor:
    """Every head ablated alone: for each layer a batch of ``n_heads`` variants from the cached
    residual stream entering it, variant h with head h's z set to ``value[layer]``. Returns
    ``metric(logits [batch, P, vocab]) -> [batch]`` as ``[layer, head]`` (float32, CPU)."""
    a = rt.adapter
    mask = _one_hot_heads(a.n_heads, None, rt.device)
    out = torch.empty(a.n_layers, a.n_heads)
    with torch.inference_mode():
        for layer in range(a.n_layers):
            resid = ft.hidden_states[layer][None].expand(a.n_heads, -1, -1)
            run = run_from_layer(rt, resid, layer,
                                 {layer: ZEdit(mask, value[layer][None].to(rt.device))}, positions)
            out[layer] = metric(run.logits).float().cpu()
    return out
