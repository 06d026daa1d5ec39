"""The runtime: owns torch and the model. Loads once, tokenizes, runs one recorded forward per input."""

from attnscope.service.runtime.model import ForwardResult, ModelLoadError, Runtime, TokenizedText

__all__ = ["ForwardResult", "ModelLoadError", "Runtime", "TokenizedText"]
