"""/v1/trajectories on the rotary families: the appended last state is named after the family's
final norm ("final RMSNorm output" for Llama, Mistral, Qwen2, Gemma, Gemma 2; "final LayerNorm
output" for GPT-NeoX and GPT-2), and it is that norm's output: Hugging Face's last
``hidden_states`` entry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from families import FAMILIES, family_checkpoint

from attnscope.service.config import Settings
from attnscope.service.runtime.model import Runtime

TEXT = "In the beginning God created the heaven and the earth."
NAMES = {"llama": "RMSNorm", "mistral": "RMSNorm", "qwen2": "RMSNorm", "gemma": "RMSNorm",
         "gemma2": "RMSNorm", "gpt_neox": "LayerNorm"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("traj-families")


@pytest.mark.parametrize("family", FAMILIES)
def test_final_state_is_named_after_the_family_norm(family, root, make_client):
    import transformers as tf

    path = family_checkpoint(family, root)
    rt = Runtime.load(Settings(model=str(path)))
    c = make_client(rt)
    r = c.post("/v1/trajectories", json={"text": TEXT, "include_final": True, "n_components": 2})
    assert r.status_code == 200, r.text
    t = r.json()["trajectories"]
    L = rt.adapter.n_layers
    assert t["state_names"] == ["embeddings"] + [f"block {i} output" for i in range(L)] + \
        [f"final {NAMES[family]} output"]
    assert t["states"] == list(range(L + 2))
    # the named state is the final norm's output: HF's last hidden_states entry
    ids = [tok["id"] for tok in t["tokens"]]
    hf = tf.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        last = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    fw = rt.forward_many([rt.tokenize(TEXT, add_bos=t["add_bos"])])[0]
    assert [x.id for x in fw.tokens.tokens] == ids
    np.testing.assert_allclose(fw.tensors.final_state.numpy(), last.numpy(), atol=1e-5, rtol=0)


def test_gpt2_keeps_the_layernorm_name(client):
    r = client.post("/v1/trajectories", json={"text": TEXT, "include_final": True})
    assert r.status_code == 200, r.text
    assert r.json()["trajectories"]["state_names"][-1] == "final LayerNorm output"
