"""attnscope's API contract: pydantic request/response models shared by service and client.

This package imports pydantic only (no torch), so the client installs without torch.
Requests are strict (``extra="forbid"``); the client parses responses leniently.
"""

from .common import (
    Base64Tensor,
    BinaryTensorRef,
    SparseTensor,
    TrilTensor,
    ErrorBody,
    ErrorResponse,
    ModelInfo,
    ModelRef,
    TensorField,
    Token,
)
from .attention import (
    AttentionRequest, AttentionResponse, AttentionResult, SparseOptions,
)
from .tokenize import TokenizeRequest, TokenizeResponse, TokenizeResult
from .heads import (
    HeadResult,
    HeadScoreSet,
    HeadsRequest,
    HeadsResponse,
    HeadThresholds,
    InductionProbe,
)
from .links import LinksRequest, LinksResponse, LinksResult
from .scratch import ScratchAttentionRequest, ScratchAttentionResponse
from .trajectories import (
    TrajectoriesRequest,
    TrajectoriesResponse,
    TrajectoryResult,
)
from .interventions import (
    AblateRequest, AblateResponse, PatchRequest, PatchResponse, PredictionsRequest,
    PredictionsResponse,
)
from .norms import NormsRequest, NormsResponse, NormsResult
from .rollout import RolloutRequest, RolloutResponse, RolloutResult
from .verify import HeadDiff, LayerDiff, VerifyRequest, VerifyResponse, VerifyResult
from .run import HooksResponse, RunRequest, RunResponse
from .lens import LogitAttributionRequest, LogitAttributionResponse, LogitLensRequest, LogitLensResponse  # noqa: E501
from .circuits import CircuitsRequest, CircuitsResponse
from .path_patch import PathPatchRequest, PathPatchResponse

__all__ = [
    "AblateRequest",
    "AblateResponse",
    "PatchRequest",
    "PatchResponse",
    "PredictionsRequest",
    "PredictionsResponse",
    "AttentionRequest",
    "AttentionResponse",
    "AttentionResult",
    "Base64Tensor",
    "BinaryTensorRef",
    "SparseOptions",
    "SparseTensor",
    "TrilTensor",
    "ErrorBody",
    "ErrorResponse",
    "HeadResult",
    "HeadScoreSet",
    "HeadsRequest",
    "HeadsResponse",
    "HeadThresholds",
    "InductionProbe",
    "LinksRequest",
    "LinksResponse",
    "LinksResult",
    "ModelInfo",
    "ModelRef",
    "ScratchAttentionRequest",
    "ScratchAttentionResponse",
    "TensorField",
    "Token",
    "TokenizeRequest",
    "TokenizeResponse",
    "TokenizeResult",
    "TrajectoriesRequest",
    "TrajectoriesResponse",
    "TrajectoryResult",
    "VerifyRequest",
    "VerifyResponse",
    "VerifyResult",
    "HeadDiff",
    "LayerDiff",
    "NormsRequest",
    "NormsResponse",
    "NormsResult",
    "RolloutRequest",
    "RolloutResponse",
    "RolloutResult",
    "HooksResponse",
    "RunRequest",
    "RunResponse",
    "LogitLensRequest",
    "LogitLensResponse",
    "LogitAttributionRequest",
    "LogitAttributionResponse",
    "CircuitsRequest",
    "CircuitsResponse",
    "PathPatchRequest",
    "PathPatchResponse",
]
