"""/v1/tokenize: tokens as the analyses see them."""

from __future__ import annotations


def body(rt, req, items) -> dict:
    """The response body: per text its tokens (id, label, offsets, special) and count."""
    results = [{"tokens": [t.as_dict() for t in it.tokens], "n_tokens": len(it)} for it in items]
    out: dict = {"model": rt.model_ref()}
    if req.text is not None:
        out["tokens"] = results[0]
    else:
        out["results"] = results
    return out
