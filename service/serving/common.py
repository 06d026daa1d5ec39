"""What serving modules share: the response shape of a ``text`` / ``texts`` request."""

from __future__ import annotations


def text_or_results(req, body: dict, key: str, out: list) -> dict:
    """``body`` with the one text's result under ``key`` (the request named ``text`` or ``tokens``) or
    every text's result, in order, under ``results`` (it named ``texts``)."""
    if req.single:
        body[key] = out[0]
    else:
        body["results"] = out
    return body
