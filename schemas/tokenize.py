"""POST /v1/tokenize."""

from __future__ import annotations

from pydantic import Field

from .common import LenientModel, ModelRef, TextOrTexts, Token
from .common import add_bos_echo


class TokenizeRequest(TextOrTexts):
    """Tokenize text(s) exactly as the analyses will (framing and add_bos included)."""


class TokenizeResult(LenientModel):
    tokens: list[Token] = Field(description="The tokens, in order.")
    n_tokens: int = Field(description="Number of tokens (framing included).")


class TokenizeResponse(LenientModel):
    model: ModelRef
    add_bos: bool = add_bos_echo()
    tokens: TokenizeResult | None = Field(None, description="For a 'text' or 'tokens' request.")
    results: list[TokenizeResult] | None = Field(None, description="For a 'texts' or 'token_lists' request, in order.")
