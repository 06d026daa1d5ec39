r"""Readable token labels, and each token's raw bytes.

Byte-level BPE (GPT-2) stores each token as a string of byte-alphabet characters ('Ġ' for a
space, 'Ã©' for the bytes of 'é'). A token's ``bytes`` are the bytes that string stands for
(GPT-2's reversible byte <-> unicode table); it is ``partial`` when those bytes are not a
whole UTF-8 sequence (a character split across byte-level tokens: 😀 is F0 9F 98 80, which
GPT-2 gives to two tokens, b' \xf0\x9f' and b'\x98\x80'). WordPiece (BERT) and special tokens:
the UTF-8 of the token string, never partial.

A label is the UTF-8 text of the bytes, made visible: bytes that are not a complete character
on their own are ``\xNN`` escapes (``\xf0\x9f``); control characters are escaped as
TransformerLens and CircuitsVis users read them, with a backslash: newline ``\n``, tab ``\t``,
carriage return ``\r`` (two characters: a backslash and a letter), the other C0 controls and
DEL ``\xNN`` (one byte each), C1 controls ``\u0085``. Everything else, backslashes included,
is the text itself, so a label can be ambiguous (the two characters ``\n`` in a text and a
newline read the same); ``bytes`` never is.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2's reversible byte <-> unicode table (Radford et al. 2019, encoder.py bytes_to_unicode).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


#: control characters written as the two-character escapes Python, TransformerLens and
#: CircuitsVis users read
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def visible(text: str) -> str:
    r"""``text`` with control characters escaped (module docstring): ``"a\nb"`` (a newline)
    is returned as the four characters ``a``, ``\``, ``n``, ``b``."""
    if text.isprintable():  # the common case, and every non-control character
        return text
    out = []
    for c in text:
        o = ord(c)
        if c in _NAMED:
            out.append(_NAMED[c])
        elif o < 32 or o == 127:
            out.append(f"\\x{o:02x}")
        elif 0x80 <= o < 0xA0:
            out.append(f"\\u{o:04x}")
        else:
            out.append(c)
    return "".join(out)


def bytelevel_bytes(token: str) -> bytes | None:
    """The raw bytes one byte-level BPE token string stands for (``"Ġcat"`` -> ``b" cat"``),
    or None when it is not made of the byte alphabet (e.g. an added special token)."""
    table = _byte_decoder()
    try:
        return bytes(table[ch] for ch in token)
    except KeyError:
        return None


def is_partial(raw: bytes) -> bool:
    """True when ``raw`` is not a whole UTF-8 sequence: it starts or ends inside a character
    (or holds a byte that UTF-8 never uses), i.e. strict decoding fails."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def bytelevel_label(token: str) -> str:
    r"""Decode one byte-level BPE token string to readable text: ``\xNN`` for the bytes of a
    split character, control characters escaped (:func:`visible`)."""
    raw = bytelevel_bytes(token)
    if raw is None:  # not a byte-alphabet token (e.g. an added special token)
        return token
    text = raw.decode("utf-8", errors="backslashreplace")  # partial bytes: \xNN already
    return visible(text)


def token_bytes(piece: str, bytelevel: bool) -> tuple[bytes, bool]:
    """``(bytes, partial)`` of one token string: a byte-level BPE piece's raw bytes, or (a
    WordPiece piece, a special token, a piece outside the byte alphabet) the UTF-8 of the
    string itself, never partial."""
    raw = bytelevel_bytes(piece) if bytelevel else None
    if raw is None:
        return piece.encode("utf-8"), False
    return raw, is_partial(raw)
