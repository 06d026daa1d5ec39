"""Independent references for the intervention tests (not used by the service).

* :func:`hf_run` — Hugging Face's own ``GPT2LMHeadModel.forward`` from token ids, with a
  forward pre-hook on every layer's ``attn.c_proj`` that lets a test edit (or watch) z
  ``[batch, pos, head, d_head]``: no code of the service's runtime is involved.
* :func:`gpt2_small_dir` — a randomly initialised GPT-2-small-shaped checkpoint (12 layers,
  12 heads, d_model 768, vocabulary 50257) saved to a directory with the bundled tokenizer
  (its 2048 ids are a subset of the vocabulary), for TransformerLens and the runtime to load.
* :func:`tl_bridge` — TransformerLens 4.x ``TransformerBridge`` booted from a local directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from attnscope.service.config import BUNDLED_MODEL_DIR


def hf_run(model, ids, edit=None, watch: list | None = None) -> torch.Tensor:
    """Logits ``[batch, pos, vocab]`` of ``model`` (GPT2LMHeadModel) on ``ids`` ``[batch, pos]``.

    ``edit(layer, z) -> z`` replaces each layer's z (``[batch, pos, head, d_head]``) before the
    output projection; ``watch`` collects the z each projection received (the tensors
    themselves, so a test can differentiate with respect to them)."""
    cfg = model.config
    H, dh = cfg.n_head, cfg.n_embd // cfg.n_head
    handles = []

    def hook(layer):
        def fn(module, args):
            x = args[0]
            z = x.view(*x.shape[:-1], H, dh)
            if edit is not None:
                z = edit(layer, z)
            if watch is not None:
                watch.append(z)
            return (z.reshape(x.shape),)
        return fn

    try:
        for i, block in enumerate(model.transformer.h):
            handles.append(block.attn.c_proj.register_forward_pre_hook(hook(i)))
        return model(input_ids=torch.as_tensor(ids)).logits
    finally:
        for h in handles:
            h.remove()


def gpt2_small_dir(path: Path, seed: int = 0, n_positions: int = 128) -> Path:
    """Save a random GPT-2-small-shaped GPT2LMHeadModel (safetensors, eager attention) and the
    bundled tokenizer into ``path``; return it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_positions=n_positions, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL_DIR / f, path / f)
    return path


_BRIDGES: dict[str, object] = {}


def tl_bridge(path):
    """TransformerLens' TransformerBridge for a local checkpoint directory (booted once)."""
    from transformer_lens.model_bridge import TransformerBridge

    key = str(path)
    if key not in _BRIDGES:
        _BRIDGES[key] = TransformerBridge.boot_transformers(key, device="cpu")
    return _BRIDGES[key]


def tl_hooked_bridge(path):
    """A fresh TransformerLens 4.x bridge of a local checkpoint with every hook the hooked
    forward serves: legacy names on the unprocessed weights (``enable_compatibility_mode(
    no_processing=True)``, what the service serves), ``hook_result`` and the per-head split
    q/k/v inputs on. Not shared: the tests that use it switch its options."""
    from transformer_lens.model_bridge import TransformerBridge

    b = TransformerBridge.boot_transformers(str(path), device="cpu")
    b.enable_compatibility_mode(no_processing=True, disable_warnings=True)
    b.set_use_attn_result(True)
    b.set_use_split_qkv_input(True)
    return b


_BRIDGE_ALIASES = (".attn.q.", ".attn.k.", ".attn.v.", ".attn.o.", ".mlp.in.", ".mlp.out.",
                   ".attn.hook_q_input", ".attn.hook_k_input", ".attn.hook_v_input")


def tl_legacy_name(name: str) -> bool:
    """Whether a hook of the bridge's cache is one of TransformerLens' legacy (HookedTransformer)
    names, the ones the service serves: not the bridge's own aliases (``*.hook_in``/
    ``hook_out``, ``attn.q.*``, ``attn.hook_hidden_states``, ``hook_unembed``, the attention
    module's copies of the split inputs)."""
    return not (name.endswith((".hook_in", ".hook_out", "attn.hook_hidden_states"))
                or name == "hook_unembed" or any(s in name for s in _BRIDGE_ALIASES))


def induction_ids(seed: int = 0, n: int = 25, repeats: int = 4, bos: int = 0, vocab: int = 2048,
                  low: int = 5) -> list[int]:
    """BOS + ``n`` distinct random token ids (from ``low`` up) repeated ``repeats`` times."""
    g = torch.Generator().manual_seed(seed)
    seg = (torch.randperm(vocab - low, generator=g)[:n] + low).tolist()
    return [bos] + seg * repeats


def induction_text(rt, seed: int = 0, n: int = 25, repeats: int = 4) -> tuple[str, list[int]]:
    """A TEXT whose tokens are ``n`` distinct random tokens repeated ``repeats`` times (what the
    HTTP API can be sent), with their ids (BOS not included; ask with ``add_bos``). The
    tokens are drawn, seeded, from the vocabulary's word tokens with a leading space (each
    one token alone) until the concatenation round-trips through the tokenizer."""
    tok = rt.tokenizer
    pool = []
    for tid in range(len(tok)):
        s = tok.decode([tid])
        if len(s) >= 3 and s[0] == " " and s[1:].isalpha() and list(rt.tokenize(s).input_ids) == [tid]:
            pool.append(tid)
    g = torch.Generator().manual_seed(seed)
    for _ in range(100):
        seg = [pool[i] for i in torch.randperm(len(pool), generator=g)[:n].tolist()]
        text = tok.decode(seg * repeats)
        if list(rt.tokenize(text).input_ids) == seg * repeats:
            return text, seg * repeats
    raise RuntimeError("no round-tripping segment found")
