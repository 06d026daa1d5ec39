"""The request memory estimate (service/serving/core/memory.py) counts recorded q/k/v at their
real widths: q ``n_heads * d_head``, k and v ``n_kv_heads * d_head`` each (grouped-query
attention), also where ``n_heads * d_head != d_model`` (Gemma with a wide head_dim).

Checked against the recorded tensors' own ``nbytes`` after a real forward of random family
checkpoints (tests/families.py) and the bundled GPT-2."""

from __future__ import annotations

import pytest

from families import family_checkpoint

from attnscope.service.config import Settings
from attnscope.service.errors import MemoryLimitExceeded
from attnscope.service.runtime.model import Runtime
from attnscope.service.serving.core.memory import check_memory, forward_bytes, qkv_width

TEXT = "In the beginning God created the heaven and the earth. And the earth was without form."

# GQA 4 q / 2 kv heads (Llama, Gemma 2); 8 q / 1 kv head (Llama); Gemma with head_dim 32:
# n_heads * d_head = 128 != d_model 64; GPT-NeoX (no GQA): the old 3 x d_model is right
CASES = [
    ("llama", {}),
    ("llama", {"num_attention_heads": 8, "num_key_value_heads": 1}),
    ("gemma", {"head_dim": 32}),
    ("gemma2", {}),
    ("gpt_neox", {}),
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("memory-families")


def transient_bytes(a, T: int, es: int) -> int:
    """The module docstring's transient part of one text's forward alone (batch of 1), by hand."""
    L, H, D = a.n_layers, a.n_heads, a.d_model
    W = (a.n_heads + 2 * a.n_kv_heads) * a.d_head
    return es * (L * H * T * T + 2 * H * T * T + (L + 1) * T * D + (W + 2 * D) * L * T + 4 * T * D)


def recorded_estimate(rt, T: int) -> int:
    """check_memory's estimate of one text minus the hand-computed transient part."""
    es = next(rt.model.parameters()).element_size()
    return check_memory(rt, [T], limit=0) - transient_bytes(rt.adapter, T, es)


@pytest.mark.parametrize("family,overrides", CASES, ids=lambda x: str(x) if x else "default")
def test_estimate_equals_the_recorded_tensors_nbytes(family, overrides, root):
    rt = Runtime.load(Settings(model=str(family_checkpoint(family, root, **overrides)),
                               max_request_bytes=0))
    a = rt.adapter
    fw = rt.forward_many([rt.tokenize(TEXT)])[0]
    t = fw.tensors
    # the recorded shapes the estimate assumes
    assert tuple(t.q.shape[1:2]) == (a.n_heads,) and tuple(t.k.shape[1:2]) == (a.n_kv_heads,)
    assert t.q.shape[-1] == t.k.shape[-1] == a.d_head
    assert qkv_width(a) * a.n_layers * fw.n_tokens * 4 == t.q.nbytes + t.k.nbytes + t.v.nbytes
    assert recorded_estimate(rt, fw.n_tokens) == t.nbytes
    # the old assumption (q, k, v each d_model wide) is wrong on each of these but GPT-NeoX
    old = forward_bytes(a.n_layers, a.n_heads, a.d_model, [fw.n_tokens], 4, 1)
    if family != "gpt_neox":
        assert 3 * a.d_model != qkv_width(a)
        assert old - transient_bytes(a, fw.n_tokens, 4) != t.nbytes
    if family == "gemma":  # 4 x 32 query dims + 2 x 2 x 32 key/value dims = 256 > 3 x 64
        assert qkv_width(a) == 256 and old < check_memory(rt, [fw.n_tokens], limit=0)


def test_gpt2_estimate_is_unchanged_and_exact(gpt2_runtime):
    rt = gpt2_runtime
    a = rt.adapter
    assert qkv_width(a) == 3 * a.d_model
    fw = rt.forward_many([rt.tokenize(TEXT)])[0]
    assert recorded_estimate(rt, fw.n_tokens) == fw.tensors.nbytes
    assert check_memory(rt, [fw.n_tokens], limit=0) == forward_bytes(
        a.n_layers, a.n_heads, a.d_model, [fw.n_tokens], 4, rt.settings.forward_batch_size)


def test_the_limit_applies_to_the_real_widths(root):
    """A limit between the old (3 x d_model) and the real estimate of a wide-head Gemma
    refuses the request; one at the real estimate lets it through."""
    rt = Runtime.load(Settings(model=str(family_checkpoint("gemma", root, head_dim=32)),
                               max_request_bytes=0))
    a = rt.adapter
    T = len(rt.tokenize(TEXT))
    real = check_memory(rt, [T], limit=0)
    old = forward_bytes(a.n_layers, a.n_heads, a.d_model, [T], 4, rt.settings.forward_batch_size)
    assert old < real
    with pytest.raises(MemoryLimitExceeded, match="max_request_bytes"):
        check_memory(rt, [T], limit=(old + real) // 2)
    assert check_memory(rt, [T], limit=real) == real
