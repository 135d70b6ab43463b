"""Model code: the math of each supported architecture over the engine's paged state.

`v4` is the DeepSeek-V4 family; `step_input` is what every family's forward pass takes.
"""

from engine.model.step_input import SeqSlice, StepInput, ngram_context
from engine.model.v4 import (
    FP32_PARAMETER_SUFFIXES,
    DeepseekV4ForCausalLM,
    Experts,
    GroupedLinear,
    HyperConnection,
    HyperHead,
    Indexer,
    Router,
)

__all__ = [
    "FP32_PARAMETER_SUFFIXES",
    "DeepseekV4ForCausalLM",
    "Experts",
    "GroupedLinear",
    "HyperConnection",
    "HyperHead",
    "Indexer",
    "Router",
    "SeqSlice",
    "StepInput",
    "ngram_context",
]
