"""Decode speed under a JSON-schema constraint: the same batch of requests decoded free and
constrained, in alternating rounds of one engine (this machine is noisy), as tokens/s and
their ratio (target: constrained >= 0.9x free).

Constrained requests follow a schema whose answer cannot end before the tokens run out (an
array of at least 500 strings), so both runs decode the same number of tokens; free ones ignore
the end of sequence for the same reason. Two schemas: strings of lowercase letters and spaces
(`letters`: a random-weight model's free choice is refused most of the time, the worst case
for the sampler's check-first path) and strings of any text (`text`: refused mostly where the
JSON around the strings forces a token, closer to a trained model, which writes what the
schema asks most of the time).

    python benchmarks/structured_outputs.py [--batch 32 --max-tokens 64 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine import LLMEngine, SamplingParams
from engine.checkpoint.make_model import make_model
from tokenizer_svc.constraints import Markup, output_grammar

ROOT = Path(__file__).resolve().parent.parent
STRINGS = {"letters": {"type": "string", "pattern": "^[a-z ]{0,24}$"}, "text": {"type": "string", "maxLength": 24}}


def schema(strings: dict) -> dict:
    """An answer that cannot end before the tokens run out: as many tokens as a free run."""
    return {
        "type": "object",
        "properties": {"notes": {"type": "array", "items": strings, "minItems": 500}},
        "required": ["notes"],
        "additionalProperties": False,
    }


def decode_rate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """Decode tokens/s of the batch, counting only steps after every prompt is in (the decode phase)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    tokens, elapsed = 0, 0.0
    while engine.has_unfinished_requests():
        prefilling = any(seq.num_pending > 1 for seq in engine.scheduler.running) or engine.scheduler.waiting
        started = time.perf_counter()
        outputs = engine.step()
        if not prefilling:
            elapsed += time.perf_counter() - started
            tokens += sum(len(out.new_token_ids) for out in outputs)
    return tokens / elapsed, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / ".cache/models/tiny")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        make_model(args.model, "tiny", seed=0)
    engine = LLMEngine.from_pretrained(args.model, max_num_seqs=args.batch)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 50_000, (40,), generator=generator).tolist() for _ in range(args.batch)]
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    decode_rate(engine, prompts[:2], free)  # warm up
    medians = {}
    for name, strings in STRINGS.items():
        grammar = output_grammar("json", json.dumps(schema(strings)), thinking=False, markup=Markup(0, 0))
        constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0, grammar=grammar)
        ratios = []
        for n in range(args.rounds):
            free_rate, free_tokens = decode_rate(engine, prompts, free)
            constrained_rate, constrained_tokens = decode_rate(engine, prompts, constrained)
            ratios.append(constrained_rate / free_rate)
            print(
                f"{name} round {n + 1}: batch {args.batch}: free {free_rate:.0f} tokens/s ({free_tokens} tokens), "
                f"constrained {constrained_rate:.0f} tokens/s ({constrained_tokens} tokens): {ratios[-1]:.2f}x"
            )
        medians[name] = statistics.median(ratios)
    print()
    for name, median in medians.items():
        print(
            f"{name}: median constrained / free decode tokens/s at batch {args.batch}: {median:.2f}x (target >= 0.9x)"
        )


if __name__ == "__main__":
    main()
