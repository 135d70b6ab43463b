"""llguidance against xgrammar, for the engine's constrained decoding, on this CPU and the V4
tokenizer (129,280 tokens): time to compile a JSON schema, time to compute one step's token
mask along a valid answer (one sequence, and 32 at once), and which schema features each
compiles. deepmesh uses llguidance (engine/grammar.py); xgrammar is not one of its
dependencies, so install it to compare (`.venv/bin/uv pip install xgrammar`):

    python benchmarks/grammar_libraries.py [--tokenizer .cache/models/tiny/tokenizer.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 129280

ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "customer": {"type": "string", "pattern": "^[A-Za-z ]{1,40}$"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}},
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
        },
        "express": {"type": "boolean"},
        "status": {"enum": ["new", "paid", "shipped"]},
    },
    "required": ["id", "customer", "items", "express", "status"],
    "additionalProperties": False,
}
ANSWER = {
    "id": "0f8fad5b-d9cb-469f-a165-70867728950e",
    "customer": "Ada Lovelace",
    "items": [{"sku": "kafka-book", "quantity": 2}, {"sku": "broker", "quantity": 1}],
    "express": True,
    "status": "paid",
}
FEATURES = {  # name: a schema that needs it, and an answer it forbids
    "$ref recursion": (
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {"child": {"$ref": "#/$defs/node"}},
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/node",
        },
        '{"child":{"other":1}}',
    ),
    "anyOf": ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "true"),
    "oneOf": ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, "true"),
    "allOf": (
        {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
        '{"b":1}',
    ),
    "pattern": ({"type": "string", "pattern": "^[a-z]+-[0-9]{3}$"}, '"abc-12x"'),
    "format uuid": ({"type": "string", "format": "uuid"}, '"not-a-uuid"'),
    "format date-time": ({"type": "string", "format": "date-time"}, '"yesterday"'),
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 5}, '"abcdefg"'),
    "minItems/maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}, "[1,2,3,4]"),
    "number bounds": ({"type": "number", "minimum": -1.5, "exclusiveMaximum": 10}, "12"),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^x-": {"type": "string"}}, "additionalProperties": False},
        '{"y":"1"}',
    ),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, '{"A1":1}'),
    "const": ({"const": "fixed"}, '"other"'),
    "if/then/else": ({"if": {"type": "string"}, "then": {"minLength": 5}, "else": {"type": "integer"}}, '"ab"'),
    "not": ({"not": {"type": "string"}}, '"abc"'),
}


def llguidance_side(tokenizer_file: str):
    import llguidance
    import llguidance.torch

    tokenizer = llguidance.LLTokenizer(tokenizer_file, n_vocab=VOCAB, slices=llguidance.LLTokenizer.json_slices())
    executor = llguidance.LLExecutor(num_threads=2)

    def compile_(schema: dict):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def masks(matchers: list, bitmask: torch.Tensor) -> None:
        llguidance.torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    return compile_, masks, accept


def xgrammar_side(tokenizer_file: str):
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    info = xgrammar.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_file=tokenizer_file), vocab_size=VOCAB
    )
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile_(schema: dict):
        return xgrammar.GrammarMatcher(
            compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        )

    def masks(matchers: list, bitmask: torch.Tensor) -> None:
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)

    def accept(matcher, token: int) -> None:
        assert matcher.accept_token(token)

    return compile_, masks, accept


def measure(name: str, side, answer_tokens: list[int], encode) -> dict:
    compile_, masks, accept = side
    compile_(ORDER)  # warm
    started = time.perf_counter()
    for _ in range(5):
        compile_(ORDER)
    compile_ms = (time.perf_counter() - started) / 5 * 1000
    result = {"library": name, "compile_ms": compile_ms}
    for batch in (1, 32):
        matchers = [compile_(ORDER) for _ in range(batch)]
        bitmask = torch.full((batch, (VOCAB + 31) // 32), -1, dtype=torch.int32)
        times = []
        for token in answer_tokens:
            started = time.perf_counter()
            masks(matchers, bitmask)
            times.append(time.perf_counter() - started)
            for matcher in matchers:
                accept(matcher, token)
        result[f"mask_ms_batch{batch}"] = statistics.median(times) * 1000
    result["enforced"], result["refused"], result["ignored"] = [], [], []
    for feature, (schema, forbidden) in FEATURES.items():
        try:
            matcher = compile_(schema)
        except Exception:  # refused, with an error: a 400 for the request
            result["refused"].append(feature)
            continue
        try:
            for token in encode(forbidden):
                accept(matcher, token)
        except AssertionError:
            result["enforced"].append(feature)
        else:  # compiled, yet the answer the schema forbids went through
            result["ignored"].append(feature)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=str(ROOT / ".cache/models/tiny/tokenizer.json"))
    args = parser.parse_args()
    tokenizer = Tokenizer.from_file(args.tokenizer)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    answer = encode(json.dumps(ANSWER, separators=(",", ":")))
    results = [measure("llguidance", llguidance_side(args.tokenizer), answer, encode)]
    try:
        results.append(measure("xgrammar", xgrammar_side(args.tokenizer), answer, encode))
    except ImportError:
        print("xgrammar is not installed: `.venv/bin/uv pip install xgrammar` to compare")
    print(f"\nJSON schema of an order, {len(answer)} answer tokens, vocabulary {VOCAB}:")
    print(f"{'library':<12} {'compile':>10} {'mask, 1 seq':>12} {'mask, 32 seqs':>14}")
    for r in results:
        times = f"{r['compile_ms']:>8.1f}ms {r['mask_ms_batch1']:>10.3f}ms {r['mask_ms_batch32']:>12.3f}ms"
        print(f"{r['library']:<12} {times}")
    print(f"\n{len(FEATURES)} schema features, each with an answer the schema forbids:")
    for r in results:
        print(f"{r['library']}: enforced {len(r['enforced'])}; refused with an error: {r['refused'] or 'none'};")
        print(f"    compiled but let the forbidden answer through: {r['ignored'] or 'none'}")


if __name__ == "__main__":
    main()
