"""The models tests/system/test_compiled_decode.py compiles, and how.

Their decode graphs go through AOTAutograd's eager backend: Dynamo traces the step into one
graph per bucket and functionalizes it, as for Inductor, and the engine runs it as a compiled
step (padding, inputs, guards, the direct call), in seconds. Inductor's code generation takes
about 40 s of one core per bucket of the three-layer model on a fresh machine: the module
compiles one bucket of a one-layer DeepSeek-V4 model through it, as served; benchmarks/engine_vs_transformers.py and
benchmarks/engine_v41.py compare every bucket they compile with eager, on both families.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path

from engine import LLMEngine, compiled_decode
from engine.checkpoint.make_model import preset_config, write_checkpoint
from engine.compiled_decode import DecodeModel
from engine.config import CSA, HCA, SLIDING

SLOTS = 4  # the engines' max_num_seqs: buckets 1, 2 and 4
# The hyper-connections' Sinkhorn normalisation at 3 iterations instead of 20: the loop is unrolled
# into the graphs, where 20 iterations were 40% of a decode graph's nodes. At 3, the three-layer
# model's three buckets trace in 14.5 s instead of 20.2 s (the V4.1 model's in 20.5 instead of
# 23.7 s). The compiled steps are compared with eager on the same model: the count changes nothing
# they check.
SINKHORN_ITERS = 3


def write_three_layer_model(directory: Path, layout: str = "transformers") -> Path:
    """The tiny preset with one layer of each kind (HCA, CSA and sliding-window attention; hash
    and routed MoE) instead of four: every kind of layer is compiled, in less time. In the
    published layout, with an MTP module."""
    config = preset_config(
        "tiny",
        num_hidden_layers=3,
        layer_types=[HCA, CSA, SLIDING],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        hc_sinkhorn_iters=SINKHORN_ITERS,
    )
    return write_checkpoint(directory, config, seed=1, layout=layout)


def write_one_layer_model(directory: Path) -> Path:
    """One CSA layer (window, compressor and indexer; a routed MoE): what Inductor compiles in the
    module, about a third of the three-layer model's code generation."""
    config = preset_config(
        "tiny", num_hidden_layers=1, layer_types=[CSA], mlp_layer_types=["moe"], hc_sinkhorn_iters=SINKHORN_ITERS
    )
    return write_checkpoint(directory, config, seed=1)


def write_four_layer_v41_model(directory: Path, dspark: bool = False) -> Path:
    """The tiny DeepSeek-V4.1 preset in four layers instead of six: a window-only layer with
    Engram, a ratio-2 layer, the YOCO boundary (ratio 1: a KV source choosing candidate blocks)
    and a consumer layer that shares its KV and searches its candidate blocks. `dspark`: with
    DSpark's stages, two, reading layers 1 and 3 (one each side of the boundary)."""
    from engine.checkpoint.make_model_v41 import PRESETS_V41, write_checkpoint_v41

    preset = "tiny-v41-dspark" if dspark else "tiny-v41"
    stages = dict(num_nextn_predict_layers=2, dspark_target_layer_ids=[1, 3]) if dspark else {}
    text = (
        PRESETS_V41[preset]
        | stages
        | dict(
            num_hidden_layers=4,
            compress_ratios=[0, 2, 1, 1],
            kv_source_layer_ids=[1, 2],
            index_source_layer_ids=[1, 2, 3],
            candidate_source_layer_id=2,
            engram_layer_ids=[0],
            hc_sinkhorn_iters=SINKHORN_ITERS,
        )
    )
    return write_checkpoint_v41(directory, text, seed=1)


MODELS = {"deepseek_v4": write_three_layer_model, "deepseek_v41": write_four_layer_v41_model}
# each family's model with its drafter (V4's MTP module, V4.1's DSpark stages), and that drafter
DRAFTING_MODELS = {
    "deepseek_v4": (functools.partial(write_three_layer_model, layout="deepseek"), "mtp"),
    "deepseek_v41": (functools.partial(write_four_layer_v41_model, dspark=True), "dspark"),
}
TRACED = "aot_eager"  # the backend of the module's graphs (above)


def compiled_engine(model: DecodeModel, **options) -> LLMEngine:
    """An engine whose decode graphs are all ready (traced): every decode step it runs is compiled."""
    with compiling_through(TRACED):
        engine = LLMEngine(model, max_num_seqs=SLOTS, compile_decode=True, **options)
    assert engine.compiled_decode is not None, "torch.compile is unavailable: no g++? (scripts/stack toolchain)"
    assert engine.compiled_decode.buckets == [1, 2, 4]
    assert engine.wait_compiled(), engine.compiled_decode.failure
    return engine


@contextlib.contextmanager
def compiling_through(backend: str | Callable) -> Iterator[None]:
    """Decode graphs compiled with this backend, for the engines made meanwhile (CompiledDecode makes
    its graphs as the engine is built, and compiles them later)."""
    with_default = compiled_decode.BACKEND
    compiled_decode.BACKEND = backend
    try:
        yield
    finally:
        compiled_decode.BACKEND = with_default
