"""The DeepSeek-V4 engine shared by prefill and decode workers."""

from engine.errors import EngineError, InvalidRequestError, UnknownRequestError, UnsupportedCheckpointError
from engine.llm_engine import LLMEngine
from engine.sequence import CompletionOutput, RequestOutput, SamplingParams
from engine.state_transfer import SnapshotError, StateSnapshot

__all__ = [
    "CompletionOutput",
    "EngineError",
    "InvalidRequestError",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "SnapshotError",
    "StateSnapshot",
    "UnknownRequestError",
    "UnsupportedCheckpointError",
]
