"""A request's inputs, once for every endpoint: the one ``add_bos`` rule and the text / token-id
twins (docs/api.md, "Inputs").

Every field that takes a text has a token-id twin (``schemas.common.tokens_field``): ``text``
/ ``tokens``, ``texts`` / ``token_lists``, ``clean_text`` / ``clean_tokens``,
``reference_texts`` / ``reference_token_lists``, ... Texts are tokenized as plain text, BOS
prepended per ``add_bos``; token ids are used exactly as given (checked against the vocabulary
and the context, never framed).

``add_bos`` null means the model's convention (:attr:`Runtime.default_add_bos`: true for
GPT-2-family models, false for encoders), resolved here before any check, so every endpoint
and the explorer see one default and every response echoes the value used.
"""

from __future__ import annotations

from typing import Any

from attnscope.schemas.common import tokens_field
from ...errors import InvalidRequest
from ...runtime.model import Runtime
from ...runtime.results import TokenizedText


def _is_text_field(name: str) -> bool:
    return name in ("text", "texts") or name.endswith(("_text", "_texts"))


def text_fields(req) -> list[str]:
    """The request's text fields (``text``, ``texts``, ``*_text``, ``*_texts``), in schema
    order; a flag spelled like one (/v1/ablate's ``per_text: bool``) is not a text."""
    return [n for n, f in type(req).model_fields.items()
            if _is_text_field(n) and f.annotation is not bool]


def _ids_given(req) -> bool:
    """Token ids among the request's inputs, its own fields or its ``pairs``' items."""
    fields = type(req).model_fields
    if any(tokens_field(n) in fields and getattr(req, tokens_field(n)) is not None
           for n in text_fields(req)):
        return True
    return any(_ids_given(it) for it in (getattr(req, "pairs", None) or ())
               if hasattr(type(it), "model_fields"))


def _nested_text(req) -> bool:
    """A text inside a list of items (/v1/path-patch's ``pairs``: ``clean_text`` /
    ``corrupted_text``)."""
    return any(getattr(it, n, None) is not None
               for it in (getattr(req, "pairs", None) or ()) for n in text_fields(it))


def resolve_add_bos(rt: Runtime | None, req):
    """``req`` with ``add_bos`` resolved: null -> the model's convention where the request
    gives a text, False where it gives token ids only (they are used as given). Raises
    :class:`InvalidRequest` (param ``add_bos``) for ``add_bos: true`` with token ids only.
    Requests without ``add_bos`` come back unchanged."""
    if "add_bos" not in type(req).model_fields:
        return req
    has_text = any(getattr(req, n) is not None for n in text_fields(req)) or \
        _nested_text(req)
    has_ids = _ids_given(req)
    if req.add_bos is None:
        value = bool(has_text and rt is not None and rt.default_add_bos)
        return req.model_copy(update={"add_bos": value})
    if req.add_bos and has_ids and not has_text:
        bos = getattr(getattr(rt, "tokenizer", None), "bos_token_id", None)
        raise InvalidRequest(
            "add_bos applies to text only: token ids are used exactly as given"
            + (f" (put the BOS id {bos} first)" if bos is not None else ""), "add_bos")
    return req


def tokenized(rt: Runtime, req, text_field: str) -> TokenizedText | None:
    """The input ``text_field`` (e.g. ``"clean_text"``) of ``req``: its text tokenized with
    the request's (resolved) ``add_bos``, or its token-id twin (``clean_tokens``) as given;
    None when neither is set. Raises the runtime's 422s (characters, context, vocabulary),
    each naming its field."""
    text = getattr(req, text_field)
    if text is not None:
        return rt.tokenize(text, bool(req.add_bos), text_field)
    ids_field = tokens_field(text_field)
    ids = getattr(req, ids_field)
    if ids is not None:
        return rt.tokenized_from_ids(ids, ids_field)
    return None


def tokenized_list(rt: Runtime, req, texts_field: str) -> list[TokenizedText] | None:
    """The list input ``texts_field`` (e.g. ``"reference_texts"``): each text tokenized, or
    each sequence of its twin (``reference_token_lists``) as given; None when neither is set."""
    texts = getattr(req, texts_field)
    if texts is not None:
        add_bos = bool(req.add_bos)
        return [rt.tokenize(t, add_bos, f"{texts_field}.{i}") for i, t in enumerate(texts)]
    ids_field = tokens_field(texts_field)
    lists = getattr(req, ids_field)
    if lists is not None:
        return [rt.tokenized_from_ids(ids, f"{ids_field}.{i}") for i, ids in enumerate(lists)]
    return None


def list_length(req, texts_field: str) -> tuple[str, int] | None:
    """``(field, count)`` of the list input ``texts_field`` or its twin, whichever is set."""
    for name in (texts_field, tokens_field(texts_field)):
        value = getattr(req, name)
        if value is not None:
            return name, len(value)
    return None


def with_add_bos(body: Any, req) -> Any:
    """``body`` (a response dict) with ``add_bos`` (the resolved value) after ``model``,
    unless the body has one already; other bodies unchanged."""
    if not isinstance(body, dict) or "add_bos" in body or \
            "add_bos" not in type(req).model_fields:
        return body
    out = {}
    for k, v in body.items():
        out[k] = v
        if k == "model":
            out["add_bos"] = bool(req.add_bos)
    out.setdefault("add_bos", bool(req.add_bos))
    return out
