"""The runtime: owns torch and the model. Loads once, tokenizes, runs one recorded forward per input."""

from .loading import ModelLoadError
from .model import Runtime
from .results import ForwardResult, TokenizedText

__all__ = ["ForwardResult", "ModelLoadError", "Runtime", "TokenizedText"]
