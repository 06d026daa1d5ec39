"""Verification, mode ``from_scratch`` (the default): the whole forward recomputed in float64.

docs/architecture.md ("Verification"), S000 (000_1c89b6c8c2a32040.txt: the scaled dot-product
``attention(Q, K, V, mask)`` and the causal mask), S001 (001_92e9928af52718c3.txt: heads):
the forward is recomputed from the token ids, the model's OWN weight tensors and its config
values -- our own implementation of every block, never the library's modules, in float64 --
and compared, layer by layer, with what the service SERVED for that text (the recorded
forward): the attention pattern of every head, the q/k/v, the attention output and the
residual-stream hidden states. Because nothing recorded is used as an input, the check can
disagree: a wrong weight, position, scale, mask, LayerNorm, activation or residual anywhere
shows up as a difference at the first layer where it acts (named in the result).

Families (the adapter hands over ``ScratchModel``: weights by their Hugging Face base-model
state-dict names, and the config as plain values; this module imports no runtime code):

GPT-2 (``GPT2Model``; per layer l, residual stream ``h``, ``[pos, d_model]``)::

    h_0 = wte[ids] + wpe[positions]                                  # embeddings
    x   = LN(h_l; ln_1, eps=layer_norm_epsilon)                      # LN: (x-mu)/sqrt(var+eps)*g+b
    q|k|v = x @ c_attn.W + c_attn.b      # Conv1D: W stored [d_in, d_out] (transposed vs Linear)
    scores = (q_h @ k_h^T) * s_l         # s_l = (1/sqrt(d_head) if scale_attn_weights else 1)
                                         #       / (l+1 if scale_attn_by_inverse_layer_idx)
    pattern = softmax(scores + causal mask(-inf on key > query))      # [head, query, key]
    a   = concat_h(pattern_h @ v_h) @ c_proj.W + c_proj.b            # attention output
    r   = h_l + a
    h_{l+1} = r + mlp.c_proj(act(mlp.c_fc(LN(r; ln_2))))             # act = activation_function
    final = LN(h_L; ln_f)                                            # HF's last hidden_states

``reorder_and_upcast_attn`` only changes the precision Hugging Face computes the scores in
(float32 under a float16 model); in float64 the formula is the same, and the result says so.

BERT (``BertModel``; ``nn.Linear`` weights stored ``[d_out, d_in]``: ``y = x @ W^T + b``)::

    h_0 = LN(word[ids] + position[positions] + token_type[0]; embeddings.LayerNorm)
    q|k|v = h_l @ W^T + b (query/key/value),  scores = q_h @ k_h^T / sqrt(d_head)
    pattern = softmax(scores)           # bidirectional: every key visible (no padding here)
    a  = LN(concat_h(pattern_h @ v_h) @ dense^T + b + h_l; attention.output.LayerNorm)
    h_{l+1} = LN(output.dense(act(intermediate.dense(a))) + a; output.LayerNorm)  # act = hidden_act
    final = h_L                                                       # no final LayerNorm

A config switch this recomputation does not implement (an activation without a formula here,
``add_cross_attention``, ``position_embedding_type`` other than ``absolute``, a decoder BERT)
raises :class:`UnsupportedModelConfig` naming the key (HTTP 422): never a pass.

Comparison and tolerances. Differences are ``max |served - recomputed|``, computed in float64:
the pattern per layer and head (probability units, absolute); q, k, v, the attention output
and each hidden state per layer (model units), which pass when ``diff <= tol * max(1, scale)``
with ``scale = max |recomputed|`` of that tensor (their magnitude grows with depth, so an
absolute bound would be meaningless across models); for a causal LM the served logits (the
hooked forward's, ``service/runtime/hooked.py``: the path every intervention endpoint and
``/v1/run`` compute with) against ``W_U`` applied to the recomputed ln_f output, relative to
``max(1, max |logit|)``. :data:`TOLERANCES` per served dtype:

========  ==================  ============================  ===============================
dtype     pattern (absolute)  states (relative to scale)    logits (relative to max |logit|)
========  ==================  ============================  ===============================
float32   1e-4                1e-4                          1e-4
float16   2.5e-2              1e-2                          1e-2
bfloat16  1.2e-1              5e-2                          5e-2
float64   1e-9                1e-9                          1e-9
========  ==================  ============================  ===============================

From measured drift (``bench/precision_faults.py``, README "Numerical precision"; the seed
sentences cut to T = 248 on the bundled GPT-2 and a random GPT-2-small, T = 506 on MiniLM): the
largest honest difference of the three models / the smallest 1.10x attention-scale fault
(planted in the recorded forward's attention; for the logits, in the hooked forward's):

* float32: pattern 4.1e-6 / 3.0e-2, states 1.4e-6 / 2.1e-2, logits 1.7e-6 / 1.6e-2;
* float16: pattern 1.1e-2 (MiniLM) / 3.0e-2, states 3.7e-3 / 2.1e-2, logits 4.7e-3 / 1.6e-2:
  the bounds sit 2.1-2.7x above the noise and 1.2-2.1x below the faults (each fault fails
  at least one check by 1.6x or more);
* bfloat16: pattern 8.0e-2 (MiniLM) / 3.0e-2, states 3.3e-2 / 2.2e-2, logits 3.2e-2 / 1.9e-2.
  The noise is the trained models', the smallest faults the random model's (diffuse attention
  barely moves under a 1.1x scale): no bound separates them for every model. The bounds sit
  1.5x above the noise and catch the trained models' 1.10x faults (bundled: states 7.6e-2,
  logits 8.6e-2; on the test sentence states 6.4e-2; MiniLM: pattern 0.23, states 0.29), not
  the random model's: verify in float32 what must be exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Protocol, Sequence

import torch

from ..errors import UnsupportedModelConfig

#: Per served dtype: (pattern tolerance, absolute; state tolerance, relative to max(1, scale);
#: logits tolerance, relative to max(1, max |logit|)).
TOLERANCES: dict[str, tuple[float, float, float]] = {
    "float32": (1e-4, 1e-4, 1e-4),
    "float16": (2.5e-2, 1e-2, 1e-2),
    "bfloat16": (1.2e-1, 5e-2, 5e-2),
    "float64": (1e-9, 1e-9, 1e-9),
}

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_erf(x):  # "gelu": the exact GELU, x * Phi(x)
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _gelu_tanh(x):  # "gelu_new" (GPT-2), "gelu_pytorch_tanh", "gelu_fast": the tanh approximation
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x.pow(3))))


#: Activations with a formula here (Hugging Face ACT2FN names -> float64 function).
ACTIVATIONS = {
    "gelu": _gelu_erf,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": torch.relu,
    "silu": lambda x: x * torch.sigmoid(x),
    "swish": lambda x: x * torch.sigmoid(x),
    "tanh": torch.tanh,
}


@dataclass(frozen=True)
class ScratchModel:
    """What the recomputation reads: plain data, extracted by the runtime's adapter.

    ``family``: ``"gpt2"`` or ``"bert"``. ``config``: the model config as plain values
    (``PretrainedConfig.to_dict()``). ``weights``: the base model's parameters by their
    Hugging Face state-dict names without the head prefix (``"wte.weight"``,
    ``"h.0.attn.c_attn.weight"``, ``"encoder.layer.0.attention.self.query.weight"``, ...), any
    dtype and device; read, never written (each is cast to float64 when used).
    """

    family: str
    config: Mapping[str, object]
    weights: Mapping[str, torch.Tensor]
    n_layers: int
    n_heads: int

    @classmethod
    def of(cls, adapter) -> "ScratchModel":
        """From a runtime adapter's ``scratch_weights()`` (plain values; duck-typed, so the
        analysis imports nothing of the runtime)."""
        return cls(**adapter.scratch_weights())


class ServedForward(Protocol):
    """What :func:`verify_from_scratch` compares with (``ForwardResult.tensors``)."""

    pattern: torch.Tensor  # [layer, head, query_pos, key_pos]
    hidden_states: torch.Tensor  # [layer+1, pos, d_model]: embeddings, each block's output
    q: torch.Tensor  # [layer, head, pos, d_head]
    k: torch.Tensor
    v: torch.Tensor
    attn_output: torch.Tensor  # [layer, pos, d_model]
    final_state: torch.Tensor | None  # [pos, d_model] after ln_f (None: no final LayerNorm)


# ------------------------------------------------------------------ support check
def check_supported(m: ScratchModel) -> None:
    """Raise :class:`UnsupportedModelConfig` (422) naming the first config switch the
    recomputation does not implement; return None when every switch is implemented."""
    c = m.config

    def refuse(key, value, what):
        raise UnsupportedModelConfig(
            f"the from-scratch verification does not implement config.{key} = {value!r} "
            f"({what}); mode 'recorded_qkv' still checks the attention step", "mode")

    if m.family == "gpt2":
        act = c.get("activation_function", "gelu_new")
        if act not in ACTIVATIONS:
            refuse("activation_function", act, f"implemented: {sorted(ACTIVATIONS)}")
        if c.get("add_cross_attention"):
            refuse("add_cross_attention", True, "cross-attention blocks")
    elif m.family == "bert":
        act = c.get("hidden_act", "gelu")
        if not isinstance(act, str) or act not in ACTIVATIONS:
            refuse("hidden_act", act, f"implemented: {sorted(ACTIVATIONS)}")
        pet = c.get("position_embedding_type", "absolute") or "absolute"
        if pet != "absolute":
            refuse("position_embedding_type", pet, "only absolute position embeddings")
        if c.get("is_decoder"):
            refuse("is_decoder", True, "a causal BERT decoder")
        if c.get("add_cross_attention"):
            refuse("add_cross_attention", True, "cross-attention blocks")
    else:
        refuse("model_type", m.family, "implemented: gpt2, bert")


def layer_scale(m: ScratchModel, layer: int) -> float:
    """The q.k multiplier of ``layer`` the config implies (GPT-2: 1/sqrt(d_head) when
    ``scale_attn_weights``, else 1, divided by layer+1 when ``scale_attn_by_inverse_layer_idx``;
    BERT: 1/sqrt(d_head))."""
    d_model = int(m.config.get("n_embd") or m.config.get("hidden_size"))
    d_head = d_model // m.n_heads
    if m.family == "bert":
        return d_head ** -0.5
    s = d_head ** -0.5 if m.config.get("scale_attn_weights", True) else 1.0
    if m.config.get("scale_attn_by_inverse_layer_idx", False):
        s /= float(layer + 1)
    return s


# ------------------------------------------------------------------ the recomputation
@dataclass
class LayerState:
    """One layer of the float64 recomputation (all float64, on the compute device)."""

    layer: int
    scale: float
    q: torch.Tensor  # [head, pos, d_head]
    k: torch.Tensor
    v: torch.Tensor
    pattern: torch.Tensor  # [head, query_pos, key_pos]
    attn_output: torch.Tensor  # [pos, d_model], after the output projection, pre-residual
    output: torch.Tensor  # [pos, d_model], the block's output (hidden state layer+1)


@dataclass
class Recomputation:
    """Output of :func:`recompute`: the embeddings, then one :class:`LayerState` per layer
    (lazily, one layer in memory at a time), then ``final`` (read after the layers)."""

    embeddings: torch.Tensor  # [pos, d_model] float64, hidden state 0
    layers: Iterator[LayerState]
    mask: str  # "causal" or "bidirectional"
    final: list = field(default_factory=list)  # [final_state [pos, d_model]] once layers are done


def compute_device(weights: Mapping[str, torch.Tensor]) -> torch.device:
    """The weights' device, or the CPU where it has no float64 (MPS)."""
    dev = next(iter(weights.values())).device
    return torch.device("cpu") if dev.type == "mps" else dev


def _layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)  # biased variance, as torch's LayerNorm
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _attend(q, k, v, scale, causal):
    """q, k, v ``[head, pos, d_head]`` -> (pattern ``[head, q, k]``, z ``[pos, head*d_head]``)."""
    H, T, dh = q.shape
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # 1. compare queries and keys
    if causal:  # 2. a query never sees a later key
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    pattern = torch.softmax(scores, dim=-1)  # 3. post-softmax pattern, rows sum to 1
    z = torch.matmul(pattern, v).transpose(0, 1).reshape(T, H * dh)  # 4. heads concatenated
    return pattern, z


def recompute(
    m: ScratchModel,
    input_ids: Sequence[int],
    position_ids: Sequence[int] | None = None,
    *,
    scales: Sequence[float] | None = None,
) -> Recomputation:
    """The forward of ``input_ids`` from scratch in float64 (formulas: module docstring).

    Args:
        m: weights and config (see :class:`ScratchModel`); :func:`check_supported` first.
        input_ids: the T token ids as served (framing included).
        position_ids: default ``0..T-1`` (the served forward's, unpadded).
        scales: override the per-layer q.k multiplier (tests: a recomputation that ignores a
            config switch); default :func:`layer_scale`.

    Returns a :class:`Recomputation` whose ``layers`` iterator computes one layer per step.
    """
    check_supported(m)
    W = m.weights
    dev = compute_device(W)
    f64 = torch.float64

    def w(name):
        return W[name].detach().to(dev, f64)

    ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=dev)
    T = len(ids)
    pos = (torch.arange(T, device=dev) if position_ids is None
           else torch.as_tensor(list(position_ids), dtype=torch.long, device=dev))
    c = m.config
    H = m.n_heads
    scales = [layer_scale(m, i) for i in range(m.n_layers)] if scales is None else list(scales)
    out = Recomputation(embeddings=None, layers=iter(()), mask="")  # filled below

    if m.family == "gpt2":
        eps = float(c.get("layer_norm_epsilon", 1e-5))
        act = ACTIVATIONS[c.get("activation_function", "gelu_new")]
        # gather the rows first: the [vocab, d_model] matrix is never cast whole
        h = W["wte.weight"].detach()[ids.to(W["wte.weight"].device)].to(dev, f64)
        h = h + W["wpe.weight"].detach()[pos.to(W["wpe.weight"].device)].to(dev, f64)
        out.embeddings, out.mask = h, "causal"

        def layers():
            x_res = h
            for i in range(m.n_layers):
                p = f"h.{i}."
                x = _layer_norm(x_res, w(p + "ln_1.weight"), w(p + "ln_1.bias"), eps)
                qkv = x @ w(p + "attn.c_attn.weight") + w(p + "attn.c_attn.bias")  # Conv1D
                D = x.shape[-1]
                q, k, v = (t.reshape(T, H, D // H).transpose(0, 1) for t in qkv.split(D, dim=-1))
                pattern, z = _attend(q, k, v, scales[i], causal=True)
                a = z @ w(p + "attn.c_proj.weight") + w(p + "attn.c_proj.bias")
                r = x_res + a
                y = _layer_norm(r, w(p + "ln_2.weight"), w(p + "ln_2.bias"), eps)
                y = act(y @ w(p + "mlp.c_fc.weight") + w(p + "mlp.c_fc.bias"))
                x_res = r + (y @ w(p + "mlp.c_proj.weight") + w(p + "mlp.c_proj.bias"))
                yield LayerState(i, scales[i], q, k, v, pattern, a, x_res)
            out.final.append(_layer_norm(x_res, w("ln_f.weight"), w("ln_f.bias"), eps))

    else:  # bert
        eps = float(c.get("layer_norm_eps", 1e-12))
        act = ACTIVATIONS[c.get("hidden_act", "gelu")]
        pre = "embeddings."
        e = W[pre + "word_embeddings.weight"].detach()
        h = e[ids.to(e.device)].to(dev, f64)
        pe = W[pre + "position_embeddings.weight"].detach()
        h = h + pe[pos.to(pe.device)].to(dev, f64)
        h = h + W[pre + "token_type_embeddings.weight"].detach()[0].to(dev, f64)  # type 0
        h = _layer_norm(h, w(pre + "LayerNorm.weight"), w(pre + "LayerNorm.bias"), eps)
        out.embeddings, out.mask = h, "bidirectional"

        def lin(x, name):  # nn.Linear: y = x @ W^T + b
            return x @ w(name + ".weight").t() + w(name + ".bias")

        def layers():
            x_res = h
            for i in range(m.n_layers):
                p = f"encoder.layer.{i}."
                D = x_res.shape[-1]
                q, k, v = (lin(x_res, p + "attention.self." + n).reshape(T, H, D // H).transpose(0, 1)
                           for n in ("query", "key", "value"))
                pattern, z = _attend(q, k, v, scales[i], causal=False)
                a_proj = lin(z, p + "attention.output.dense")
                a = _layer_norm(a_proj + x_res, w(p + "attention.output.LayerNorm.weight"),
                                w(p + "attention.output.LayerNorm.bias"), eps)
                y = act(lin(a, p + "intermediate.dense"))
                x_res = _layer_norm(lin(y, p + "output.dense") + a, w(p + "output.LayerNorm.weight"),
                                    w(p + "output.LayerNorm.bias"), eps)
                yield LayerState(i, scales[i], q, k, v, pattern, a_proj, x_res)
            out.final.append(x_res)

    out.layers = layers()
    return out


# ------------------------------------------------------------------ the comparison
def _maxdiff(served: torch.Tensor, ref: torch.Tensor, dims=None) -> torch.Tensor:
    """max |served - ref| in float64 (NaN if either holds a NaN), over all or over ``dims``."""
    d = (served.to(ref.device, torch.float64) - ref).abs()
    if dims is None:
        return d.max() if d.numel() else torch.zeros((), dtype=torch.float64, device=ref.device)
    return d.amax(dim=dims)


def _scale(ref: torch.Tensor) -> torch.Tensor:
    return ref.abs().max() if ref.numel() else torch.zeros((), dtype=ref.dtype, device=ref.device)


def _num(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def _fmt(x: float | None) -> str:
    return "NaN" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"


def _ok(d: float, limit: float) -> bool:
    return math.isfinite(d) and d <= limit


def verify_from_scratch(
    served: ServedForward,
    m: ScratchModel,
    input_ids: Sequence[int],
    dtype: str,
    layers: Sequence[int] | None = None,
    tolerance: float | None = None,
    *,
    position_ids: Sequence[int] | None = None,
    scales: Sequence[float] | None = None,
    logits: torch.Tensor | None = None,
) -> dict:
    """Compare a served forward with the float64 recomputation, layer by layer, then the
    served logits with the LM head applied to the recomputed final state.

    Args:
        served: the recorded forward of ``input_ids`` (``ForwardResult.tensors``).
        m: the model's weights and config (:class:`ScratchModel`).
        input_ids: the T token ids the served forward ran on.
        dtype: the served (model) dtype name, picks :data:`TOLERANCES`.
        layers: layers to report (default all); every layer is recomputed regardless (each
            needs the one before), the embeddings and the final state are always checked.
        tolerance: overrides BOTH tolerances of the dtype (pattern absolute, states relative).
        position_ids, scales: see :func:`recompute` (tests plant faults with them).
        logits: the served next-token logits ``[pos, vocab]`` of ``input_ids`` (the hooked
            forward's, what /v1/predictions, /v1/ablate, /v1/patch and /v1/run read), compared
            with ``final @ W_U^T`` in float64 (``W_U`` = the weights' ``lm_head.weight``
            ``[vocab, d_model]``), relative to ``max(1, max |recomputed logit|)`` against the
            dtype's logits tolerance; None (or no ``lm_head.weight``): not checked.

    Returns a dict (schemas/verify.py ``VerifyResult``): ``mode`` "from_scratch", ``passed``,
    ``max_abs_diff`` (largest pattern difference, probability units; None = NaN),
    ``max_rel_diff`` (largest state difference / max(1, scale)), ``tolerance`` (pattern),
    ``state_tolerance`` (relative), ``dtype``, ``compute_dtype`` "float64", ``mask``,
    ``failed_layers``, ``failing_layer`` (first, or None; -1 never: the embeddings fail as
    ``"embeddings"`` in the message and layer 0), ``message``, ``embeddings`` and ``final``
    state diffs, and per layer ``{layer, scale, pattern_max_abs_diff, heads: [{head,
    pattern_max_abs_diff}], q/k/v/output/hidden _max_abs_diff, hidden_scale, passed}``.
    Differences are the true maxima (0 only where they are exactly 0).

    Raises:
        UnsupportedModelConfig: a config switch the recomputation does not implement.
    """
    tol_p, tol_s, tol_l = TOLERANCES.get(dtype, TOLERANCES["float32"])
    if tolerance is not None:
        tol_p = tol_s = tol_l = float(tolerance)
    want = set(range(m.n_layers) if layers is None else layers)
    T = len(input_ids)
    with torch.inference_mode():
        rc = recompute(m, input_ids, position_ids, scales=scales)
        checks: list[tuple[int, str, torch.Tensor, torch.Tensor | None]] = []  # layer, what, diff, scale
        checks.append((-1, "embeddings", _maxdiff(served.hidden_states[0], rc.embeddings),
                       _scale(rc.embeddings)))
        per_layer: list[tuple[LayerState, torch.Tensor]] = []
        for st in rc.layers:
            i = st.layer
            if i in want:
                head_d = _maxdiff(served.pattern[i], st.pattern, dims=(-2, -1))  # [head]
                per_layer.append((st.layer, st.scale, head_d))
                for name, ref in (("q", st.q), ("k", st.k), ("v", st.v),
                                  ("attention output", st.attn_output)):
                    checks.append((i, name, _maxdiff(getattr(served, _FIELD[name])[i], ref),
                                   _scale(ref)))
            # every block output is checked (a fault upstream of a reported layer is named)
            checks.append((i, "hidden state", _maxdiff(served.hidden_states[i + 1], st.output),
                           _scale(st.output)))
        final = rc.final[0]
        fs = served.final_state if getattr(served, "final_state", None) is not None else None
        if fs is not None:
            checks.append((m.n_layers, "final state", _maxdiff(fs, final), _scale(final)))
        unembed = m.weights.get("lm_head.weight")
        if logits is not None and unembed is not None:
            checks.append((m.n_layers + 1, "logits", *_logits_diff(logits, final, unembed)))
        # one transfer of every number (no device sync per layer)
        flat = torch.cat([torch.cat([d.reshape(-1), s.reshape(-1)]) for _, _, d, s in checks]
                         + [hd.reshape(-1) for _, _, hd in per_layer]).cpu().tolist()

    n = 2 * len(checks)
    state = {}  # (layer, what) -> (diff, scale)
    for j, (layer, what, _, _) in enumerate(checks):
        state[(layer, what)] = (flat[2 * j], flat[2 * j + 1])
    heads_of = {}
    for layer, scale, hd in per_layer:
        heads_of[layer] = flat[n: n + hd.numel()]
        n += hd.numel()

    def rel(d, s):
        return d / max(1.0, s)

    failures: list[tuple[int, str]] = []  # (layer, description), in forward order
    d_emb, s_emb = state[(-1, "embeddings")]
    emb_ok = _ok(rel(d_emb, s_emb), tol_s)
    if not emb_ok:
        failures.append((0, f"embeddings (hidden state 0) differ by {_fmt(d_emb)} "
                            f"(scale {s_emb:.3g})"))
    layers_out = []
    all_pat, all_rel = [], [rel(d_emb, s_emb)]
    failed = set() if emb_ok else {0}
    for layer, scale, _ in per_layer:
        heads = heads_of[layer]
        all_pat.extend(heads)
        bad_heads = [h for h, d in enumerate(heads) if not _ok(d, tol_p)]
        what = []
        if bad_heads:
            h = bad_heads[0]
            what.append(f"pattern of head {h} differs by {_fmt(heads[h])} (heads failing: {bad_heads})")
        row = {"layer": layer, "scale": scale,
               "pattern_max_abs_diff": _num(max(heads) if not any(map(math.isnan, heads)) else math.nan),
               "heads": [{"head": h, "pattern_max_abs_diff": _num(d)} for h, d in enumerate(heads)]}
        for name in ("q", "k", "v", "attention output", "hidden state"):
            d, s = state[(layer, name)]
            all_rel.append(rel(d, s))
            if not _ok(rel(d, s), tol_s):
                what.append(f"{name} differs by {_fmt(d)} (scale {s:.3g})")
            row[_KEY[name]] = _num(d)
        row["hidden_scale"] = state[(layer, "hidden state")][1]
        row["passed"] = not what
        if what:
            failed.add(layer)
            failures.append((layer, "; ".join(what)))
        layers_out.append(row)
    # hidden states of layers not reported still count (a fault upstream of a reported layer)
    for layer in range(m.n_layers):
        if layer in want:
            continue
        d, s = state[(layer, "hidden state")]
        all_rel.append(rel(d, s))
        if not _ok(rel(d, s), tol_s):
            failed.add(layer)
            failures.append((layer, f"hidden state differs by {_fmt(d)} (scale {s:.3g})"))
    final_out = None
    if (m.n_layers, "final state") in state:
        d, s = state[(m.n_layers, "final state")]
        all_rel.append(rel(d, s))
        final_out = {"max_abs_diff": _num(d), "scale": s, "passed": _ok(rel(d, s), tol_s)}
        if not final_out["passed"]:
            failures.append((m.n_layers, f"final LayerNorm output differs by {_fmt(d)} (scale {s:.3g})"))
    logits_out = None
    if (m.n_layers + 1, "logits") in state:
        d, s = state[(m.n_layers + 1, "logits")]
        all_rel.append(rel(d, s))
        logits_out = {"max_abs_diff": _num(d), "scale": _num(s), "passed": _ok(rel(d, s), tol_l),
                      "tolerance": tol_l}
        if not logits_out["passed"]:
            failures.append((m.n_layers + 1, f"LM head logits differ by {_fmt(d)} (scale {s:.3g}, "
                                             f"tolerance {tol_l:g} relative)"))
    failures.sort(key=lambda f: f[0])
    if layers is not None:  # reported in the order requested
        order = {layer: i for i, layer in enumerate(layers)}
        layers_out.sort(key=lambda row: order[row["layer"]])
    passed = not failures
    max_p = math.nan if any(map(math.isnan, all_pat)) else (max(all_pat) if all_pat else 0.0)
    max_r = math.nan if any(map(math.isnan, all_rel)) else max(all_rel)
    if passed:
        message = (f"passed: embeddings, {len(layers_out)} layer(s)"
                   f"{', the final LayerNorm' if final_out else ''}"
                   f"{' and the LM head logits' if logits_out else ''} match the float64 "
                   f"recomputation (pattern max diff {_fmt(max_p)}, tolerance {tol_p:g}; states "
                   f"max relative diff {_fmt(max_r)}, tolerance {tol_s:g})")
    else:
        layer, what = failures[0]
        where = ("LM head" if layer == m.n_layers + 1 else
                 "final LayerNorm" if layer == m.n_layers else f"layer {layer}")
        message = (f"failed: first at {where}: {what}; pattern tolerance {tol_p:g}, state "
                   f"tolerance {tol_s:g} (relative to max(1, scale))")
    return {
        "mode": "from_scratch",
        "projections": False,
        "passed": passed,
        "max_abs_diff": _num(max_p),
        "max_rel_diff": _num(max_r),
        "tolerance": tol_p,
        "state_tolerance": tol_s,
        "dtype": dtype,
        "compute_dtype": "float64",
        "mask": rc.mask,
        "n_tokens": T,
        "failed_layers": sorted(x for x in failed if x < m.n_layers),
        "failing_layer": None if passed else (failures[0][0] if failures[0][0] < m.n_layers else None),
        "message": message,
        "embeddings": {"max_abs_diff": _num(d_emb), "scale": s_emb, "passed": emb_ok},
        "final": final_out,
        "logits": logits_out,
        "layers": layers_out,
    }


def _logits_diff(served: torch.Tensor, final: torch.Tensor, unembed: torch.Tensor,
                 chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max |served - final @ W_U^T|, max |final @ W_U^T|)`` in float64 (0-d tensors):
    ``served`` ``[pos, vocab]`` logits, ``final`` ``[pos, d_model]`` float64 (the recomputed
    ln_f output), ``unembed`` ``W_U`` ``[vocab, d_model]``, cast to float64 ``chunk`` vocabulary
    rows at a time (never the whole matrix: 309 MB for GPT-2's)."""
    nan = torch.tensor(math.nan, dtype=torch.float64, device=final.device)
    if tuple(served.shape) != (final.shape[0], unembed.shape[0]):  # never a pass
        return nan, nan
    diffs, scales = [], []
    for a in range(0, unembed.shape[0], chunk):
        ref = final @ unembed[a:a + chunk].detach().to(final.device, torch.float64).t()
        diffs.append(_maxdiff(served[:, a:a + chunk], ref))
        scales.append(_scale(ref))
    return torch.stack(diffs).max(), torch.stack(scales).max()


_FIELD = {"q": "q", "k": "k", "v": "v", "attention output": "attn_output"}
_KEY = {"q": "q_max_abs_diff", "k": "k_max_abs_diff", "v": "v_max_abs_diff",
        "attention output": "output_max_abs_diff", "hidden state": "hidden_max_abs_diff"}
