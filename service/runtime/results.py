"""What the runtime hands out: tokenized texts and recorded forwards (data classes, no model).

A forward result holds, for one tokenized text of T tokens (docs/architecture.md, "The runtime"):
attention patterns ``[layer, head, query_pos, key_pos]`` (post-softmax, exactly Hugging Face's
``output_attentions``), the L+1 residual-stream hidden states ``[layer+1, pos, d_model]``
(index 0 = embedding output, index i = block i-1's output; the last is the last block's output
BEFORE any final LayerNorm), the post-final-LayerNorm state ``final_state [pos, d_model]``
(GPT-2's ``ln_f`` output = Hugging Face's last ``hidden_states`` entry; None for BERT, which has
no final LayerNorm: there Hugging Face's last entry is ``hidden_states[-1]``),
q, k, v ``[layer, head, pos, d_head]``, the attention input ``[layer, pos, d_model]`` (what the
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
    gives each as one buffer; q, k, v are head-split views of the q/k/v modules' stacked
    outputs (see ``service/runtime/model.py``, ``Runtime._forward_batch``)."""

    pattern: torch.Tensor  # [layer, head, query_pos, key_pos]
    hidden_states: torch.Tensor  # [layer+1, pos, d_model]: embeddings, each block's output (pre-ln_f)
    q: torch.Tensor  # [layer, head, pos, d_head]
    k: torch.Tensor  # [layer, head, pos, d_head]
    v: torch.Tensor  # [layer, head, pos, d_head]
    attn_input: torch.Tensor  # [layer, pos, d_model]
    attn_output: torch.Tensor  # [layer, pos, d_model], after the output projection
    #: [pos, d_model]: the final LayerNorm's output (GPT-2 ln_f; = HF's last hidden_states
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

    @property
    def pattern(self) -> torch.Tensor:
        return self.tensors.pattern

    @property
    def hidden_states(self) -> torch.Tensor:
        return self.tensors.hidden_states

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def mask(self) -> torch.Tensor:
        """Boolean ``[query_pos, key_pos]``: True where a key is visible to a query."""
        T = self.n_tokens
        if self.causal:
            return torch.ones(T, T, dtype=torch.bool).tril()
        return torch.ones(T, T, dtype=torch.bool)

    def scores(self, layers: list[int] | None = None) -> torch.Tensor:
        """Pre-softmax attention scores ``[layer, head, query_pos, key_pos]``.

        ``scores = (q @ k^T) * scaling`` with the model's own scaling per layer (GPT-2:
        1/sqrt(d_head), and 1/(layer+1) under ``scale_attn_by_inverse_layer_idx``), the same
        operation as Hugging Face's eager attention. Masked entries (future keys in causal
        models) are ``-inf``: softmax over a row gives the pattern.
        """
        layers = list(range(self.tensors.q.shape[0])) if layers is None else layers
        out = []
        for layer in layers:
            s = torch.matmul(self.tensors.q[layer], self.tensors.k[layer].transpose(-1, -2))
            out.append(s * self.scaling[layer])
        scores = torch.stack(out)
        if self.causal:
            scores = scores.masked_fill(~self.mask(), float("-inf"))
        return scores


def recorded_bytes(n_layers: int, n_heads: int, d_model: int, n_tokens: int, element_size: int) -> int:
    """Bytes of one text's recorded forward (ForwardTensors) of ``n_tokens`` tokens."""
    L, H, D, T = n_layers, n_heads, d_model, n_tokens
    # pattern, L+1 hidden states, the final LayerNorm's output, q/k/v/attn input/attn output
    return element_size * (L * H * T * T + (L + 2) * T * D + 5 * L * T * D)

