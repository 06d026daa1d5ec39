"""Readable token labels.

Byte-level BPE (GPT-2) stores each token as a string of byte-alphabet characters ('Ġ' for a
space, 'Ã©' for the bytes of 'é'). A label is the UTF-8 text those bytes stand for; bytes that
do not form a complete character on their own (a character split across tokens) are shown as
``\\xNN`` escapes, so the label is honest about what the token holds.
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


def bytelevel_label(token: str) -> str:
    """Decode one byte-level BPE token string to readable text (``\\xNN`` for partial bytes)."""
    table = _byte_decoder()
    try:
        raw = bytes(table[ch] for ch in token)
    except KeyError:  # not a byte-alphabet token (e.g. an added special token)
        return token
    text = raw.decode("utf-8", errors="backslashreplace")
    # control characters other than newline/tab/CR are shown as \xNN escapes too
    return "".join(
        f"\\x{ord(c):02x}" if (ord(c) < 32 and c not in "\n\t\r") or ord(c) == 127 else c
        for c in text
    )
