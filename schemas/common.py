"""Shared pieces of the contract: tensors on the wire, tokens, model identity, errors."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator


class StrictModel(BaseModel):
    """Base for requests: unknown fields are rejected (422), never silently ignored."""

    model_config = ConfigDict(extra="forbid")


class LenientModel(BaseModel):
    """Base for responses: unknown fields are accepted so old clients survive additive changes."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())


class Base64Tensor(LenientModel):
    """A compact tensor: raw little-endian bytes in base64, with dtype and shape.

    Decode with ``numpy.frombuffer(base64.b64decode(data), dtype="<f4" or "<f2").reshape(shape)``
    (the client's ``.numpy()`` does this). Masked attention scores are ``-inf`` here.
    """

    encoding: Literal["base64"] = Field("base64", description="Always 'base64'.")
    dtype: Literal["float16", "float32"] = Field(description="Element type, little-endian IEEE 754.")
    shape: list[int] = Field(description="Tensor shape, row-major (C order).")
    data: str = Field(description="Standard base64 of the little-endian element bytes.")


TensorField = Union[Base64Tensor, list[Any]]
"""A tensor on the wire: nested JSON lists (encoding 'json') or a Base64Tensor (encoding 'base64')."""

Encoding = Literal["json", "base64"]
WireDtype = Literal["float32", "float16"]


class TensorOptions(StrictModel):
    """How tensors in a response are encoded (mixin for requests)."""

    encoding: Encoding = Field(
        "json",
        description="'json': nested lists of numbers (optionally rounded); 'base64': "
        "{dtype, shape, data} with little-endian bytes, far smaller and faster.",
    )
    dtype: WireDtype = Field(
        "float32", description="Element type for encoding 'base64' (ignored for 'json')."
    )
    round: int | None = Field(
        None,
        ge=0,
        le=10,
        description="Decimal places for encoding 'json' (numpy round-half-even); null = full "
        "float32 precision (shortest repr that round-trips).",
    )


class Token(LenientModel):
    """One analysed token."""

    position: int = Field(description="Index in the analysed sequence (query_pos/key_pos), from 0.")
    id: int = Field(description="Vocabulary id.")
    label: str = Field(
        description="Readable text the token stands for (byte-level BPE decoded: no 'Ġ'). Bytes "
        "of a character split across tokens are shown as '\\xNN' escapes; special tokens by name."
    )
    start: int | None = Field(
        description="Character offset of the token's text in the input (inclusive); null for "
        "tokens the tokenizer or the add_bos option inserted."
    )
    end: int | None = Field(description="Character offset (exclusive); null for inserted tokens.")
    special: bool = Field(description="True for tokens inserted by the framing (BOS, [CLS], [SEP]).")


class ModelRef(LenientModel):
    """Which model produced a response."""

    id: str = Field(description="Model id: hub id or local directory name.")
    revision: str = Field(description="Hub commit hash, or 'sha256:<12 hex>' of the weights file.")


class ModelInfo(LenientModel):
    """GET /v1/model: the resident model."""

    id: str = Field(description="Model id (hub id or local directory) as loaded.")
    revision: str = Field(description="Hub commit hash, or 'sha256:<12 hex>' of the weights.")
    requested: str = Field(description="The model the settings asked for.")
    fallback: bool = Field(
        description="True when the requested model could not be had and the bundled checkpoint "
        "was loaded instead."
    )
    fallback_reason: str | None = Field(None, description="Why the fallback happened.")
    architecture: str = Field(description="Hugging Face architecture class, e.g. GPT2LMHeadModel.")
    family: str = Field(description="Adapter family: 'gpt2' or 'bert'.")
    causal: bool = Field(description="True when attention is causal (a key never follows its query).")
    n_layers: int = Field(description="Number of transformer blocks.")
    n_heads: int = Field(description="Attention heads per layer.")
    d_model: int = Field(description="Residual stream width.")
    d_head: int = Field(description="Width of one head's query/key/value.")
    n_ctx: int = Field(description="Maximum tokens per text (context length), framing included.")
    vocab_size: int = Field(description="Vocabulary size.")
    device: str = Field(description="Torch device, e.g. 'cpu' or 'cuda:0'.")
    dtype: str = Field(description="Torch dtype of the weights, e.g. 'float32'.")
    bos_token: str | None = Field(None, description="BOS token string (causal models), if any.")


class ErrorBody(LenientModel):
    type: str = Field(
        description="Machine-readable error type: validation_error, context_length_exceeded, "
        "out_of_range, batch_too_large, payload_too_large, overloaded, not_ready, not_found, "
        "method_not_allowed, unauthorized, timeout, non_finite_values, internal_error."
    )
    message: str = Field(description="Human-readable message naming the field, limit and value.")
    param: str | None = Field(None, description="The request field at fault, dotted, if any.")


class ErrorResponse(LenientModel):
    """The one error envelope of every non-2xx response."""

    error: ErrorBody


def _not_blank(v: str) -> str:
    if not v.strip():
        raise ValueError("text must contain at least one non-whitespace character")
    return v


NonBlankText = Annotated[str, AfterValidator(_not_blank)]


class TextOrTexts(StrictModel):
    """Mixin: exactly one of ``text`` or ``texts``."""

    text: str | None = Field(
        None, description="One text. Always treated as text: strings that spell special tokens "
        "are tokenized as plain text."
    )
    texts: list[NonBlankText] | None = Field(
        None, description="Several texts (a batch), analysed independently; results in order."
    )
    add_bos: bool = Field(
        False,
        description="Causal models: prepend the BOS token (default off, as the source "
        "documents do). Encoders always get their usual framing ([CLS] ... [SEP]).",
    )

    @model_validator(mode="after")
    def _one_of(self):
        if (self.text is None) == (self.texts is None):
            raise ValueError("give exactly one of 'text' or 'texts'")
        return self

    @field_validator("text")
    @classmethod
    def _text_not_blank(cls, v):
        if v is not None and not v.strip():
            raise ValueError("text must contain at least one non-whitespace character")
        return v

    @field_validator("texts")
    @classmethod
    def _texts_not_empty(cls, v):
        if v is not None and len(v) == 0:
            raise ValueError("texts must hold at least 1 text")
        return v

    def all_texts(self) -> list[str]:
        return [self.text] if self.text is not None else list(self.texts or [])
