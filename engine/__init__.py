"""The DeepSeek-V4 engine shared by prefill and decode workers."""

import os

# The compiled decode graphs (engine/compiled_decode.py) are kept with the models under .cache
# unless TORCHINDUCTOR_CACHE_DIR says otherwise: set before anything imports Inductor, which
# fixes its directory on first use.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(".cache/torchinductor"))

from engine.checkpoint.vision import load_vision_encoder
from engine.errors import EngineError, InvalidRequestError, UnknownRequestError, UnsupportedCheckpointError
from engine.image_rows import ImageRows
from engine.llm_engine import LLMEngine
from engine.model.vision import VisionEncoder
from engine.sequence import CompletionOutput, ImageSpan, RequestOutput, SamplingParams
from engine.state_transfer import SnapshotError, StateSnapshot

__all__ = [
    "CompletionOutput",
    "EngineError",
    "ImageRows",
    "ImageSpan",
    "InvalidRequestError",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "SnapshotError",
    "StateSnapshot",
    "UnknownRequestError",
    "UnsupportedCheckpointError",
    "VisionEncoder",
    "load_vision_encoder",
]
