"""ln1's hooks and the per-head split inputs (``hook_{q,k,v}_input``) in one forward: a split
input that is edited or differentiated recomputes its heads' q/k/v from its own copy of
hook_resid_pre, off ln1's hooks, so an edit OR a gradient at ln1 together with one there is
refused (422 naming ``interventions``, or ``grad.hooks`` when only gradients meet). Before, a gradient at ``blocks.0.ln1.hook_scale``
silently changed with the other hooks asked for (zero with ``grad.hooks: ["*"]``)."""

from __future__ import annotations

import pytest
import torch

from attnscope.service.errors import InvalidRequest
from attnscope.service.runtime import hooked as K

IDS = torch.tensor([[0, 5, 17, 99, 300], [0, 51, 17, 929, 300]])


@pytest.fixture(scope="module")
def parts(bundled_dir):
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(str(bundled_dir), attn_implementation="eager").eval()
    return K.gpt2_parts(hf)


@pytest.mark.parametrize("hooks", [
    ["blocks.0.ln1.hook_scale", "blocks.0.hook_q_input"],
    ["blocks.0.ln1.hook_normalized", "blocks.0.hook_v_input"],
    ["*"],
])
def test_ln1_gradient_with_a_split_gradient_is_refused(parts, hooks):
    with pytest.raises(InvalidRequest) as ei:
        K.run(parts, IDS, grad=K.GradRequest(metric=K.Loss(terms=[(None, 2)]), hooks=hooks))
    assert ei.value.param == "grad.hooks"
    assert "cannot both" in ei.value.message


def test_ln1_gradient_with_a_split_edit_is_refused(parts):
    with pytest.raises(InvalidRequest, match="interventions: "):
        K.run(parts, IDS, interventions=[K.Zero(hook="blocks.0.hook_k_input", heads=[1])],
              grad=K.GradRequest(metric=K.Loss(terms=[(None, 2)]),
                                 hooks=["blocks.0.ln1.hook_scale"]))


def test_ln1_gradient_alone_and_split_gradient_alone_still_served(parts):
    m = K.Loss(terms=[(None, 2)])
    a = K.run(parts, IDS, grad=K.GradRequest(metric=m, hooks=["blocks.0.ln1.hook_scale"]))
    assert float(a.grads["blocks.0.ln1.hook_scale"].abs().max()) > 0
    b = K.run(parts, IDS, grad=K.GradRequest(metric=m, hooks=["blocks.*.hook_q_input"]))
    assert set(b.grads) == {"blocks.0.hook_q_input", "blocks.1.hook_q_input"}
    # ln1 of ANOTHER layer than the split input: no conflict
    K.run(parts, IDS, grad=K.GradRequest(metric=m, hooks=["blocks.1.ln1.hook_scale",
                                                          "blocks.0.hook_q_input"]))
