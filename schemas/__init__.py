"""attnscope's API contract: pydantic request/response models shared by service and client.

This package imports pydantic only (no torch), so the client installs without torch.
Requests are strict (``extra="forbid"``); the client parses responses leniently.
"""

from attnscope.schemas.common import (
    Base64Tensor,
    ErrorBody,
    ErrorResponse,
    ModelInfo,
    ModelRef,
    TensorField,
    Token,
)
from attnscope.schemas.attention import AttentionRequest, AttentionResponse, AttentionResult
from attnscope.schemas.tokenize import TokenizeRequest, TokenizeResponse, TokenizeResult

__all__ = [
    "AttentionRequest",
    "AttentionResponse",
    "AttentionResult",
    "Base64Tensor",
    "ErrorBody",
    "ErrorResponse",
    "ModelInfo",
    "ModelRef",
    "TensorField",
    "Token",
    "TokenizeRequest",
    "TokenizeResponse",
    "TokenizeResult",
]
