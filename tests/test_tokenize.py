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
    r0 = client.post("/v1/attention", json={"texts": [text, text]})
    assert len(r1.json()["results"][1]["tokens"]) == len(b)
    assert len(r0.json()["results"][1]["tokens"]) == len(a)
    long = " the" * 300  # 300 tokens > n_ctx 256
    for _ in range(2):  # the second time after the short texts are cached
        e = assert_error(client.post("/v1/attention", json={"texts": [text, "a", "b", long]}),
                         param="texts.3")
        assert "300" in e["message"] and "256" in e["message"]
    assert_error(client.post("/v1/attention", json={"text": long}), param="text")
    # a text exactly at n_ctx: cached, then reused under another param name with add_bos
    at = " the" * 256
    assert client.post("/v1/attention", json={"text": at, "sparse": {"top_k": 1}}).status_code == 200
    assert_error(client.post("/v1/attention", json={"texts": ["a", at], "add_bos": True}),
                 param="texts.1")
