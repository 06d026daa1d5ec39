"""The runtime: owns torch and the model. Loads once, tokenizes, runs one recorded forward per input."""

from attnscope.service.runtime.loading import ModelLoadError
from attnscope.service.runtime.model import Runtime
from attnscope.service.runtime.results import ForwardResult, TokenizedText

__all__ = ["ForwardResult", "ModelLoadError", "Runtime", "TokenizedText"]
