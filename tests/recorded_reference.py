"""Hugging Face's own forward of one text with its q/k/v, and seeded word texts: the
reference the recorded-forward tests (runtime, attention, device slot, app) compare with."""

from __future__ import annotations

import random

import torch

from attnscope.service.runtime import Runtime


def hf_reference(rt: Runtime, ids: list[int]):
    """Hugging Face's own forward of one unpadded text, with q/k/v from manual hooks on the
    q/k/v modules (split into heads here) and the last block's output from a hook on it: the
    recorded tensors (hidden_states = the L+1 residual-stream states, the last pre-ln_f;
    final_hidden_state = HF's last hidden_states entry)."""
    caps: list[list] = [[None] * len(h.qkv) for h in rt._handles]
    base = rt.adapter.base()
    last_block = (base.h if rt.adapter.causal else base.encoder.layer)[-1]
    last = []
    hooks = [last_block.register_forward_hook(
        lambda m, a, o: last.append((o[0] if isinstance(o, tuple) else o)[0].clone()))]
    for i, h in enumerate(rt._handles):
        for j, m in enumerate(h.qkv):
            def hook(mod, args, out, i=i, j=j):
                caps[i][j] = out[0].clone()
            hooks.append(m.register_forward_hook(hook))
    kw = dict(input_ids=torch.tensor([ids]), output_attentions=True, output_hidden_states=True)
    if rt.adapter.family == "bert":
        kw["token_type_ids"] = torch.zeros_like(kw["input_ids"])
    try:
        with torch.inference_mode():
            out = rt.adapter.base()(**kw)
    finally:
        for h in hooks:
            h.remove()
    H, dh = rt.adapter.n_heads, rt.adapter.d_head
    qs, ks, vs = [], [], []
    for layer in caps:
        parts = layer[0].split(rt.adapter.d_model, dim=-1) if len(layer) == 1 else layer
        q, k, v = (p.reshape(len(ids), H, dh).transpose(0, 1) for p in parts)
        qs.append(q), ks.append(k), vs.append(v)
    return dict(pattern=torch.stack([a[0] for a in out.attentions]),
                hidden_states=torch.stack([h[0] for h in out.hidden_states[:-1]] + last),
                final_hidden_state=out.hidden_states[-1][0],
                q=torch.stack(qs), k=torch.stack(ks), v=torch.stack(vs))


WORDS = "the cat sat on a mat and then it ran far away from home".split()


def words(n: int, seed) -> str:
    r = random.Random(str(seed))
    return " ".join(r.choice(WORDS) for _ in range(n))
