"""Tokenization: the tokenize cache keyed on add_bos, and the context-length errors naming the
offending text's param.
"""

from __future__ import annotations

import pytest

from conftest import assert_error


# ------------------------------------------------------------------ tokenize cache
@pytest.mark.regression
def test_tokenize_cache_keys_on_add_bos_and_names_the_param(client, gpt2_runtime):
    text = "cache key check: same text, with and without BOS"
    a = gpt2_runtime.tokenize(text)
    b = gpt2_runtime.tokenize(text, add_bos=True)
    assert len(b) == len(a) + 1 and b.input_ids[1:] == a.input_ids
    assert gpt2_runtime.tokenize(text) is a and gpt2_runtime.tokenize(text, True) is b
    r1 = client.post("/v1/attention", json={"texts": [text, text], "add_bos": True})
    r0 = client.post("/v1/attention", json={"texts": [text, text], "add_bos": False})
    assert len(r1.json()["results"][1]["tokens"]) == len(b)
    assert len(r0.json()["results"][1]["tokens"]) == len(a)
    long = " the" * 300  # 300 tokens > n_ctx 256
    for _ in range(2):  # the second time after the short texts are cached
        e = assert_error(client.post("/v1/attention", json={"texts": [text, "a", "b", long],
                                                               "add_bos": False}),
                         param="texts.3")
        assert "300" in e["message"] and "256" in e["message"]
    assert_error(client.post("/v1/attention", json={"text": long}), param="text")
    # a text exactly at n_ctx: cached, then reused under another param name with add_bos
    at = " the" * 256
    assert client.post("/v1/attention", json={"text": at, "add_bos": False,
                                              "sparse": {"top_k": 1}}).status_code == 200
    assert_error(client.post("/v1/attention", json={"texts": ["a", at], "add_bos": True}),
                 param="texts.1")


# ------------------------------------------------------------------ token bytes, labels
# issue 29 item 4: every token carries its raw bytes (hex) and whether they split a UTF-8
# character; labels escape control characters as TransformerLens / CircuitsVis show them.
# Hand-computed: GPT-2's byte alphabet maps the bytes 0x00-0x20 to U+0100-U+0120, 0x7F-0xA0 to
# U+0121-U+0142 and 0xAD to U+0143, every other byte to its own code point; 😀 is F0 9F 98 80,
# é is C3 A9.
from attnscope.service.runtime import tokens as T  # noqa: E402


@pytest.mark.parametrize("piece, raw, partial, label", [
    ("Ġcat", b" cat", False, " cat"),
    ("Ċ", b"\n", False, "\\n"),  # a newline: the two characters backslash, n
    ("ĊĊ", b"\n\n", False, "\\n\\n"),
    ("ĉ", b"\t", False, "\\t"),
    ("č", b"\r", False, "\\r"),
    ("Ā", b"\x00", False, "\\x00"),
    ("ġ", b"\x7f", False, "\\x7f"),
    ("ĠðŁĺ", b" \xf0\x9f\x98", True, " \\xf0\\x9f\\x98"),  # GPT-2's " 😀" = 'ĠðŁĺ' + 'Ģ'
    ("Ģ", b"\x80", True, "\\x80"),
    ("ðŁĺĢ", "😀".encode(), False, "😀"),  # the whole emoji in one token
    ("Ã©", b"\xc3\xa9", False, "é"),
    ("Ã", b"\xc3", True, "\\xc3"),
    ("ÂħX", b"\xc2\x85X", False, "\\u0085X"),  # a C1 control (NEL): \u, not a byte escape
    ("\\n", b"\\n", False, "\\n"),  # the text backslash-n: same label, other bytes
])
def test_bytelevel_bytes_partial_and_label_hand_computed(piece, raw, partial, label):
    assert T.token_bytes(piece, bytelevel=True) == (raw, partial)
    assert T.bytelevel_label(piece) == label


def test_wordpiece_and_special_tokens_are_their_utf8_never_partial():
    for piece in ("##ing", "[CLS]", "café", "<|endoftext|>"):
        assert T.token_bytes(piece, bytelevel=False) == (piece.encode(), False)


def test_gpt2_tokens_carry_bytes_partial_and_visible_labels(gpt2_runtime):
    text = "Hi\n\U0001F600 é"
    tt = gpt2_runtime.tokenize(text, add_bos=True)
    got = [(t.label, t.as_dict()["bytes"], t.partial, t.special) for t in tt.tokens]
    # the bundled tokenizer (vocab 2,048) splits the emoji and é into single bytes
    assert got == [
        ("<|endoftext|>", b"<|endoftext|>".hex(), False, True),
        ("H", "48", False, False), ("i", "69", False, False), ("\\n", "0a", False, False),
        ("\\xf0", "f0", True, False), ("\\x9f", "9f", True, False),
        ("\\x98", "98", True, False), ("\\x80", "80", True, False),
        (" ", "20", False, False), ("\\xc3", "c3", True, False), ("\\xa9", "a9", True, False),
    ]
    # independent: the non-special tokens' bytes are the text's UTF-8, in order
    body = b"".join(bytes.fromhex(t.as_dict()["bytes"]) for t in tt.tokens if not t.special)
    assert body == text.encode("utf-8")


def test_bert_tokens_bytes_are_the_wordpiece_utf8(bert_runtime):
    tt = bert_runtime.tokenize("unaffable café")
    pieces = bert_runtime.tokenizer.convert_ids_to_tokens(list(tt.input_ids))
    assert pieces[0] == "[CLS]" and pieces[-1] == "[SEP]"
    for t, piece in zip(tt.tokens, pieces):
        assert t.as_dict()["bytes"] == piece.encode("utf-8").hex() and t.partial is False


def test_every_token_in_responses_has_bytes_and_partial(client):
    from attnscope.schemas.common import Token

    r = client.post("/v1/tokenize", json={"text": "a\n\U0001F600", "add_bos": False})
    assert r.status_code == 200, r.text
    toks = r.json()["tokens"]["tokens"]
    assert [(t["label"], t["bytes"], t["partial"]) for t in toks] == [
        ("a", "61", False), ("\\n", "0a", False), ("\\xf0", "f0", True), ("\\x9f", "9f", True),
        ("\\x98", "98", True), ("\\x80", "80", True)]
    assert all(Token.model_validate(t).bytes == t["bytes"] for t in toks)
    p = client.post("/v1/predictions", json={"text": "a\nb", "top_k": 3})
    assert p.status_code == 200, p.text
    res = p.json()["predictions"]
    assert {"bytes", "partial"} <= set(res["tokens"][0])
    top = [t for pos in res["positions"] for t in pos["top"]]
    assert top
    for t in top:
        raw = bytes.fromhex(t["bytes"])
        assert t["partial"] == (not _utf8(raw))


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# ------------------------------------------------------------------ a tokenizer without BOS
# (the breaker: add_bos true on such a model was a 500 TypeError on every text endpoint; Qwen2's
# real tokenizer has no BOS token)
def test_add_bos_on_a_tokenizer_without_bos_is_a_named_422(tmp_path):
    import json
    import shutil

    from attnscope.service.config import BUNDLED_MODEL_DIR, Settings
    from conftest import _client

    d = tmp_path / "nobos"
    shutil.copytree(BUNDLED_MODEL_DIR, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["bos_token"] = None
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    from attnscope.service.runtime import Runtime

    with _client(Runtime.load(Settings(model=str(d))), model=str(d)) as client:
        m = client.get("/v1/model").json()
        assert m["bos_token"] is None and m["add_bos_default"] is False
        for path, body in [("/v1/tokenize", {"text": "a b"}), ("/v1/attention", {"text": "a b"}),
                           ("/v1/run", {"texts": ["a b"]})]:
            e = assert_error(client.post(path, json={**body, "add_bos": True}), 422,
                             param="add_bos")
            assert "no BOS" in e["message"]
            r = client.post(path, json=body)  # null: the model's convention, no BOS
            assert r.status_code == 200, r.text
        assert client.get("/healthz").status_code == 200
