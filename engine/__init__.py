"""The DeepSeek-V4 engine shared by prefill and decode workers."""

from engine.errors import EngineError, InvalidRequestError, UnknownRequestError, UnsupportedCheckpointError
from engine.llm_engine import LLMEngine
from engine.sequence import CompletionOutput, RequestOutput, SamplingParams

__all__ = [
    "CompletionOutput",
    "EngineError",
    "InvalidRequestError",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "UnknownRequestError",
    "UnsupportedCheckpointError",
]
