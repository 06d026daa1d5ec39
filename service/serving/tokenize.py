"""/v1/tokenize: tokens as the analyses see them."""

from __future__ import annotations

from .common import text_or_results


def body(rt, req, items) -> dict:
    """The response body: per text its tokens (id, label, offsets, special) and count."""
    results = [{"tokens": [t.as_dict() for t in it.tokens], "n_tokens": len(it)} for it in items]
    out: dict = {"model": rt.model_ref()}
    return text_or_results(req, out, "tokens", results)
