"""Prefill eager against prefill compiled, on one sequence's chunk, in one process.

The engine's prefill stays eager (docs/engine.md: The compiled decode step). This measures what a
compiled prefill could gain at most: torch.compile (Inductor) of the model's forward for one
exact chunk (one sequence, one start, one length), called again on the same chunk, against the
eager forward on the same chunk. A served prefill would need a graph per chunk length and
start, or a graph with those dynamic; this is the bound such work could reach.

    python benchmarks/compiled_prefill.py [--config tiny-vocab|small] [--lengths 64 256 1024]
        [--rounds 7]

Prints, per chunk length: eager and compiled milliseconds (medians of alternating rounds), their
ratio, the seconds the first compiled call took, the graphs Dynamo made of the forward (one per
stretch between graph breaks), and the largest difference of the chunk's last hidden state.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from engine import LLMEngine
from engine.checkpoint.make_model import write_checkpoint
from engine.model import SeqSlice, StepInput

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    from engine_vs_transformers import CONFIGS  # the same two checkpoints as make bench

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny-vocab")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    path = ROOT / ".cache/models" / args.config
    if not (path / "config.json").is_file():
        write_checkpoint(path, CONFIGS[args.config], seed=0)
    engine = LLMEngine.from_pretrained(path, max_num_seqs=2, max_num_batched_tokens=max(args.lengths))
    model, cache = engine.model, engine.cache
    print(f"checkpoint {path}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'chunk':>6} | {'eager ms':>9} | {'compiled ms':>11} | {'ratio':>6} | {'compile s':>9} | graphs | max diff")
    generator = torch.Generator().manual_seed(0)
    for length in args.lengths:
        slot = cache.allocate_slot()
        blocks = [cache.block_allocator.allocate() for _ in range(cache.blocks_needed(length))]
        tokens = torch.randint(0, engine.config.vocab_size, (length,), generator=generator)
        step = StepInput.of(tokens, [SeqSlice(slot, 0, length, blocks)])
        forward = torch.compile(model.forward, dynamic=False)
        counters.clear()
        with torch.inference_mode():
            eager_out = model(step, cache)
            start = time.perf_counter()
            compiled_out = forward(step, cache)
            compile_seconds = time.perf_counter() - start
            times: dict[str, list[float]] = {"eager": [], "compiled": []}
            for round_ in range(args.rounds):
                order = [("eager", model), ("compiled", forward)]
                for name, run in order if round_ % 2 == 0 else order[::-1]:
                    start = time.perf_counter()
                    run(step, cache)
                    times[name].append(time.perf_counter() - start)
        eager_ms, compiled_ms = (statistics.median(times[name]) * 1e3 for name in ("eager", "compiled"))
        graphs = counters["stats"]["unique_graphs"]
        diff = (eager_out[-1] - compiled_out[-1]).abs().max().item()
        print(
            f"{length:>6} | {eager_ms:>9.1f} | {compiled_ms:>11.1f} | {eager_ms / compiled_ms:>5.2f}x"
            f" | {compile_seconds:>9.1f} | {graphs:>6} | {diff:.1e}"
        )
        for block in blocks:
            cache.block_allocator.release(block)
        cache.release_slot(slot)


if __name__ == "__main__":
    main()
