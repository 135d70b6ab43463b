"""Speculative decoding with V4's MTP module, or V4.1's DSpark, against decoding without it, in
one process.

The checkpoint (`--method mtp`) is the `tiny-vocab` config (benchmarks/engine_vs_transformers.py)
in the published layout, with its MTP module trained on the model's own greedy outputs
(`deepmesh make-model --train-drafter`, engine/checkpoint/train_drafter.py): random draft
weights would accept almost nothing. With `--method dspark` it is `tiny-v41-dspark` with the
same 4,096-token vocabulary, its DSpark stages trained so (engine/checkpoint/train_dspark.py).

Equal random prompts, greedy; decode tokens/s at each batch size with speculation off
(eager, and compiled unless --no-compile) and on for each number of drafted tokens (its verify
steps and drafts through compiled graphs too, unless --no-compile) and as served (`auto`: on
while the drafts pay, never above 4 sequences a step), the ratio against eager-off
measured in the same run, whether the tokens are the same, the share of drafts
accepted, the mean tokens a verify step adds (accepted drafts + 1) and what a speculating step
costs against a plain one (those tokens over the speed-up: the drafter's runs and the verify rows).

    python benchmarks/speculative.py [--method mtp|dspark] [--batches 1 4 16] [--drafts 1 2 3]
        [--train-steps 3000] [--prompt-len 64] [--new-tokens 96] [--rounds 3] [--no-compile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from engine import LLMEngine, SamplingParams
from engine.checkpoint.make_model import write_checkpoint
from engine.checkpoint.make_model_v41 import PRESETS_V41, write_checkpoint_v41
from engine.checkpoint.train_drafter import train_checkpoint_drafter
from engine.checkpoint.train_dspark import train_checkpoint_dspark

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_vs_transformers import CONFIGS, compiled_beside, rates

ROOT = Path(__file__).resolve().parent.parent


def run(engine: LLMEngine, prompts: torch.Tensor, new_tokens: int) -> tuple[list[list[int]], float, list[float], tuple]:
    """Greedy outputs, start, one timestamp per generated position, and (drafted, accepted, verify rows)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts.tolist()):
        engine.add_request(f"bench-{i}", prompt, params)
        tokens[f"bench-{i}"] = []
    drafted = accepted = verified = 0
    start, times = time.perf_counter(), []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        drafted, accepted = drafted + engine.last_step_drafted, accepted + engine.last_step_accepted
        verified += engine.last_step_verified
        while len(times) < min(len(t) for t in tokens.values()):
            times.append(time.perf_counter())
    return list(tokens.values()), start, times, (drafted, accepted, verified)


def make_trained(model: Path, method: str, steps: int) -> None:
    """The benchmark's checkpoint: random weights with the 4,096-token vocabulary, drafter trained."""
    started = time.perf_counter()
    if method == "mtp":
        write_checkpoint(model, CONFIGS["tiny-vocab"], seed=0, layout="deepseek")
        before, after = train_checkpoint_drafter(model, steps)
        seconds = time.perf_counter() - started
        print(f"drafter trained in {seconds:.0f} s: first draft right {before:.1%} -> {after:.1%}")
        return
    text = PRESETS_V41["tiny-v41-dspark"] | {"vocab_size": 4096, "dspark_noise_token_id": 4095}
    write_checkpoint_v41(model, text, seed=0)
    (before, _), (after, accepted) = train_checkpoint_dspark(model, steps)
    print(
        f"DSpark trained in {time.perf_counter() - started:.0f} s: first draft right {before:.1%} -> {after:.1%}, "
        f"{accepted:.2f} drafts of a block accepted"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=["mtp", "dspark"], default="mtp")
    parser.add_argument(
        "--model",
        type=Path,
        help="default: .cache/models/tiny-vocab-mtp or tiny-vocab-v41-dspark (made and trained if missing)",
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--train-steps", type=int, default=3000)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, alternating; rates are their medians")
    parser.add_argument("--no-compile", action="store_true", help="no compiled baseline")
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/speculative[-dspark].json")
    args = parser.parse_args()
    dspark = args.method == "dspark"
    args.out = args.out or ROOT / "benchmarks/results" / ("speculative-dspark.json" if dspark else "speculative.json")
    model = args.model or ROOT / ".cache/models" / ("tiny-vocab-v41-dspark" if dspark else "tiny-vocab-mtp")
    if not (model / "config.json").is_file():
        make_trained(model, args.method, args.train_steps)
    # no grammar compiler: a V4.1 tokenizer has more tokens than these models' 4,096-token vocabulary
    options = {"max_num_seqs": max(args.batches), "max_num_batched_tokens": 2048, "grammars": None}
    eager = LLMEngine.from_pretrained(model, **options)
    engines = {"off": eager}
    compiling = not args.no_compile and (compiled := compiled_beside(eager, options)) is not None
    if compiling:
        engines["off, compiled"] = compiled
    # as served: `auto` speculates while the drafts pay (k=3), never above 4 sequences a step
    auto = {"speculative": "auto"}
    if compiling:
        engines[f"{args.method} auto, compiled"] = compiled_beside(eager, options | auto)
    else:
        engines[f"{args.method} auto"] = LLMEngine(eager.model, weights=eager.weights, **(options | auto))
    for k in args.drafts:
        speculation = {"speculative": args.method, "speculative_tokens": k, "speculative_max_batch": max(args.batches)}
        # a verify step's rows are decode rows: room for every drafted row of the largest batch
        speculation["max_num_seqs"] = max(args.batches) * (k + 1)
        if compiling:  # verify steps and the drafter's rows or blocks through the graphs too
            engines[f"{args.method} k={k}, compiled"] = compiled_beside(eager, options | speculation)
        else:
            engines[f"{args.method} k={k}"] = LLMEngine(eager.model, weights=eager.weights, **(options | speculation))
    print(f"checkpoint {model}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    torch.manual_seed(0)
    warm = torch.randint(0, eager.config.vocab_size, (2, 16))
    for engine in engines.values():
        run(engine, warm, 8)

    results = []
    columns = ("batch", 5), ("engine", 22), ("decode tok/s", 12), ("vs off", 6), ("same", 4), ("accepted", 8)
    columns += ("tokens/verify", 13), ("step cost", 9)
    header = " | ".join(f"{name:>{width}}" for name, width in columns)
    print(f"\n{args.prompt_len}-token prompts, {args.new_tokens} new tokens, greedy\n{header}\n{'-' * len(header)}")
    for batch in args.batches:
        prompts = torch.randint(0, eager.config.vocab_size, (batch, args.prompt_len))
        speeds: dict[str, list[float]] = {name: [] for name in engines}
        tokens, counts = {}, {}
        for _ in range(args.rounds):  # alternating, medians: this machine's speed drifts over minutes
            for name, engine in engines.items():
                tokens[name], start, times, counts[name] = run(engine, prompts, args.new_tokens)
                speeds[name].append(rates(batch, args.prompt_len, start, times)[1])
        for name in engines:
            # against decoding without speculation the same way: eager, or through the graphs
            base = statistics.median(speeds["off, compiled" if name.endswith("compiled") else "off"])
            speed = statistics.median(speeds[name])
            drafted, accepted, verified = counts[name]
            share = f"{accepted / drafted:.0%}" if drafted else ""
            per_verify = f"{(accepted + verified) / verified:.2f}" if verified else ""
            # what a speculating step costs against a step without: its tokens over its speed-up
            cost = f"{(accepted + verified) / verified / (speed / base):.2f}x" if verified else ""
            same = tokens[name] == tokens["off"]
            if name == "off, compiled":  # against eager: what the graphs are worth
                base = statistics.median(speeds["off"])
            shown = f"{speed / base:.2f}x", "yes" if same else "NO", share, per_verify, cost
            cells = " | ".join(f"{value:>{width}}" for value, width in zip(shown, (6, 4, 8, 13, 9), strict=True))
            print(f"{batch:>5} | {name:>22} | {speed:>12.1f} | {cells}")
            results.append(
                {
                    "batch": batch,
                    "engine": name,
                    "decode_tok_s": speed,
                    "ratio_vs_off": speed / base,
                    "same_tokens": same,
                    "drafted": drafted,
                    "accepted": accepted,
                    "verify_rows": verified,
                }
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": str(model), "method": args.method, "results": results}, indent=2) + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
