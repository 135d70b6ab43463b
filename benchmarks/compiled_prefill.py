"""Prefill eager against prefill compiled, in one process.

Three ways to run a prefill step of one sequence (its first chunk, `--lengths` tokens) and of four
sequences at once (a quarter of the tokens each):
- eager: the model's forward, as the engine runs it without `compile_prefill`;
- pieces: what the engine runs with `compile_prefill` (engine/compiled_prefill.py): everything but
  the attention cores compiled with Inductor, one graph per token bucket, the cores eager;
- bound (`--bound`): the whole forward compiled for that one exact step (one sequence, start 0, one
  length), what a compiled prefill could gain at most; not servable as is (it would need a graph
  per chunk length, start and mix of sequences).
Then, through the engine: the time to the first token of a new prompt (`generate`, max_tokens 1, a
different prompt each round) with and without `compile_prefill`.

    python benchmarks/compiled_prefill.py [--config small|tiny-vocab | --preset small-v41]
        [--lengths 16 64 256 1024] [--rounds 7] [--bound]

`--preset`: a preset of `deepmesh make-model` instead (DeepSeek-V4.1's `tiny-v41`, `small-v41`).

Prints, per step: milliseconds (medians of alternating rounds), tokens/s, the ratio to eager, the
largest difference of the rows' final hidden states from eager's and how many rows differ by more
than 1e-3 (where a CSA layer's indexer chooses another entry at a near tie, the ~1e-6 rounding of
compiled kernels changes that row and the rows after it that read it); then the engine's TTFTs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine import LLMEngine, SamplingParams
from engine.checkpoint.make_model import make_model, write_checkpoint
from engine.model import SeqSlice, StepInput, ngram_context

ROOT = Path(__file__).resolve().parent.parent


def medians(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Each run's median seconds over `rounds`, the runs alternating in order and reversed."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(rounds):
        order = list(runs.items())
        for name, run in order if round_ % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def step_of(engine: LLMEngine, lengths: list[int], generator: torch.Generator) -> tuple[StepInput, Callable[[], None]]:
    """A prefill step of new sequences with these chunk lengths (each from position 0), and what frees their state."""
    cache = engine.cache
    slots = [cache.allocate_slot() for _ in lengths]
    blocks = [[cache.block_allocator.allocate() for _ in range(cache.blocks_needed(n))] for n in lengths]
    tokens = torch.randint(0, engine.config.vocab_size, (sum(lengths),), generator=generator)
    # each chunk a whole prompt: V4.1's consumer layers run its last `prefill_keep_tokens` rows, as the engine's do
    keep = getattr(engine.config, "prefill_keep_tokens", 0)
    keep_from = [max(0, n - keep) if keep else 0 for n in lengths]
    step = StepInput.of(
        tokens,
        [SeqSlice(slot, 0, n, table, k) for slot, n, table, k in zip(slots, lengths, blocks, keep_from, strict=True)],
    )
    if n := getattr(engine.model, "ngram_context", 0):  # V4.1's Engram windows, each chunk from its start
        chunks = tokens.split(lengths)
        step.ngram_context = torch.cat([ngram_context([], chunk.tolist(), n) for chunk in chunks])

    def free() -> None:
        for slot, table in zip(slots, blocks, strict=True):
            for block in table:
                cache.block_allocator.release(block)
            cache.release_slot(slot)

    return step, free


def step_cases(lengths: list[int]) -> list[tuple[str, list[int]]]:
    """The steps timed, labelled: one sequence's first chunk of each length, then four sequences'
    at once (a quarter of the tokens each) for lengths of 64 and more."""
    return [(f"{n}", [n]) for n in lengths] + [(f"4 x {n // 4}", [n // 4] * 4) for n in lengths if n >= 64]


def compare_steps(engine: LLMEngine, lengths: list[int], rounds: int, bound: bool) -> None:
    model, cache, pieces = engine.model, engine.cache, engine.compiled_prefill
    generator = torch.Generator().manual_seed(0)
    header = f"{'step':>10} | {'eager ms':>8} | {'pieces ms':>9} | {'x eager':>7} | {'tok/s eager':>11}"
    header += f" | {'tok/s pieces':>12}"
    print(header + (f" | {'bound ms':>8} | {'x eager':>7}" if bound else "") + " | max diff | rows > 1e-3")
    for label, case in step_cases(lengths):
        step, free = step_of(engine, case, generator)
        with torch.inference_mode():
            eager_rows = model(step, cache)
            runs = {"eager": lambda step=step: model(step, cache), "pieces": lambda step=step: pieces(step)}
            diff = (pieces(step)[0] - eager_rows).abs().amax(dim=1)
            if bound and len(case) == 1:
                whole = torch.compile(model.forward, dynamic=False)
                whole(step, cache)
                runs["bound"] = lambda step=step, whole=whole: whole(step, cache)
            ms = {name: seconds * 1e3 for name, seconds in medians(runs, rounds).items()}
        free()
        tokens = sum(case)
        line = f"{label:>10} | {ms['eager']:>8.1f} | {ms['pieces']:>9.1f} | {ms['eager'] / ms['pieces']:>6.2f}x"
        line += f" | {tokens / ms['eager'] * 1e3:>11.0f} | {tokens / ms['pieces'] * 1e3:>12.0f}"
        if bound:
            line += (
                f" | {ms['bound']:>8.1f} | {ms['eager'] / ms['bound']:>6.2f}x"
                if "bound" in ms
                else f" | {'':>8} | {'':>7}"
            )
        print(f"{line} | {diff.max().item():>8.1e} | {(diff > 1e-3).sum().item():>10}")


def compare_ttft(eager: LLMEngine, compiled: LLMEngine, lengths: list[int], rounds: int) -> None:
    """Time to the first token of a new prompt through each engine (a different prompt each round:
    nothing is cached), the two engines in turn, first one then the other (neither always runs on
    what the other left in the caches)."""
    print(f"\n{'prompt':>6} | {'TTFT eager ms':>13} | {'compiled ms':>11} | {'x eager':>7} | same token")
    generator = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for length in lengths:
        prompts = [
            torch.randint(0, eager.config.vocab_size, (length,), generator=generator).tolist() for _ in range(rounds)
        ]
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        same = True
        engines = [("eager", eager), ("compiled", compiled)]
        for prompt in prompts:
            tokens = {}
            engines.reverse()
            for name, engine in engines:
                start = time.perf_counter()
                tokens[name] = engine.generate([prompt], params)[0].token_ids
                times[name].append(time.perf_counter() - start)
            same &= tokens["eager"] == tokens["compiled"]
        eager_ms, compiled_ms = (statistics.median(times[name]) * 1e3 for name in ("eager", "compiled"))
        print(f"{length:>6} | {eager_ms:>13.1f} | {compiled_ms:>11.1f} | {eager_ms / compiled_ms:>6.2f}x | {same}")


def step_arguments(description: str) -> argparse.ArgumentParser:
    """The arguments of a script that times prefill steps: the checkpoint, the lengths, the rounds."""
    from engine_vs_transformers import CONFIGS  # the same two checkpoints as make bench

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--preset", help="a `deepmesh make-model` preset instead of --config (small-v41)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=7)
    return parser


def checkpoint_of(args: argparse.Namespace) -> Path:
    """The checkpoint `--config` or `--preset` names, made under .cache/models if missing."""
    from engine_vs_transformers import CONFIGS

    path = ROOT / ".cache/models" / (args.preset or args.config)
    if not (path / "config.json").is_file():
        make_model(path, args.preset, seed=0) if args.preset else write_checkpoint(path, CONFIGS[args.config], seed=0)
    return path


def main() -> None:
    parser = step_arguments(__doc__)
    parser.add_argument("--bound", action="store_true", help="also the whole forward compiled for each exact step")
    args = parser.parse_args()
    path = checkpoint_of(args)
    budget = max(args.lengths)
    eager = LLMEngine.from_pretrained(path, max_num_seqs=4, max_num_batched_tokens=budget)
    compiled = LLMEngine(
        eager.model, weights=eager.weights, max_num_seqs=4, max_num_batched_tokens=budget, compile_prefill=True
    )
    start = time.perf_counter()
    if not compiled.wait_compiled():
        pieces = compiled.compiled_prefill
        raise SystemExit(f"the prefill pieces did not compile: {pieces.failure if pieces else 'unavailable here'}")
    print(f"checkpoint {path}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        f"prefill pieces for buckets {compiled.compiled_prefill.buckets} ready in {time.perf_counter() - start:.1f} s\n"
    )
    compare_steps(compiled, args.lengths, args.rounds, args.bound)
    compare_ttft(eager, compiled, args.lengths, args.rounds)


if __name__ == "__main__":
    main()
