"""Our engine against transformers' DeepseekV4ForCausalLM on the same checkpoint, in one process.

Equal random prompts, greedy decoding, every generated token timestamped (transformers via
a logits processor, ours via step outputs), so decode tokens/s excludes prefill and
prefill tokens/s is prompt tokens over time to the first token. Prints ratios against
transformers measured in this same run, and the engine's state size against the
theoretical minimum for the config.

    python benchmarks/engine_vs_transformers.py [--config small|tiny-vocab] [--batches 1 8 32]
        [--prompt-len 256] [--new-tokens 128] [--rounds 3] [--no-compile]

The engine runs twice on the same prompts: eager, and compiled as served (decode steps through
its compiled graphs, engine/compiled_decode.py, and prefill steps through compiled pieces,
engine/compiled_prefill.py, on a model that has them; the time to compile or load them is
printed first).

Two checkpoints: `small` (the preset: the real model's shape scaled down, with its 129,280-token
vocabulary, whose output projection dominates a step) and `tiny-vocab` (4 layers, hidden 256,
8 heads, 8 experts, hc_mult 2 and a 4,096-token vocabulary: where the layers, not the output
projection, are the step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DeepseekV4ForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList

from engine import LLMEngine, SamplingParams
from engine.checkpoint.make_model import preset_config, write_checkpoint
from engine.model import Experts, GroupedLinear, HyperConnection, HyperHead, Router
from engine.state_cache import StateLayout

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "small": preset_config("small"),
    "tiny-vocab": preset_config("tiny", hidden_size=256, num_attention_heads=8, vocab_size=4096),
}


class _Timestamps(LogitsProcessor):
    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def run_transformers(model, prompts: torch.Tensor, new_tokens: int) -> tuple[list[list[int]], float, list[float]]:
    stamps = _Timestamps()
    # the end of sequence an ordinary token, as the engine's ignore_eos makes it: left in the model's
    # own generation config, min_new_tokens would forbid that token instead of letting it be chosen
    model.generation_config.eos_token_id = None
    config = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=None
    )
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            generation_config=config,
            logits_processor=LogitsProcessorList([stamps]),
        )
    return out[:, prompts.shape[1] :].tolist(), start, stamps.times


def run_engine(engine: LLMEngine, prompts: torch.Tensor, new_tokens: int) -> tuple[list[list[int]], float, list[float]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts.tolist()):
        engine.add_request(f"bench-{i}", prompt, params)
        tokens[f"bench-{i}"] = []
    start, times = time.perf_counter(), []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
        # one timestamp per generated position, once every sequence has produced it
        while len(times) < min(len(t) for t in tokens.values()):
            times.append(time.perf_counter())
    return list(tokens.values()), start, times


def explain_differences(reference, prompts: torch.Tensor, ours: list[list[int]], theirs: list[list[int]]) -> str:
    """Where a sequence's tokens part from transformers' `generate` (its incremental decoding),
    whether ours is the argmax of transformers' own forward pass over the whole sequence so far."""
    parted = [
        (i, next(j for j, (a, b) in enumerate(zip(o, t, strict=True)) if a != b))
        for i, (o, t) in enumerate(zip(ours, theirs, strict=True))
        if o != t
    ]
    if not parted:
        return "yes"
    agree = 0
    for i, j in parted:
        with torch.no_grad():
            logits = reference(torch.tensor([prompts[i].tolist() + ours[i][:j]])).logits[0, -1]
        agree += int(logits.argmax()) == ours[i][j]
    return f"{len(parted)} differ ({agree} ours = transformers' full-forward argmax)"


def matmul_floor(model, batch: int, repeats: int = 5) -> float:
    """Seconds the weight products of one decode step take here, run alone and back to back: every
    projection at this batch (those of one input as one product, as the engine merges them; the
    routed experts: as many as the batch's tokens can pick, each with its share of the rows, in one
    batched product) and the output projection, each as one MKL call. No attention, normalisation,
    routing, mixing or sampling: no exact fp32 step takes less on this machine."""
    config = model.config
    calls = []
    merged = set()
    for name, module in model.named_modules():
        for projections in (getattr(module, "input_projections", None), getattr(module, "query_projections", None)):
            if projections is not None and not name.startswith("mtp"):
                weight = torch.cat([m.weight.detach() for m in projections.modules])
                x = torch.randn(batch, weight.shape[1])
                calls.append(lambda x=x, w=weight: torch.nn.functional.linear(x, w))
                merged.update(id(m) for m in projections.modules)
    for name, module in model.named_modules():
        if name.startswith("mtp") or name == "lm_head" or id(module) in merged:
            continue
        if isinstance(module, GroupedLinear):
            groups = module.n_groups
            weight = module.weight.view(groups, -1, module.weight.shape[1])
            x = torch.randn(groups, batch, weight.shape[2])
            calls.append(lambda x=x, w=weight: torch.bmm(x, w.transpose(1, 2)))
        elif isinstance(module, torch.nn.Linear):
            x = torch.randn(batch, module.in_features)
            calls.append(lambda x=x, w=module.weight: torch.nn.functional.linear(x, w))
        elif isinstance(module, (HyperConnection, HyperHead)):
            weight = module.fn if isinstance(module, HyperConnection) else module.hc_fn
            x = torch.randn(batch, weight.shape[1])
            calls.append(lambda x=x, w=weight: torch.nn.functional.linear(x, w))
        elif isinstance(module, Router):
            x = torch.randn(batch, config.hidden_size)
            calls.append(lambda x=x, w=module.weight: torch.nn.functional.linear(x, w))
        elif isinstance(module, Experts):
            picks = batch * config.num_experts_per_tok
            used, rows = min(config.n_routed_experts, picks), -(-picks // config.n_routed_experts)
            x = torch.randn(used, rows, config.hidden_size)
            h = torch.randn(used, rows, config.moe_intermediate_size)
            calls.append(lambda x=x, w=module.gate_up_proj[:used]: torch.bmm(x, w.transpose(1, 2)))
            calls.append(lambda h=h, w=module.down_proj[:used]: torch.bmm(h, w.transpose(1, 2)))
    hidden = torch.randn(batch, config.hidden_size)
    calls.append(lambda: model.compute_logits(hidden))
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for call in calls:
                call()
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def compiled_beside(eager: LLMEngine, options: dict) -> LLMEngine | None:
    """An engine over the eager one's model, compiled as served: its decode steps all run through
    their compiled graphs and its prefill steps through compiled pieces, compiled or
    loaded from the Inductor cache before it returns; None where none compiles."""
    compiled = LLMEngine(eager.model, weights=eager.weights, compile_decode=True, compile_prefill=True, **options)
    if not compiled.wait_compiled():
        return None
    graphs = compiled.compiled_decode
    print(f"decode graphs for batches {graphs.buckets} ready in {graphs.warm_up_seconds:.1f} s")
    if (pieces := compiled.compiled_prefill) is not None:
        print(f"prefill pieces for token buckets {pieces.buckets} ready in {pieces.warm_up_seconds:.1f} s more")
    return compiled


def rates(batch: int, prompt_len: int, start: float, times: list[float]) -> tuple[float, float]:
    prefill = batch * prompt_len / (times[0] - start)
    decode = batch * (len(times) - 1) / (times[-1] - times[0])
    return prefill, decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--model", type=Path, help="a checkpoint (default: .cache/models/CONFIG, made if missing)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/engine_vs_transformers-CONFIG.json")
    parser.add_argument("--no-compile", action="store_true", help="the eager engine only")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, alternating; rates are their medians")
    args = parser.parse_args()
    args.model = args.model or ROOT / ".cache/models" / args.config
    args.out = args.out or ROOT / f"benchmarks/results/engine_vs_transformers-{args.config}.json"
    if not (args.model / "config.json").is_file():
        write_checkpoint(args.model, CONFIGS[args.config], seed=0)
    torch.manual_seed(args.seed)
    options = {"max_num_seqs": max(args.batches), "max_num_batched_tokens": 2048}
    eager = LLMEngine.from_pretrained(args.model, **options)
    engines = {"eager": eager}
    config = eager.config
    print(f"checkpoint {args.model} ({sum(p.numel() for p in eager.model.parameters()) / 1e6:.0f}M parameters, fp32)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not args.no_compile and (compiled := compiled_beside(eager, options)) is not None:
        engines["compiled"] = compiled
    reference = DeepseekV4ForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()

    warm = torch.randint(0, config.vocab_size, (2, 64))
    run_transformers(reference, warm, 4)
    for engine in engines.values():
        run_engine(engine, warm, 4)

    results = []
    header = f"{'batch':>5} | {'engine':>12} | {'prefill tok/s':>13} | {'decode tok/s':>12} | {'identical':>9}"
    print(f"\n{args.prompt_len}-token prompts, {args.new_tokens} new tokens, greedy\n{header}\n{'-' * len(header)}")
    for batch in args.batches:
        prompts = torch.randint(0, config.vocab_size, (batch, args.prompt_len))
        # the runs alternate, round after round, and each rate is the median of its rounds: this
        # machine's speed drifts by tens of percent over minutes, which one run each would read as a ratio
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in ("transformers", *engines)}
        tokens: dict[str, list[list[int]]] = {}
        floors = []
        for _ in range(args.rounds):
            tokens["transformers"], start, times = run_transformers(reference, prompts, args.new_tokens)
            runs["transformers"].append(rates(batch, args.prompt_len, start, times))
            for name, engine in engines.items():
                tokens[name], start, times = run_engine(engine, prompts, args.new_tokens)
                runs[name].append(rates(batch, args.prompt_len, start, times))
            floors.append(batch / matmul_floor(eager.model, batch))
        median = {name: tuple(statistics.median(r[i] for r in rounds) for i in (0, 1)) for name, rounds in runs.items()}
        ref = median["transformers"]
        floor = statistics.median(floors)
        print(f"{batch:>5} | {'transformers':>12} | {ref[0]:>13.0f} | {ref[1]:>12.1f} |")
        print(f"{batch:>5} | {'matmul floor':>12} | {'':>13} | {floor:>12.1f} | the weight products alone")
        print(f"{batch:>5} | {'ratio':>12} | {'':>13} | {floor / ref[1]:>11.2f}x |")
        result = {
            "batch": batch,
            "transformers": {"prefill_tok_s": ref[0], "decode_tok_s": ref[1]},
            "matmul_floor": {"decode_tok_s": floor, "decode_ratio": floor / ref[1]},
        }
        for name in engines:
            ours = median[name]
            identical = explain_differences(reference, prompts, tokens[name], tokens["transformers"])
            print(f"{batch:>5} | {name:>12} | {ours[0]:>13.0f} | {ours[1]:>12.1f} | {identical:>9}")
            print(f"{batch:>5} | {'ratio':>12} | {ours[0] / ref[0]:>12.2f}x | {ours[1] / ref[1]:>11.2f}x |")
            result[name] = {
                "prefill_tok_s": ours[0],
                "decode_tok_s": ours[1],
                "decode_ratio": ours[1] / ref[1],
                "prefill_ratio": ours[0] / ref[0],
                "identical_greedy_output": tokens[name] == tokens["transformers"],
            }
        if "compiled" in engines:
            same = tokens["compiled"] == tokens["eager"]
            print(f"{batch:>5} | compiled tokens {'identical to' if same else 'DIFFER from'} eager")
            result["compiled_equals_eager"] = same
        results.append(result)

    print("\nstate per sequence (bf16), allocated vs theoretical minimum")
    state = []
    for name, cfg in (("this checkpoint", config), ("DeepSeek-V4 defaults", type(config).from_dict({}))):
        layout = StateLayout(cfg, torch.bfloat16)
        print(
            f"  {name:>20}: {layout.slot_bytes / 2**20:.2f} MiB per sequence (window rings, open windows) "
            f"+ {layout.block_bytes / 2**10:.1f} KiB per 128-token block (compressed entries, indexer keys)"
        )
        for tokens in (4096, 65536):
            allocated, minimum = layout.allocated_bytes(tokens), layout.minimum_bytes(tokens)
            print(
                f"  {name:>20}, {tokens:>6} tokens: {allocated / tokens:>9.1f} B/token allocated, "
                f"{minimum / tokens:>9.1f} minimum ({allocated / minimum:.3f}x)"
            )
            state.append({"config": name, "tokens": tokens, "allocated": allocated, "minimum": minimum})

    args.out.parent.mkdir(parents=True, exist_ok=True)
    compile_seconds = engines["compiled"].compiled_decode.warm_up_seconds if "compiled" in engines else None
    report = {"runs": results, "state": state, "decode_graphs_ready_seconds": compile_seconds}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
