"""Per-family architecture adapters: where attention lives in the module tree.

Everything else in the runtime is generic. An adapter knows, for its family:
the base model (no LM head), the per-layer attention module (whose input is the attention
input), how q/k/v are produced (GPT-2: one ``c_attn`` Conv1D with weight stored
``[d_model, 3*d_model]``; BERT: three ``nn.Linear``), the output projection, the scaling of
q.k, and whether attention is causal.

Rotary families (:class:`RotaryAdapter`: ``llama`` with Mistral's sliding window, ``mistral``,
``qwen2``, ``gemma``, ``gemma2``, ``gpt_neox``) rotate q and k INSIDE the attention module, so
their q/k/v are recorded where the attention function receives them
(service/runtime/inplace_attention.py): q AFTER rotary ``[head, pos, d_head]``, k AFTER rotary
and v on the KEY/VALUE heads ``[kv_head, pos, d_head]`` (before Hugging Face's ``repeat_kv``;
TransformerLens' ``hook_k``/``hook_v`` of grouped-query attention have the same heads). Query
head ``h`` reads key/value head ``h // (n_heads // n_kv_heads)`` (:meth:`Adapter.kv_head`).
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
    #: the key window of this layer (a query sees the ``window`` latest keys, itself
    #: included: ``query_pos - window < key_pos <= query_pos``), None = every earlier key
    window: int | None = None
    #: the attention logit soft-cap ``c`` (Gemma 2: scores -> c * tanh(scores / c) before the
    #: mask), None = none
    softcap: float | None = None


class Adapter:
    family: str = ""
    causal: bool = False
    #: q/k/v are taken where the attention function receives them (rotary families: after
    #: rotary, k/v on the key/value heads), not from the q/k/v modules' outputs
    qkv_in_attention: bool = False
    #: the family's eager attention computes the softmax in float32 (``dtype=torch.float32``)
    softmax_float32: bool = False

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
        return int(getattr(self.config, "head_dim", None) or self.d_model // self.n_heads)

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads per layer (grouped-query attention: fewer than ``n_heads``)."""
        return int(getattr(self.config, "num_key_value_heads", None) or self.n_heads)

    def kv_head(self, head: int) -> int:
        """The key/value head query head ``head`` reads: ``head // (n_heads // n_kv_heads)``
        (Hugging Face's ``repeat_kv``: each key/value head repeated for consecutive query
        heads)."""
        return head // (self.n_heads // self.n_kv_heads)

    def windows(self) -> tuple[int | None, ...]:
        """Per layer, the sliding key window (None = full causal/bidirectional attention)."""
        return tuple(h.window for h in self.layers())

    def attention_facts(self) -> dict:
        """The family's attention facts for GET /v1/model (plain values; see
        :meth:`RotaryAdapter.attention_facts` for the fields)."""
        return {"positions": "learned_absolute",
                "rotary_fraction": None, "rotary_dim": None, "rope_theta": None,
                "rope_scaling": None, "n_kv_heads": self.n_kv_heads,
                "kv_head_of_query_head": [self.kv_head(h) for h in range(self.n_heads)],
                "sliding_window": None, "sliding_window_layers": None,
                "attn_logit_softcap": None, "final_logit_softcap": None,
                "norm": "layernorm", "parallel_residual": False,
                "qkv_bias": True, "scaling": [h.scaling for h in self.layers()]}

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


class RotaryAdapter(Adapter):
    """Decoder-only families with rotary position embeddings (Su et al. 2021, RoFormer),
    Hugging Face's ``LlamaForCausalLM`` layout: ``model.layers[i].self_attn`` with ``q_proj``,
    ``k_proj``, ``v_proj`` (``nn.Linear``, k/v ``[n_kv_heads * d_head, d_model]``) and
    ``o_proj``; RMSNorm; the final norm ``model.norm``. Causal. q/k/v are recorded in the
    attention function (after rotary; k/v on the key/value heads, see the module docstring)."""

    causal = True
    qkv_in_attention = True
    softmax_float32 = True
    norm_kind = "rmsnorm"  # x / sqrt(mean(x^2) + eps) * weight

    def base(self) -> nn.Module:
        return self.model.base_model

    def blocks(self) -> list[nn.Module]:
        return list(self.base().layers)

    def attn_module(self, block: nn.Module) -> nn.Module:
        return block.self_attn

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, as Hugging Face builds its mask: by
        ``config.layer_types`` where the config has them ("sliding_attention" layers get
        ``config.sliding_window``: Qwen2, Gemma 2), else ``config.sliding_window`` on every
        layer when set (Mistral), else None."""
        cfg = self.config
        types = getattr(cfg, "layer_types", None)
        win = getattr(cfg, "sliding_window", None)
        if types is not None:
            return int(win) if types[layer] == "sliding_attention" and win else None
        return int(win) if win else None

    def layer_softcap(self, layer: int) -> float | None:
        return None

    def layers(self) -> list[LayerHandles]:
        out = []
        for i, block in enumerate(self.blocks()):
            attn = self.attn_module(block)
            out.append(LayerHandles(attn, [], self.out_proj(attn), float(attn.scaling),
                                    self.layer_window(i), self.layer_softcap(i)))
        return out

    def out_proj(self, attn: nn.Module) -> nn.Module:
        return attn.o_proj

    def final_norm(self) -> nn.Module:
        return self.base().norm

    def split_qkv(self, outs):
        """Recorded in the attention function, already split: ``q [batch, head, pos, d_head]``,
        ``k``/``v`` ``[batch, kv_head, pos, d_head]``, returned as they are."""
        q, k, v = outs
        return q, k, v

    def _linear(self, m: nn.Module, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``nn.Linear`` -> (W ``[d_in, d_out]``, b ``[d_out]``; zeros where it has no bias)."""
        w = m.weight.detach().t()
        b = m.bias.detach() if getattr(m, "bias", None) is not None else \
            torch.zeros(width, dtype=w.dtype, device=w.device)
        return w, b

    def qkv_weights(self, attn: nn.Module) -> dict:
        H, KV, dh = self.n_heads, self.n_kv_heads, self.d_head
        W_q, b_q = self._linear(attn.q_proj, H * dh)
        W_k, b_k = self._linear(attn.k_proj, KV * dh)
        W_v, b_v = self._linear(attn.v_proj, KV * dh)
        return dict(W_q=W_q, b_q=b_q, W_k=W_k, b_k=b_k, W_v=W_v, b_v=b_v)

    def rotary(self) -> dict:
        """The rotary embedding as Hugging Face computes it (``*RotaryEmbedding.forward``):
        ``inv_freq [rotary_dim / 2]`` float32 (theta and any rope scaling already applied),
        ``attention_scaling`` (a multiplier of cos/sin, 1.0 unless YaRN/longrope), and
        ``rotary_dim`` (the first ``rotary_dim`` dimensions of each head rotate; the rest
        pass, GPT-NeoX's ``rotary_pct``), in the rotate-half layout."""
        emb = self.base().rotary_emb
        inv = emb.inv_freq.detach()
        return dict(inv_freq=inv, attention_scaling=float(getattr(emb, "attention_scaling", 1.0)),
                    rotary_dim=2 * int(inv.numel()))

    def attention_weights(self, layer: int) -> dict:
        """``nn.Linear`` weights transposed into the ``y = x @ W + b`` layout: ``W_q [d_model,
        n_heads * d_head]``, ``W_k``/``W_v`` ``[d_model, n_kv_heads * d_head]``, ``W_o
        [n_heads * d_head, d_model]``; biases zeros where the family has none. Plus the
        grouped-query mapping (``n_kv_heads``), the layer's ``window``, ``softcap`` and the
        ``rotary`` embedding (:meth:`rotary`) that turns projected q/k into the recorded ones.
        Scaling: the attention module's own (1/sqrt(d_head); Gemma 2: query_pre_attn_scalar**-0.5)."""
        h = self.layers()[layer]
        attn = h.attn
        W_o, b_o = self._linear(h.out_proj, self.d_model)
        return dict(**self.qkv_weights(attn), W_o=W_o, b_o=b_o, n_heads=self.n_heads,
                    d_head=self.d_head, scaling=h.scaling, upcast=False, causal=True,
                    n_kv_heads=self.n_kv_heads, window=h.window, softcap=h.softcap,
                    softmax_float32=True, rotary=self.rotary())

    def attention_facts(self) -> dict:
        """GET /v1/model's attention facts: ``positions`` "rotary", ``rotary_dim`` and
        ``rotary_fraction`` (of d_head), ``rope_theta``, ``rope_scaling`` (the config's
        rope parameters beyond theta, or None), ``n_kv_heads`` and ``kv_head_of_query_head``
        (query head h -> its key/value head), ``sliding_window`` (the window, or None),
        ``sliding_window_layers`` (per layer, the window or None), ``attn_logit_softcap``,
        ``final_logit_softcap``, ``norm`` ("rmsnorm", "rmsnorm_1p" for Gemma's ``1 + weight``,
        "layernorm"), ``parallel_residual``, ``qkv_bias``, ``scaling`` per layer."""
        rp = dict(getattr(self.config, "rope_parameters", None) or {})
        theta = rp.pop("rope_theta", getattr(self.config, "rope_theta", None))
        rp.pop("partial_rotary_factor", None)
        scaling = None if rp.get("rope_type", "default") == "default" and len(rp) <= 1 else rp
        rot = self.rotary()
        wins = list(self.windows())
        present = [w for w in wins if w is not None]
        return {"positions": "rotary", "rotary_dim": rot["rotary_dim"],
                "rotary_fraction": rot["rotary_dim"] / self.d_head,
                "rope_theta": None if theta is None else float(theta), "rope_scaling": scaling,
                "n_kv_heads": self.n_kv_heads,
                "kv_head_of_query_head": [self.kv_head(h) for h in range(self.n_heads)],
                "sliding_window": max(present) if present else None,
                "sliding_window_layers": wins if present else None,
                "attn_logit_softcap": self.layer_softcap(0),
                "final_logit_softcap": _num_or_none(getattr(self.config,
                                                            "final_logit_softcapping", None)),
                "norm": self.norm_kind, "parallel_residual": self.parallel_residual,
                "qkv_bias": self.qkv_bias(), "scaling": [h.scaling for h in self.layers()]}

    parallel_residual = False

    def qkv_bias(self) -> bool:
        return getattr(self.attn_module(self.blocks()[0]).q_proj, "bias", None) is not None


def _num_or_none(x) -> float | None:
    return None if x is None else float(x)


class LlamaAdapter(RotaryAdapter):
    """Llama (LlamaForCausalLM): RoPE, GQA, RMSNorm, SwiGLU."""

    family = "llama"


class MistralAdapter(RotaryAdapter):
    """Mistral (MistralForCausalLM): Llama's layout with a sliding window on every layer."""

    family = "mistral"


class Qwen2Adapter(RotaryAdapter):
    """Qwen2 (Qwen2ForCausalLM): Llama's layout with q/k/v biases; sliding window per
    ``layer_types`` when ``use_sliding_window``."""

    family = "qwen2"


class GemmaAdapter(RotaryAdapter):
    """Gemma (GemmaForCausalLM): Llama's layout, RMSNorm ``x_hat * (1 + weight)``, embeddings
    scaled by ``sqrt(d_model)``, GeGLU, tied unembedding."""

    family = "gemma"
    norm_kind = "rmsnorm_1p"


class Gemma2Adapter(GemmaAdapter):
    """Gemma 2 (Gemma2ForCausalLM): Gemma's, plus attention logit soft-capping (scores ->
    ``c * tanh(scores / c)`` before the mask), sliding window on alternate layers
    (``layer_types``), scaling ``query_pre_attn_scalar**-0.5``, norms before AND after
    attention and MLP (the recorded attention output is ``o_proj``'s, before
    ``post_attention_layernorm``), final logit soft-capping."""

    family = "gemma2"

    def layer_softcap(self, layer: int) -> float | None:
        return _num_or_none(getattr(self.config, "attn_logit_softcapping", None))


class GPTNeoXAdapter(RotaryAdapter):
    """GPT-NeoX / Pythia (GPTNeoXForCausalLM): ``gpt_neox.layers[i].attention`` with one fused
    ``query_key_value`` Linear whose output is per head ``[q | k | v]`` (``[head, 3 * d_head]``),
    ``dense`` output projection, partial rotary (``rotary_pct``), LayerNorm, parallel residual
    (``use_parallel_residual``), final norm ``final_layer_norm``. No grouped-query attention."""

    family = "gpt_neox"
    norm_kind = "layernorm"

    def attn_module(self, block: nn.Module) -> nn.Module:
        return block.attention

    def out_proj(self, attn: nn.Module) -> nn.Module:
        return attn.dense

    def final_norm(self) -> nn.Module:
        return self.base().final_layer_norm

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads

    @property
    def parallel_residual(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.config, "use_parallel_residual", True))

    def qkv_bias(self) -> bool:
        return self.attn_module(self.blocks()[0]).query_key_value.bias is not None

    def qkv_weights(self, attn: nn.Module) -> dict:
        """``query_key_value`` (``[3 * d_model, d_model]``, rows per head ``q | k | v``)
        split into q, k, v in the ``y = x @ W + b`` layout."""
        H, dh, D = self.n_heads, self.d_head, self.d_model
        w = attn.query_key_value.weight.detach().view(H, 3, dh, D)
        b = attn.query_key_value.bias
        b = (b.detach().view(H, 3, dh) if b is not None
             else torch.zeros(H, 3, dh, dtype=w.dtype, device=w.device))
        out = {}
        for j, n in enumerate("qkv"):
            out[f"W_{n}"] = w[:, j].reshape(H * dh, D).t()
            out[f"b_{n}"] = b[:, j].reshape(H * dh)
        return out


ADAPTERS: dict[str, Callable[[nn.Module], Adapter]] = {
    "gpt2": GPT2Adapter,
    "bert": BertAdapter,
    "llama": LlamaAdapter,
    "mistral": MistralAdapter,
    "qwen2": Qwen2Adapter,
    "gemma": GemmaAdapter,
    "gemma2": Gemma2Adapter,
    "gpt_neox": GPTNeoXAdapter,
}
CAUSAL_TYPES = {"gpt2", "llama", "mistral", "qwen2", "gemma", "gemma2", "gpt_neox"}
