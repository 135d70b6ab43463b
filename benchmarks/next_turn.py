"""How much of a conversation's next turn the prefix cache serves, through the served API.

A conversation as an agent has it: a long system prompt (instructions, tool output), then turns
of a short user input and a short answer, each turn's request holding the whole history (the
answer as the client got it back; the reasoning of a thinking turn is not sent back, as
deepseek-recipe renders history without it). Every request goes through the gateway over HTTP
(the OpenAI SDK), greedy, thinking on and off, on the embedded mesh (`deepmesh serve`'s one
process) and, with --distributed, on every service as its own process over Kafka (the stack
`make test` uses). Per turn after the first: the cached share, `cached_tokens / prompt_tokens`,
and the most any cache could serve (the previous prompt and, without thinking, its answer: what
of them is a prefix of this prompt; for V4.1 at most all but the last 140 tokens, which it
always computes).

    python benchmarks/next_turn.py [--turns 4] [--system-tokens 2000] [--distributed] [--model D ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai

from engine.checkpoint.make_model import make_model
from engine.families import read_config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.support, as chaos_soak.py
MODEL_NAME = "deepmesh-tiny"


@contextmanager
def embedded(model: Path) -> Iterator[str]:
    from tests.support.behaviour import served_embedded

    with tempfile.TemporaryDirectory() as scratch, served_embedded(model, Path(scratch)) as url:
        yield url


@contextmanager
def distributed(model: Path) -> Iterator[str]:
    from tests.support.cluster import served_distributed

    with tempfile.TemporaryDirectory() as scratch, served_distributed(Path(scratch), model) as url:
        yield url


def conversation(url: str, thinking: bool, turns: int, system_tokens: int, keep: int) -> list[tuple[float, float]]:
    """(cached share, the most a cache could serve) of each turn after the first."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300)
    # ~2 tokens a word: a system prompt of about `system_tokens`
    system = " ".join(f"rule {i}: answer in order." for i in range(system_tokens // 8))
    history = [{"role": "system", "content": system}]
    mode = {"thinking": {"type": "enabled" if thinking else "disabled"}}
    shares, previous, answered = [], None, 0
    for turn in range(turns):
        history.append({"role": "user", "content": f"Turn {turn}: what comes next in the list, and why? " * 3})
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=history, max_tokens=48, temperature=0, extra_body=mode
        )
        prompt = reply.usage.prompt_tokens
        cached = (reply.usage.prompt_tokens_details and reply.usage.prompt_tokens_details.cached_tokens) or 0
        if previous is not None:
            # thinking: the previous prompt but its last token (`<think>`, which history renders as
            # `</think>`); without: the previous prompt and its answer (if its text tokenizes back
            # to the same ids: a random model's often does not)
            ideal = min(previous - 1 if thinking else previous + answered, prompt - keep if keep else prompt - 1)
            shares.append((cached / prompt, ideal / prompt))
        previous, answered = prompt, reply.usage.completion_tokens
        history.append({"role": "assistant", "content": reply.choices[0].message.content or "."})
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, action="append", help="checkpoints (default: tiny and tiny-v41)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--distributed", action="store_true", help="also every service as its own process")
    args = parser.parse_args()
    models = args.model or []
    if not models:
        for preset in ("tiny", "tiny-v41"):
            path = ROOT / ".cache" / "models" / f"bench-{preset}"
            if not (path / "config.json").is_file():
                make_model(path, preset, seed=0)
            models.append(path)
    modes = [("embedded", embedded)] + ([("distributed", distributed)] if args.distributed else [])
    print("| model | mode | thinking | next-turn cached share (median, lowest) | the most a cache could |")
    print("| --- | --- | --- | ---: | ---: |")
    for model in models:
        keep = getattr(read_config(model), "prefill_keep_tokens", 0)
        for mode, serve in modes:
            with serve(model) as url:
                for thinking in (True, False):
                    shares = conversation(url, thinking, args.turns, args.system_tokens, keep)
                    got = [share for share, _ in shares]
                    ideal = [best for _, best in shares]
                    print(
                        f"| {model.name} | {mode} | {'on' if thinking else 'off'} | "
                        f"{statistics.median(got):.1%}, {min(got):.1%} | {statistics.median(ideal):.1%} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
