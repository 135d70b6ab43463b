"""The model tests/system/test_compiled_decode.py compiles, and its graphs compiled ahead, behind
the rest of the run.

Compiling its three buckets (DeepSeek-V4's, through Inductor) takes about two minutes of one core
on a fresh machine, and most of
the `alone` part of `make test` leaves a core idle while it waits on the broker and on killed
processes. So when a serial run selects that module, `BackgroundCompile` starts this file as a
process at the lowest priority as the run starts: it compiles the same model's graphs into the
shared Inductor cache (.cache/torchinductor) on the idle core, and the module, which runs last,
waits for it and then loads its graphs from the cache. Nothing is taken on trust: the module
still compares every compiled token with the eager engine's, and where the process failed or
never ran it compiles the graphs itself.

    python -m tests.support.compiled_models DIR   # writes the model under DIR, compiles, exits
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import LLMEngine
from engine.checkpoint.make_model import preset_config, write_checkpoint
from engine.compiled_decode import DecodeModel
from engine.config import CSA, HCA, SLIDING

ROOT = Path(__file__).resolve().parents[2]
SLOTS = 4  # the engines' max_num_seqs: buckets 1, 2 and 4


def write_three_layer_model(directory: Path) -> Path:
    """The tiny preset with one layer of each kind (HCA, CSA and sliding-window attention; hash
    and routed MoE) instead of four: every kind of layer is compiled, in less time."""
    config = preset_config(
        "tiny", num_hidden_layers=3, layer_types=[HCA, CSA, SLIDING], mlp_layer_types=["hash_moe", "moe", "moe"]
    )
    return write_checkpoint(directory, config, seed=1)


def write_four_layer_v41_model(directory: Path) -> Path:
    """The tiny DeepSeek-V4.1 preset in four layers instead of six: a window-only layer with
    Engram, a ratio-2 layer, the YOCO boundary (ratio 1: a KV source choosing candidate blocks)
    and a consumer layer that shares its KV and searches its candidate blocks."""
    from engine.checkpoint.make_model_v41 import PRESETS_V41, write_checkpoint_v41

    text = PRESETS_V41["tiny-v41"] | dict(
        num_hidden_layers=4,
        compress_ratios=[0, 2, 1, 1],
        kv_source_layer_ids=[1, 2],
        index_source_layer_ids=[1, 2, 3],
        candidate_source_layer_id=2,
        engram_layer_ids=[0],
    )
    return write_checkpoint_v41(directory, text, seed=1)


MODELS = {"deepseek_v4": write_three_layer_model, "deepseek_v41": write_four_layer_v41_model}
# DeepSeek-V4's graphs go through Inductor, as served. V4.1's through AOTAutograd's eager backend:
# Dynamo traces its step into the one graph and functionalizes it as for Inductor, and the
# engine runs it as a compiled step (padding, inputs, the direct call), in 20 s instead of the
# two minutes of one core Inductor's code generation takes, which V4's module already checks
# (benchmarks/engine_v41.py compares V4.1's Inductor graphs with eager)
BACKENDS = {"deepseek_v4": "inductor", "deepseek_v41": "aot_eager"}


def compiled_engine(model: DecodeModel, backend: str = "inductor", **options) -> LLMEngine:
    """An engine whose decode graphs are all ready: every decode step it runs is compiled."""
    with compiling_through(backend):
        engine = LLMEngine(model, max_num_seqs=SLOTS, compile_decode=True, **options)
    assert engine.compiled_decode is not None, "torch.compile is unavailable: no g++? (scripts/stack toolchain)"
    assert engine.compiled_decode.buckets == [1, 2, 4]
    assert engine.wait_compiled(), engine.compiled_decode.failure
    return engine


@contextlib.contextmanager
def compiling_through(backend: str) -> Iterator[None]:
    """torch.compile with this backend for the graphs made meanwhile (CompiledDecode makes its
    graphs as the engine is built, and compiles them later)."""
    if backend == "inductor":
        yield
        return
    compile_with_default = torch.compile
    torch.compile = functools.partial(compile_with_default, backend=backend)
    try:
        yield
    finally:
        torch.compile = compile_with_default


class BackgroundCompile:
    """This file run as a process at the lowest CPU priority, so that it runs on what the tests
    leave idle, in a directory of its own that `stop` removes."""

    def __init__(self) -> None:
        self.directory = tempfile.TemporaryDirectory(prefix="compiled-ahead-")
        self.log = Path(self.directory.name) / "compile.log"
        command = [sys.executable, "-m", "tests.support.compiled_models", str(Path(self.directory.name) / "model")]
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait(self, timeout: float = 900) -> str | None:
        """Block until the process ends; None if it compiled every graph, else what went wrong."""
        try:
            returncode = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return f"still compiling after {timeout:.0f} s"
        return None if returncode == 0 else f"exited {returncode}: {self.log.read_text()[-2000:]}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.directory.cleanup()


# where the run keeps its BackgroundCompile, if it started one (tests/conftest.py)
BACKGROUND_COMPILE = pytest.StashKey[BackgroundCompile]()


def lowest_priority() -> None:
    """Nice 19 for this process, and for its session's autogroup where the kernel groups processes
    by session (sched_autogroup): there a process's nice weighs only against its own session's,
    and every service a test starts has a session of its own."""
    os.nice(19)
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text("19")


if __name__ == "__main__":
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    # Inductor checks the CPU's vector instructions under a lock every compiling process takes:
    # done here first, at normal priority, lest a service wait on the lock while this one is starved
    pick_vec_isa()
    lowest_priority()
    for family, write in MODELS.items():
        if BACKENDS[family] != "inductor":
            continue  # seconds: the module traces it itself
        start = time.perf_counter()
        engine = compiled_engine(LLMEngine.from_pretrained(write(Path(sys.argv[1]) / family)).model)
        seconds = time.perf_counter() - start
        print(f"{family}: decode graphs for buckets {engine.compiled_decode.buckets} ready in {seconds:.1f} s")
