"""Content negotiation: does the ``Accept`` header ask for safetensors or JSON?"""

from __future__ import annotations

from ..errors import NotAcceptable

SAFETENSORS = "application/x-safetensors"


def wants_binary(accept: str | None) -> bool:
    """True when the ``Accept`` header prefers ``application/x-safetensors`` (q > 0) to JSON.

    Linear in the header's length (the server bounds header sizes: Settings.max_header_bytes).

    Raises:
        NotAcceptable: the header names media types, none of which we can produce, or a q
            value that is not a number (406).
    """
    if not accept or not accept.strip():
        return False  # no (or a blank) Accept header: any media type (RFC 9110 12.5.1)
    best: dict[str, float] = {}
    for part in accept.split(","):
        bits = [b.strip() for b in part.split(";")]
        media = bits[0].lower()
        if not media:
            continue
        q = 1.0
        for b in bits[1:]:
            if b[:2].lower() == "q=":
                try:
                    q = float(b[2:])
                except ValueError:
                    q = float("nan")
                if not float("-inf") < q < float("inf"):  # NaN or infinite
                    raise NotAcceptable(
                        f"Accept: the q value {b[2:][:40]!r} of {media[:60]!r} is not a number "
                        "in [0, 1]", "Accept",
                    )
                q = min(max(q, 0.0), 1.0)  # RFC 9110 12.4.2: qvalue in [0, 1]
        best[media] = max(best.get(media, 0.0), q)
    if not best:
        return False  # only separators (',', ';'): no preference stated
    st = best.get(SAFETENSORS, 0.0)
    js = max(best.get("application/json", 0.0), best.get("application/*", 0.0),
             best.get("*/*", 0.0))
    if st <= 0 and js <= 0:
        raise NotAcceptable(
            f"Accept: {accept[:120]!r} names no media type this endpoint produces; use "
            f"application/json or {SAFETENSORS}", "Accept",
        )
    return st > js or (st > 0 and st == js and "application/json" not in best)
