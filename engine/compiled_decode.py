"""The decode step as one compiled graph per batch-size bucket.

torch.compile traces the model's decode forward (embedding to final hidden states) into a
single graph: every shape in it depends on the batch size and the block-table width only,
never on the routing, on which windows close or on other values (model.py keeps it so), and
the per-layer state is written in place. Batches are padded to a bucket (powers of two up
to the engine's max_num_seqs); the padding rows compute token 0 at position 0 in the
cache's scratch slot and scratch block, so they touch no sequence's state. The block-table
width is a dynamic dimension (padded to at least 2), so one graph per bucket serves every
sequence length.

Inductor keeps what it compiled on disk (TORCHINDUCTOR_CACHE_DIR, .cache/torchinductor
unless set: engine/__init__.py): a later start with the same model shape and torch loads the graphs instead of
compiling them. `warm_up` compiles every bucket before the first request.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.model import DeepseekV4ForCausalLM, StepInput
from engine.state_cache import StateCache

log = logging.getLogger(__name__)

MIN_WIDTH = 2  # a width of 1 would be specialised into a graph of its own


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two below max_batch, then max_batch itself: [1, 2, 4, ..., max_batch]."""
    buckets, size = [], 1
    while size < max_batch:
        buckets.append(size)
        size *= 2
    return [*buckets, max_batch]


def _decode_hidden(
    model: DeepseekV4ForCausalLM,
    cache: StateCache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
) -> torch.Tensor:
    return model(StepInput(input_ids, positions, slots=slots, block_tables=block_tables), cache)


def compiler_available() -> str | None:
    """Why torch.compile cannot run here (no C++ compiler for Inductor's CPU code), or None."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as error:  # any failure means no compiler
        return f"{type(error).__name__}: {error}"
    return None


class CompiledDecode:
    """Runs decode steps through compiled graphs; the engine falls back to eager when this is None."""

    def __init__(self, model: DeepseekV4ForCausalLM, cache: StateCache, max_batch: int):
        self.model, self.cache = model, cache
        self.device = model.lm_head.weight.device
        self.buckets = batch_buckets(max_batch)
        # one graph per bucket, each behind its own guards; the default limit (8) is for training loops
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, 2 * len(self.buckets) + 2)
        self._graph = torch.compile(_decode_hidden, dynamic=False, fullgraph=True)

    @classmethod
    def create(cls, model: DeepseekV4ForCausalLM, cache: StateCache, max_batch: int) -> CompiledDecode | None:
        """A compiled decode step, warmed up; None (and one log line) where compiling is unavailable."""
        reason = compiler_available()
        if reason is None:
            compiled = cls(model, cache, max_batch)
            try:
                compiled.warm_up()
                return compiled
            except Exception as error:  # a backend that cannot compile runs eager
                reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        log.warning("decode runs eager: torch.compile is unavailable here (%s)", reason)
        return None

    def bucket(self, batch: int) -> int:
        return next(size for size in self.buckets if size >= batch)

    @torch.inference_mode()
    def __call__(
        self, token_ids: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]]
    ) -> torch.Tensor:
        """Final hidden states [len(token_ids), hidden] of one decode token per sequence."""
        n = len(token_ids)
        size = self.bucket(n)
        pad = size - n
        width = max(MIN_WIDTH, *(len(table) for table in block_tables))
        scratch = self.cache.scratch_block
        tables = [table + [scratch] * (width - len(table)) for table in block_tables]
        tables += [[scratch] * width] * pad

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        block_table = tensor(tables)
        torch._dynamo.maybe_mark_dynamic(block_table, 1)
        hidden = self._graph(
            self.model,
            self.cache,
            tensor(token_ids + [0] * pad),
            tensor(positions + [0] * pad),
            tensor(slots + [self.cache.scratch_slot] * pad),
            block_table,
        )
        return hidden[:n]

    def warm_up(self) -> float:
        """Compile (or load from the disk cache) every bucket's graph; returns the seconds it took.
        Only padding rows run: no sequence's state is touched."""
        start = time.perf_counter()
        scratch = self.cache.scratch_block
        for size in self.buckets:
            bucket_start = time.perf_counter()
            self._run_padding(size, scratch)
            log.info("decode graph for batch %d ready in %.1f s", size, time.perf_counter() - bucket_start)
        seconds = time.perf_counter() - start
        log.info("%d decode graphs ready in %.1f s", len(self.buckets), seconds)
        return seconds

    @torch.inference_mode()
    def _run_padding(self, size: int, scratch: int) -> None:
        def tensor(value: int, *shape: int) -> torch.Tensor:
            return torch.full(shape, value, dtype=torch.long, device=self.device)

        block_table = tensor(scratch, size, MIN_WIDTH)
        torch._dynamo.maybe_mark_dynamic(block_table, 1)
        slots = tensor(self.cache.scratch_slot, size)
        self._graph(self.model, self.cache, tensor(0, size), tensor(0, size), slots, block_table)
