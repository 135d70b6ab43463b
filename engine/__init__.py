"""The DeepSeek-V4 engine shared by prefill and decode workers."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# The compiled decode graphs (engine/compiled_decode.py) are kept with the models under .cache
# unless TORCHINDUCTOR_CACHE_DIR says otherwise: set before anything imports Inductor, which
# fixes its directory on first use.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(".cache/torchinductor"))

# what `from engine import X` gives, and the module that defines it: imported on first use, so that
# a process that only reads a checkpoint's config (the tokenizer: engine.families) loads no torch
_EXPORTS = {
    "CompletionOutput": "engine.sequence",
    "EngineError": "engine.errors",
    "ImageRows": "engine.image_rows",
    "ImageSpan": "engine.sequence",
    "InvalidRequestError": "engine.errors",
    "LLMEngine": "engine.llm_engine",
    "RequestOutput": "engine.sequence",
    "SamplingParams": "engine.sequence",
    "SnapshotError": "engine.state_transfer",
    "StateSnapshot": "engine.state_transfer",
    "UnknownRequestError": "engine.errors",
    "UnsupportedCheckpointError": "engine.errors",
    "VisionEncoder": "engine.model.vision",
    "load_vision_encoder": "engine.checkpoint.vision",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # what type checkers and editors read for the names above
    from engine.checkpoint.vision import load_vision_encoder  # noqa: F401
    from engine.errors import EngineError, InvalidRequestError, UnknownRequestError, UnsupportedCheckpointError  # noqa: F401
    from engine.image_rows import ImageRows  # noqa: F401
    from engine.llm_engine import LLMEngine  # noqa: F401
    from engine.model.vision import VisionEncoder  # noqa: F401
    from engine.sequence import CompletionOutput, ImageSpan, RequestOutput, SamplingParams  # noqa: F401
    from engine.state_transfer import SnapshotError, StateSnapshot  # noqa: F401


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # found directly from now on
    return value
