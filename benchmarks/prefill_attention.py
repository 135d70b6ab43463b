"""A prefill step with its prompt chunks' attention fused against unfused, in one process.

TorchBackend.attention runs a prompt chunk's queries (two or more a row) through PyTorch's fused
CPU attention kernel (engine/backends.py, `fused_cpu_attention`); one query a row, and every query
before that change, runs it step by step (`unfused_attention`). This times the eager model's
forward over the same steps both ways, alternating rounds, and compares their final hidden states:
one sequence's first chunk of each `--lengths`, then four sequences' at once (a quarter each).

    python benchmarks/prefill_attention.py [--config small|tiny-vocab | --preset small-v41]
        [--lengths 16 64 256 1024] [--rounds 7]
"""

from __future__ import annotations

import torch
from compiled_prefill import checkpoint_of, medians, step_arguments, step_cases, step_of

import engine.backends
from engine import LLMEngine


def forward_with(fused: bool, model: torch.nn.Module, step: object, cache: object) -> torch.Tensor:
    """The model's eager forward over `step`, its chunks' attention fused or not."""
    engine.backends.FUSED_MIN_QUERIES = 2 if fused else 1 << 30
    return model(step, cache)


def main() -> None:
    args = step_arguments(__doc__).parse_args()
    path = checkpoint_of(args)
    llm = LLMEngine.from_pretrained(path, max_num_seqs=4, max_num_batched_tokens=max(args.lengths))
    model, cache = llm.model, llm.cache
    print(f"checkpoint {path}, torch {torch.__version__}, {torch.get_num_threads()} threads, eager steps\n")
    print(f"{'step':>10} | {'unfused ms':>10} | {'fused ms':>8} | {'x unfused':>9} | {'tok/s fused':>11} | max diff")
    generator = torch.Generator().manual_seed(0)
    for label, case in step_cases(args.lengths):
        step, free = step_of(llm, case, generator)
        with torch.inference_mode():
            diff = (forward_with(True, model, step, cache) - forward_with(False, model, step, cache)).abs().max()
            runs = {f: lambda f=f, step=step: forward_with(f, model, step, cache) for f in (False, True)}
            ms = {fused: seconds * 1e3 for fused, seconds in medians(runs, args.rounds).items()}
        free()
        print(
            f"{label:>10} | {ms[False]:>10.1f} | {ms[True]:>8.1f} | {ms[False] / ms[True]:>8.2f}x"
            f" | {sum(case) / ms[True] * 1e3:>11.0f} | {diff.item():.1e}"
        )
    engine.backends.FUSED_MIN_QUERIES = 2


if __name__ == "__main__":
    main()
