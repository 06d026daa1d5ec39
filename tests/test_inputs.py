"""Inputs on every text endpoint (issue 25, items 1 and 2): each text field has a token-id twin
(``text``/``tokens``, ``texts``/``token_lists``, ``clean_text``/``clean_tokens``, ...) that
gives the same response for the same ids, and one BOS convention (``add_bos`` null = the
model's: BOS prepended for GPT-2-family models, as TransformerLens' ``to_tokens``) echoed in
every response. Table-driven over ``default_table()``.
"""

from __future__ import annotations

import pytest

from attnscope.schemas.common import tokens_field
from attnscope.service.serving.core.inputs import text_fields
from attnscope.service.serving.core.table import default_table
from conftest import assert_error

TEXT = "When Mary and John went to the store, John gave a drink to"
OTHER = "When Mary and John went to the store, Mary gave a drink to"
#: the lead's /v1/run has its own prompt fields (``tokens`` = several sequences beside
#: ``texts``), outside this table until they are aligned
OWN_INPUTS = {"/v1/run"}


def _text_endpoints():
    out = []
    for ep in default_table():
        if ep.request is None or ep.path in OWN_INPUTS:
            continue
        names = [n for n in text_fields(ep.request.model_construct())]
        if names:
            out.append((ep, names))
    return out


def _cases():
    """(path, body with texts) per endpoint that takes text: its OpenAPI example, and the
    other text fields it has (texts, reference_texts, resample_text, query_text)."""
    cases = []
    for ep, names in _text_endpoints():
        ex = dict(ep.request.model_config["json_schema_extra"]["examples"][0])
        cases.append((ep.path, ex))
        if "texts" in names:
            body = {k: v for k, v in ex.items() if k != "text"}
            cases.append((ep.path, {**body, "texts": [TEXT, OTHER]}))
    cases += [
        ("/v1/ablate", {"text": TEXT, "heads": [[0, 1]], "method": "mean",
                        "reference_texts": [OTHER, "The cat sat on the mat."]}),
        ("/v1/ablate", {"text": TEXT, "heads": [[1, 0]], "method": "resample",
                        "resample_text": "When John and Mary went to the store, John gave a drink to"}),
        ("/v1/scratch-attention", {"text": "The cat sat", "variant": "cross",
                                   "query_text": "on the mat"}),
    ]
    return cases


def test_every_text_field_has_its_token_id_twin():
    """Every request field that takes text (``text``, ``texts``, ``*_text``, ``*_texts``) has
    its twin, so ids can be given wherever text can."""
    seen = set()
    for ep, names in _text_endpoints():
        for n in names:
            assert tokens_field(n) in ep.request.model_fields, (ep.path, n)
            seen.add(n)
    assert seen >= {"text", "texts", "reference_texts", "resample_text", "clean_text",
                    "corrupted_text", "query_text"}


def _ids(client, text: str, add_bos=None) -> list[int]:
    body = {"text": text} if add_bos is None else {"text": text, "add_bos": add_bos}
    r = client.post("/v1/tokenize", json=body)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["tokens"]["tokens"]]


def _as_ids(client, body: dict) -> dict:
    out = {}
    for k, v in body.items():
        if k in ("text", "texts") or k.endswith(("_text", "_texts")):
            out[tokens_field(k)] = (_ids(client, v) if isinstance(v, str)
                                    else [_ids(client, t) for t in v])
        else:
            out[k] = v
    return out


def _strip(x):
    """The response without what differs by construction: character offsets (null for ids)
    and the add_bos echo (what the service prepended: nothing to ids)."""
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in ("start", "end", "add_bos")}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


@pytest.mark.parametrize("path,body", _cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_same_ids_as_text_or_tokens_give_the_same_response(client, path, body):
    by_text = client.post(path, json=body)
    assert by_text.status_code == 200, by_text.text
    ids_body = _as_ids(client, body)
    by_ids = client.post(path, json=ids_body)
    assert by_ids.status_code == 200, by_ids.text
    t, i = by_text.json(), by_ids.json()
    assert t["add_bos"] is True and i["add_bos"] is False
    assert _strip(t) == _strip(i)
    # the BOS the text got is the first id given, labelled as the tokenizer decodes it
    first = ids_body.get("tokens") or ids_body.get("clean_tokens") or \
        (ids_body.get("token_lists") or [[None]])[0]
    assert first[0] == 0


@pytest.mark.parametrize("path,body", _cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_add_bos_defaults_to_the_models_convention_and_is_echoed(client, path, body):
    """GPT-2 family: BOS prepended by default (add_bos null), echoed as true; false gives the
    text's own tokens (the source documents' tokenisation), echoed as false."""
    on = client.post(path, json=body)
    off = client.post(path, json={**body, "add_bos": False})
    assert on.status_code == 200 and off.status_code == 200, (on.text, off.text)
    assert on.json()["add_bos"] is True and off.json()["add_bos"] is False
    explicit = client.post(path, json={**body, "add_bos": True})
    assert _strip(explicit.json()) == _strip(on.json())
    first = next(v for k, v in body.items() if k in ("text", "texts", "clean_text"))
    text = first if isinstance(first, str) else first[0]
    assert _ids(client, text) == [0] + _ids(client, text, add_bos=False)


def test_the_explorer_endpoints_and_heads_share_the_default(client):
    """One default everywhere: /v1/heads (which prepended before) and /v1/attention (which did
    not) now see the same tokens; /v1/model says what null means."""
    assert client.get("/v1/model").json()["add_bos_default"] is True
    a = client.post("/v1/attention", json={"text": TEXT, "layers": [0]}).json()
    h = client.post("/v1/heads", json={"text": TEXT}).json()
    assert a["attention"]["tokens"][0]["label"] == "<|endoftext|>" == h["sink_tokens"][0]
    assert a["add_bos"] is h["add_bos"] is True
    assert h["n_tokens"] == [len(a["attention"]["tokens"])]


def test_encoders_keep_their_framing_and_refuse_add_bos(bert_client):
    assert bert_client.get("/v1/model").json()["add_bos_default"] is False
    r = bert_client.post("/v1/attention", json={"text": "the cat sat", "layers": [0]})
    assert r.status_code == 200 and r.json()["add_bos"] is False
    assert [t["label"] for t in r.json()["attention"]["tokens"]][::4] == ["[CLS]", "[SEP]"]
    assert_error(bert_client.post("/v1/attention", json={"text": "the cat", "add_bos": True}),
                 param="add_bos")


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("body,param,words", [
    ({"tokens": [0, 5, 7, 99999]}, "tokens.3",
     "tokens[3] = 99999 is not a token id (vocabulary 0..2047)"),
    ({"tokens": [0, -1]}, "tokens.1", "tokens[1] = -1 is not a token id (vocabulary 0..2047)"),
    ({"token_lists": [[0, 5], [0, 5, 2048]]}, "token_lists.1.2",
     "token_lists.1[2] = 2048 is not a token id"),
    ({"tokens": []}, "tokens", "at least 1"),
    ({"token_lists": []}, "token_lists", "at least 1"),
    ({"token_lists": [[0], []]}, "token_lists.1", "at least 1"),
    ({"tokens": [5] * 257}, "tokens", "tokens has 257 tokens; the model's context is 256"),
    ({"tokens": [0, 5], "add_bos": True}, "add_bos", "put the BOS id 0 first"),
    ({"tokens": [0, 5], "text": "a"}, None, "give exactly one of"),
    ({"tokens": [True, 5]}, "tokens.0", "integer"),
    ({"tokens": [1.5, 5]}, "tokens.0", "integer"),
])
def test_bad_token_ids_are_a_422_naming_the_position_and_the_limit(client, body, param, words):
    e = assert_error(client.post("/v1/attention", json={**body, "layers": [0]}), 422,
                     param=param)
    assert words in e["message"], e


def test_the_vocabulary_and_context_checks_hold_on_every_twin(client):
    bad = [0, 5, 4096]
    for path, body, param in [
        ("/v1/ablate", {"tokens": bad, "heads": [[0, 0]]}, "tokens.2"),
        ("/v1/ablate", {"text": TEXT, "heads": [[0, 0]], "method": "mean",
                        "reference_token_lists": [[0, 5], bad]}, "reference_token_lists.1.2"),
        ("/v1/ablate", {"text": "a b", "heads": [[0, 0]], "method": "resample",
                        "resample_tokens": bad}, "resample_tokens.2"),
        ("/v1/patch", {"clean_tokens": [0, 5, 6], "corrupted_tokens": bad, "metric": "loss"},
         "corrupted_tokens.2"),
        ("/v1/scratch-attention", {"tokens": bad}, "tokens.2"),
        ("/v1/scratch-attention", {"tokens": [1, 2], "variant": "cross", "query_tokens": bad},
         "query_tokens.2"),
        ("/v1/heads", {"token_lists": [bad]}, "token_lists.0.2"),
        ("/v1/tokenize", {"tokens": bad}, "tokens.2"),
    ]:
        e = assert_error(client.post(path, json=body), 422, param=param)
        assert "= 4096 is not a token id (vocabulary 0..2047)" in e["message"], (path, e)
    e = assert_error(client.post("/v1/patch", json={"clean_tokens": [0, 5, 6],
                                                    "corrupted_tokens": [0, 5],
                                                    "metric": "loss"}), param="corrupted_tokens")
    assert "clean_tokens has 3 tokens and corrupted_tokens has 2" in e["message"]
    assert_error(client.post("/v1/ablate", json={"text": TEXT, "tokens": [0], "heads": [[0, 0]]}),
                 param=None)


def test_token_lists_over_max_batch_is_batch_too_large(client):
    e = assert_error(client.post("/v1/attention", json={"token_lists": [[0, 1]] * 33}), 422,
                     "batch_too_large", "token_lists")
    assert "token_lists holds 33 sequences; the limit is 32 (max_batch)" in e["message"]


def test_ids_are_used_exactly_as_given(client):
    """No BOS added to ids (null add_bos means false there), labels as the tokenizer decodes
    them, offsets null, a BOS id in the middle kept where it is (special)."""
    ids = _ids(client, TEXT, add_bos=False)
    r = client.post("/v1/tokenize", json={"tokens": ids[:3] + [0] + ids[3:]}).json()
    assert r["add_bos"] is False
    toks = r["tokens"]["tokens"]
    assert [t["id"] for t in toks] == ids[:3] + [0] + ids[3:]
    assert all(t["start"] is None and t["end"] is None for t in toks)
    assert toks[3]["special"] and toks[3]["label"] == "<|endoftext|>"
    text_toks = client.post("/v1/tokenize", json={"text": TEXT, "add_bos": False}).json()
    assert [t["label"] for t in toks[:3]] == [t["label"] for t in text_toks["tokens"]["tokens"][:3]]


# ------------------------------------------------------------------ client
def test_the_client_takes_token_ids_wherever_it_takes_text(client):
    from attnscope.client import Client

    c = Client("http://testserver", http_client=client, max_retries=0)
    ids = _ids(client, TEXT)
    a, b = c.attention(TEXT, layers=[0]), c.attention(tokens=ids, layers=[0])
    assert a.add_bos is True and b.add_bos is False
    assert (a.attention.pattern.numpy() == b.attention.pattern.numpy()).all()
    assert [r.tokens[0].id for r in c.tokenize(token_lists=[ids, ids[1:]]).results] == \
        [0, ids[1]]
    assert c.tokenize(TEXT, add_bos=False).tokens.n_tokens == len(ids) - 1
    ab = c.ablate(tokens=ids, heads=[(0, 0)])
    assert ab.add_bos is False and [t.id for t in ab.tokens] == ids
    other = _ids(client, "When John and Mary went to the store, John gave a drink to")
    p = c.patch(clean_tokens=ids, corrupted_tokens=other, metric="loss")
    assert p.add_bos is False and len(p.heads) == 2
