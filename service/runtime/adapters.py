"""Per-family architecture adapters: where attention lives in the module tree.

Everything else in the runtime is generic. An adapter knows, for its family:
the base model (no LM head), the per-layer attention module (whose input is the attention
input), how q/k/v are produced (GPT-2: one ``c_attn`` Conv1D with weight stored
``[d_model, 3*d_model]``; BERT: three ``nn.Linear``), the output projection, the scaling of
q.k, and whether attention is causal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn



@dataclass
class LayerHandles:
    attn: nn.Module  # receives the attention input as its first argument
    qkv: list[nn.Module]  # modules whose outputs are q, k, v (1 module: fused)
    out_proj: nn.Module  # output projection (its output = attention output, pre-residual)
    scaling: float  # q.k multiplier (1/sqrt(d_head), times 1/(layer+1) where configured)


class Adapter:
    family: str = ""
    causal: bool = False

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config

    def base(self) -> nn.Module:
        raise NotImplementedError

    def layers(self) -> list[LayerHandles]:
        raise NotImplementedError

    @property
    def n_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def n_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def d_model(self) -> int:
        return self.config.hidden_size

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def n_ctx(self) -> int:
        return int(self.config.max_position_embeddings)

    def split_qkv(self, outs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Module outputs ``[batch, pos, ...]`` -> q, k, v each ``[batch, head, pos, d_head]``."""
        raise NotImplementedError

    def embed_matrix(self) -> torch.Tensor:
        """Static token embedding matrix ``[vocab, d_model]``."""
        return self.model.get_input_embeddings().weight

    def attention_weights(self, layer: int) -> dict:
        """Layer ``layer``'s q/k/v/output weights in one layout, as plain values: the fields of
        ``analysis.verify_recorded.AttentionParams`` (built from this by ``AttentionParams.of``;
        the runtime imports no analysis types)."""
        raise NotImplementedError

    def final_norm(self) -> nn.Module | None:
        """The final LayerNorm after the last block (GPT-2 ``ln_f``), or None (BERT has none).
        Its input is the last residual-stream state; Hugging Face's last ``hidden_states``
        entry is its output."""
        return None

    def scratch_weights(self) -> dict:
        """The base model's weights (detached views of the CURRENT parameters, by their
        state-dict names; a causal LM's unembedding as ``lm_head.weight``) and config values, for the from-scratch verification: the fields of
        ``analysis.verify.ScratchModel`` (built from this by ``ScratchModel.of``)."""
        weights = {n: p.detach() for n, p in self.base().named_parameters()}
        head = self.model.get_output_embeddings() if self.causal and hasattr(
            self.model, "get_output_embeddings") else None
        if head is not None:  # the LM head's W_U [vocab, d_model] (GPT-2: tied to wte)
            weights["lm_head.weight"] = head.weight.detach()
        return dict(family=self.family, config=self.config.to_dict(), weights=weights,
                    n_layers=self.n_layers, n_heads=self.n_heads)


class GPT2Adapter(Adapter):
    """GPT-2 family (GPT2LMHeadModel / GPT2Model): causal, fused Conv1D ``c_attn``."""

    family = "gpt2"
    causal = True

    def base(self) -> nn.Module:
        return getattr(self.model, "transformer", self.model)

    def layers(self) -> list[LayerHandles]:
        out = []
        for i, block in enumerate(self.base().h):
            attn = block.attn
            scaling = getattr(attn, "scaling", None)
            if scaling is None:  # older transformers: derive from the config switches
                scaling = 1.0
                if self.config.scale_attn_weights:
                    scaling = self.d_head ** -0.5
                if self.config.scale_attn_by_inverse_layer_idx:
                    scaling /= float(i + 1)
            out.append(LayerHandles(attn, [attn.c_attn], attn.c_proj, float(scaling)))
        return out

    def final_norm(self) -> nn.Module:
        return self.base().ln_f

    def attention_weights(self, layer: int) -> dict:
        """GPT-2: ``c_attn`` is a Conv1D (``y = x @ W + b``, W stored ``[d_model, 3*d_model]``,
        columns q | k | v); ``c_proj`` likewise ``[d_model, d_model]``. Scaling from the config:
        1/sqrt(d_head) if ``scale_attn_weights``, divided by (layer+1) if
        ``scale_attn_by_inverse_layer_idx``; ``reorder_and_upcast_attn`` (eager) -> float32."""
        attn = self.base().h[layer].attn
        d = self.d_model
        w, b = attn.c_attn.weight.detach(), attn.c_attn.bias.detach()
        scaling = self.d_head ** -0.5 if self.config.scale_attn_weights else 1.0
        if self.config.scale_attn_by_inverse_layer_idx:
            scaling /= float(layer + 1)
        return dict(
            W_q=w[:, :d], b_q=b[:d], W_k=w[:, d : 2 * d], b_k=b[d : 2 * d],
            W_v=w[:, 2 * d :], b_v=b[2 * d :],
            W_o=attn.c_proj.weight.detach(), b_o=attn.c_proj.bias.detach(),
            n_heads=self.n_heads, d_head=self.d_head, scaling=float(scaling),
            upcast=bool(getattr(self.config, "reorder_and_upcast_attn", False)), causal=True,
        )

    def split_qkv(self, outs):
        (fused,) = outs
        B, T, _ = fused.shape
        q, k, v = fused.split(self.d_model, dim=2)
        shape = (B, T, self.n_heads, self.d_head)
        return tuple(x.reshape(shape).transpose(1, 2) for x in (q, k, v))


class BertAdapter(Adapter):
    """BERT family (BertModel): bidirectional, 3 Linear layers."""

    family = "bert"
    causal = False

    def base(self) -> nn.Module:
        return getattr(self.model, "bert", self.model)

    def layers(self) -> list[LayerHandles]:
        out = []
        for layer in self.base().encoder.layer:
            self_attn = layer.attention.self
            scaling = float(getattr(self_attn, "scaling", self.d_head ** -0.5))
            out.append(
                LayerHandles(
                    self_attn,
                    [self_attn.query, self_attn.key, self_attn.value],
                    layer.attention.output.dense,
                    scaling,
                )
            )
        return out

    def attention_weights(self, layer: int) -> dict:
        """BERT: ``query``/``key``/``value`` and ``attention.output.dense`` are ``nn.Linear``
        (``y = x @ W.T + b``, W stored ``[d_out, d_in]``), returned transposed. Scaling
        1/sqrt(d_head); bidirectional."""
        lyr = self.base().encoder.layer[layer]
        sa, dense = lyr.attention.self, lyr.attention.output.dense

        def wb(m):
            return m.weight.detach().t(), m.bias.detach()

        (W_q, b_q), (W_k, b_k), (W_v, b_v), (W_o, b_o) = map(wb, (sa.query, sa.key, sa.value, dense))
        return dict(W_q=W_q, b_q=b_q, W_k=W_k, b_k=b_k, W_v=W_v, b_v=b_v, W_o=W_o, b_o=b_o,
                    n_heads=self.n_heads, d_head=self.d_head, scaling=float(self.d_head ** -0.5),
                    upcast=False, causal=False)

    def split_qkv(self, outs):
        B, T, _ = outs[0].shape
        shape = (B, T, self.n_heads, self.d_head)
        return tuple(x.reshape(shape).transpose(1, 2) for x in outs)


ADAPTERS: dict[str, Callable[[nn.Module], Adapter]] = {
    "gpt2": GPT2Adapter,
    "bert": BertAdapter,
}
CAUSAL_TYPES = {"gpt2"}
