"""/v1/path-patch's texts live inside ``pairs`` (``clean_text`` / ``corrupted_text``):
``add_bos`` null is the model's convention for them as for every other text (docs/api.md,
"Inputs"; BOS first for GPT-2), and false where every pair gives token ids. Before, the
top-level-only text check resolved null to false, so a text pair ran without BOS while the
same text on /v1/run and /v1/logit-lens got one."""

from types import SimpleNamespace

from attnscope.schemas.path_patch import PathPatchRequest
from attnscope.service.serving.core.inputs import resolve_add_bos

RT = SimpleNamespace(default_add_bos=True)
BODY = dict(senders=[{"kind": "mlp", "layer": 0}], receivers=[{"kind": "logits"}],
            metric={"kind": "loss", "terms": [{"position": 0}]})


def _resolved(pairs, **kw):
    return resolve_add_bos(RT, PathPatchRequest(pairs=pairs, **BODY, **kw)).add_bos


def test_text_pairs_take_the_model_default():
    assert _resolved([{"clean_text": "hello there", "corrupted_text": "hello where"}]) is True
    # one text side among ids is still a text
    assert _resolved([{"clean_tokens": [0, 5, 6], "corrupted_text": "hi there"}]) is True


def test_id_pairs_and_explicit_values():
    assert _resolved([{"clean_tokens": [0, 5], "corrupted_tokens": [0, 6]}]) is False
    assert _resolved([{"clean_text": "a b", "corrupted_text": "a c"}], add_bos=False) is False
