"""What the runtime hands out: tokenized texts and recorded forwards (data classes, no model).

A forward result holds, for one tokenized text of T tokens (docs/architecture.md, "The runtime"):
attention patterns ``[layer, head, query_pos, key_pos]`` (post-softmax, exactly Hugging Face's
``output_attentions``), the L+1 residual-stream hidden states ``[layer+1, pos, d_model]``
(index 0 = embedding output, index i = block i-1's output; the last is the last block's output
BEFORE any final LayerNorm), the post-final-LayerNorm state ``final_state [pos, d_model]``
(GPT-2's ``ln_f`` output, the rotary families' final RMSNorm / GPT-NeoX ``final_layer_norm``
output = Hugging Face's last ``hidden_states`` entry; None for BERT, which has
no final LayerNorm: there Hugging Face's last entry is ``hidden_states[-1]``),
q ``[layer, head, pos, d_head]`` and k, v ``[layer, kv_head, pos, d_head]`` (kv_head = head
except under grouped-query attention, where query head h reads key/value head
``h // (n_heads // n_kv_heads)``, Hugging Face's ``repeat_kv``; :meth:`ForwardTensors.k_heads`
gives them per query head; rotary families: q and k AFTER rotary, as the attention function
received them), the attention input ``[layer, pos, d_model]`` (what the
attention module received) and the attention output after the output projection
``[layer, pos, d_model]`` (before dropout and the residual add). Pre-softmax scores are
computed on demand from q and k with the model's own scaling (saving T^2 memory per layer).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class TokenInfo:
    """One token: its position, id, readable label, character span in the text (None for
    special tokens and for ids without a text), whether it is a special token, its raw bytes
    and whether those split a UTF-8 character (service/runtime/tokens.py)."""

    position: int
    id: int
    label: str
    start: int | None
    end: int | None
    special: bool
    raw: bytes = b""  # the token's bytes (byte-level BPE: what it stands for; else UTF-8)
    partial: bool = False  # raw is not a whole UTF-8 sequence

    def as_dict(self) -> dict:
        return {
            "position": self.position, "id": self.id, "label": self.label,
            "start": self.start, "end": self.end, "special": self.special,
            "bytes": self.raw.hex(), "partial": self.partial,
        }


@dataclass(frozen=True)
class TokenizedText:
    """One text as the model sees it (``input_ids``, the BOS/[CLS] framing included) and its
    tokens; the key of the forward cache is ``input_ids``."""

    text: str
    add_bos: bool
    input_ids: tuple[int, ...]
    tokens: tuple[TokenInfo, ...]

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(eq=False)
class ForwardTensors:
    """The tensors of one forward (cached, shared read-only between requests). The runtime
    gives each as one buffer; q, k, v are head-split views of the q/k/v projections'
    stacked outputs (GPT-2, BERT) or their own buffers (rotary families: after RoPE), see
    ``service/runtime/model.py``, ``Runtime._forward_batch``: causal LMs record through the
    hooked forward (``service/runtime/hooked.py`` ``record``), BERT through Hugging Face's
    modules."""

    pattern: torch.Tensor  # [layer, head, query_pos, key_pos]
    hidden_states: torch.Tensor  # [layer+1, pos, d_model]: embeddings, each block's output (pre-ln_f)
    q: torch.Tensor  # [layer, head, pos, d_head] (rotary families: after rotary)
    k: torch.Tensor  # [layer, kv_head, pos, d_head] (kv_head = head without GQA)
    v: torch.Tensor  # [layer, kv_head, pos, d_head]
    attn_input: torch.Tensor  # [layer, pos, d_model]
    attn_output: torch.Tensor  # [layer, pos, d_model], after the output projection
    #: [pos, d_model]: the final norm's output (GPT-2 ln_f, Llama-style ``norm``, GPT-NeoX
    #: ``final_layer_norm``; = HF's last hidden_states
    #: entry); None where the model has no final LayerNorm (BERT)
    final_state: torch.Tensor | None = None

    _NAMES: ClassVar[tuple[str, ...]] = ("hidden_states", "q", "k", "v", "attn_input",
                                         "attn_output")

    def __post_init__(self):
        self.nbytes = sum(getattr(self, n).numel() * getattr(self, n).element_size()
                          for n in ("pattern", *self._NAMES))
        if self.final_state is not None:
            self.nbytes += self.final_state.numel() * self.final_state.element_size()

    @property
    def kv_groups(self) -> int:
        """Query heads per key/value head (1 without grouped-query attention)."""
        return self.q.shape[1] // self.k.shape[1]

    def k_heads(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys per QUERY head ``[head, pos, d_head]``: key/value head
        ``h // kv_groups`` for query head h (``repeat_kv``); the recorded tensor itself
        without grouped-query attention."""
        k = self.k[layer]
        return k if self.kv_groups == 1 else k.repeat_interleave(self.kv_groups, dim=0)

    def v_heads(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s values per QUERY head ``[head, pos, d_head]`` (as :meth:`k_heads`)."""
        v = self.v[layer]
        return v if self.kv_groups == 1 else v.repeat_interleave(self.kv_groups, dim=0)

    @property
    def final_hidden_state(self) -> torch.Tensor:
        """``[pos, d_model]``: Hugging Face's last ``hidden_states`` entry (after GPT-2's
        ln_f; BERT's last block output)."""
        return self.final_state if self.final_state is not None else self.hidden_states[-1]

    def replace(self, **changes: torch.Tensor) -> "ForwardTensors":
        """A copy with some tensors replaced (by field name), e.g. an altered pattern."""
        return dataclasses.replace(self, **changes)


@dataclass
class ForwardResult:
    """One text's recorded forward: its tokens and its tensors (all on CPU, no autograd)."""

    tokens: TokenizedText
    tensors: ForwardTensors
    scaling: tuple[float, ...]  # per layer, the q.k multiplier the model used
    causal: bool
    cached: bool = False
    #: per layer, the sliding key window (a query sees keys ``query_pos - window < key_pos
    #: <= query_pos``), None = full attention; None altogether = no layer has one
    windows: tuple[int | None, ...] | None = None
    #: per layer, the attention logit soft-cap (Gemma 2), None = none
    softcaps: tuple[float | None, ...] | None = None

    @property
    def pattern(self) -> torch.Tensor:
        return self.tensors.pattern

    @property
    def hidden_states(self) -> torch.Tensor:
        return self.tensors.hidden_states

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding key window, or None (full attention)."""
        return None if self.windows is None else self.windows[layer]

    def mask(self, layer: int | None = None) -> torch.Tensor:
        """Boolean ``[query_pos, key_pos]``: True where a key is visible to a query (in
        ``layer``: its sliding window, if any, leaves ``query_pos - window < key_pos <=
        query_pos``, Hugging Face's ``sliding_window_overlay``)."""
        T = self.n_tokens
        if not self.causal:
            return torch.ones(T, T, dtype=torch.bool)
        m = torch.ones(T, T, dtype=torch.bool).tril()
        w = None if layer is None else self.window(layer)
        if w is not None:
            m = m.triu(-(w - 1))
        return m

    def scores(self, layers: list[int] | None = None) -> torch.Tensor:
        """Pre-softmax attention scores ``[layer, head, query_pos, key_pos]``.

        ``scores = (q @ k^T) * scaling`` with the model's own scaling per layer (GPT-2:
        1/sqrt(d_head), and 1/(layer+1) under ``scale_attn_by_inverse_layer_idx``; Gemma 2:
        ``query_pre_attn_scalar**-0.5``), the same operation as Hugging Face's eager attention;
        grouped-query attention: query head h against key/value head ``h // groups``; Gemma 2
        then soft-caps, ``c * tanh(scores / c)``. Rotary families: q and k after rotary, so the
        positions are in the scores. Masked entries (future keys in causal models, keys
        outside a layer's sliding window) are ``-inf``: softmax over a row gives the pattern.
        """
        layers = list(range(self.tensors.q.shape[0])) if layers is None else layers
        out = []
        for layer in layers:
            s = torch.matmul(self.tensors.q[layer], self.tensors.k_heads(layer).transpose(-1, -2))
            s = s * self.scaling[layer]
            cap = None if self.softcaps is None else self.softcaps[layer]
            if cap is not None:
                s = torch.tanh(s / cap) * cap
            if self.causal:
                s = s.masked_fill(~self.mask(layer), float("-inf"))
            out.append(s)
        return torch.stack(out)


def recorded_bytes(n_layers: int, n_heads: int, d_model: int, n_tokens: int, element_size: int,
                   qkv_width: int | None = None) -> int:
    """Bytes of one text's recorded forward (ForwardTensors) of ``n_tokens`` tokens;
    ``qkv_width``: q, k and v's widths together (``(n_heads + 2 * n_kv_heads) * d_head``;
    default ``3 * d_model``)."""
    L, H, D, T = n_layers, n_heads, d_model, n_tokens
    W = 3 * D if qkv_width is None else qkv_width
    # pattern, L+1 hidden states, the final LayerNorm's output, q/k/v, attn input/attn output
    return element_size * (L * H * T * T + (L + 2) * T * D + (W + 2 * D) * L * T)

