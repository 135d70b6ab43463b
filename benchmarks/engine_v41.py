"""The engine on DeepSeek-V4.1 (`small-v41`: the published layout scaled down), eager and with its
compiled decode step, against this machine's floor for a decode step, in one process.

Equal random prompts, greedy decoding, every generated token timestamped from the engine's step
outputs: decode tokens/s excludes prefill, prefill tokens/s is prompt tokens over the time to the
first token. The floor is the time to read, once, every weight byte a decode step at that batch
must read (all dense weights and the output projection, the routed experts the batch's tokens
can pick, the Engram rows it looks up) at the read bandwidth measured in the same run: no step
that reads its weights from memory takes less here. The ratio is the engine's rate over it.

    python benchmarks/engine_v41.py [--batches 1 8 32] [--prompt-len 256] [--new-tokens 64]
        [--rounds 3] [--keep 140] [--no-compile]

The engine runs twice on the same prompts, decoding eager and through its compiled graphs
(engine/compiled_decode.py; the time to compile or load them is printed first), and says whether
their greedy tokens are the same. `--keep` is the prompt truncation (prefill_keep_tokens; 0: off).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from engine_vs_transformers import compiled_beside, rates, run_engine  # this folder's: its runs, timed alike

from engine import LLMEngine
from engine.checkpoint.make_model import make_model
from engine.state_cache import StateLayout

ROOT = Path(__file__).resolve().parent.parent
PRESET = "small-v41"


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second this process reads from memory: the median of summing a buffer far larger
    than the caches."""
    buffer = torch.ones(megabytes << 18)  # float32: 4 bytes each
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return buffer.numel() * 4 / statistics.median(times[1:])


def step_bytes(model: torch.nn.Module, batch: int) -> int:
    """The weight bytes one decode step of `batch` sequences reads: every parameter but the routed
    experts and the tables looked up by row (embedding, Engram), plus the experts the batch's
    tokens can pick (every layer: as many as batch x experts per token, at most all) and one row
    per token of each looked-up table."""
    config = model.config
    lookups = {"embed.weight": 1}  # rows read per token, by table
    for layer in config.engram_layer_ids:
        lookups[f"layers.{layer}.engram.embed.weight"] = len(config.engram_ngram_sizes) * config.engram_n_heads
    total = 0
    for name, parameter in model.named_parameters():
        size = parameter.numel() * parameter.element_size()
        if ".ffn.experts." in name:
            size = size * min(config.n_routed_experts, batch * config.num_experts_per_tok) // config.n_routed_experts
        elif name in lookups:
            size = batch * lookups[name] * parameter.shape[-1] * parameter.element_size()
        total += size
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help=f"a V4.1 checkpoint (default: .cache/models/{PRESET}, made)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--keep", type=int, default=140, help="prefill_keep_tokens (0: no prompt truncation)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each batch; rates are their medians")
    parser.add_argument("--no-compile", action="store_true", help="the eager engine only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/engine_v41.json")
    args = parser.parse_args()
    args.model = args.model or ROOT / ".cache/models" / PRESET
    if not (args.model / "config.json").is_file():
        make_model(args.model, PRESET, seed=0)
    torch.manual_seed(args.seed)
    options = {"max_num_seqs": max(args.batches), "max_num_batched_tokens": 2048}
    eager = LLMEngine.from_pretrained(args.model, prefill_keep_tokens=args.keep, **options)
    engines = {"eager": eager}
    config = eager.config
    parameters = sum(p.numel() for p in eager.model.parameters())
    print(f"checkpoint {args.model} ({parameters / 1e6:.0f}M parameters, fp32), prompt truncation KEEP {args.keep}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not args.no_compile and (compiled := compiled_beside(eager, options)) is not None:
        engines["compiled"] = compiled
    for engine in engines.values():
        run_engine(engine, torch.randint(3, config.vocab_size, (2, 64)), 4)  # warm-up

    header = f"{'batch':>5} | {'engine':>8} | {'prefill tok/s':>13} | {'decode tok/s':>12} | {'of floor':>8}"
    print(f"\n{args.prompt_len}-token prompts, {args.new_tokens} new tokens, greedy\n{header}\n{'-' * len(header)}")
    results = []
    for batch in args.batches:
        prompts = torch.randint(3, config.vocab_size, (batch, args.prompt_len))
        # the runs alternate round after round, the floor measured between them, and each rate is the
        # median of its rounds: this machine's speed drifts by tens of percent over minutes
        rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
        outputs: dict[str, list[list[list[int]]]] = {name: [] for name in engines}
        floors = []
        for _ in range(args.rounds):
            for name, engine in engines.items():
                tokens, start, times = run_engine(engine, prompts, args.new_tokens)
                rounds[name].append(rates(batch, args.prompt_len, start, times))
                outputs[name].append(tokens)
            floors.append(batch * read_bandwidth() / step_bytes(eager.model, batch))
        floor = statistics.median(floors)
        result = {"batch": batch, "floor_decode_tok_s": floor, "weight_bytes_per_step": step_bytes(eager.model, batch)}
        print(f"{batch:>5} | {'floor':>8} | {'':>13} | {floor:>12.1f} | weights read once at the measured bandwidth")
        for name in engines:
            prefill, decode = (statistics.median(r[i] for r in rounds[name]) for i in (0, 1))
            print(f"{batch:>5} | {name:>8} | {prefill:>13.0f} | {decode:>12.1f} | {decode / floor:>7.2f}x")
            result[name] = {"prefill_tok_s": prefill, "decode_tok_s": decode, "of_floor": decode / floor}
        if "compiled" in engines:
            eager_decode, compiled_decode = (result[name]["decode_tok_s"] for name in ("eager", "compiled"))
            same = all(tokens == outputs["eager"][0] for name in engines for tokens in outputs[name])
            print(
                f"{batch:>5} | compiled decode {compiled_decode / eager_decode:.2f}x eager; greedy tokens "
                f"{'identical' if same else 'DIFFER'} in every run of both"
            )
            result["compiled_over_eager"] = compiled_decode / eager_decode
            result["identical_greedy_output"] = same
        results.append(result)

    layout = StateLayout(config, torch.bfloat16)
    print(
        f"\nstate per sequence (bf16): {layout.slot_bytes / 2**10:.0f} KiB (window rings, open windows) "
        f"+ {layout.block_bytes / 2**10:.1f} KiB per 128-token block (KV-source layers' entries, index keys)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    compile_seconds = engines["compiled"].compiled_decode.warm_up_seconds if "compiled" in engines else None
    report = {"keep": args.keep, "runs": results, "decode_graphs_ready_seconds": compile_seconds}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
