"""Where a served request's time to first token goes, hop by hop, read from its OTel spans.

N streamed chat requests, one at a time, from a client process of its own (as a served mesh's
clients are), through the gateway (the OpenAI SDK over HTTP) on the embedded mesh and, with
--distributed, on every service as its own process over Kafka. Every service writes its spans
to one JSON-lines file (DEEPMESH_TRACE_EXPORTER=jsonl); for each request the script lines its
spans up and splits the time from the gateway receiving the request to decode sending the
first token into the hops between them:

  gateway in       the HTTP request's span starts -> the request is produced to `requests`
  to tokenizer     produced -> the tokenizer takes it (the bus)
  tokenizer        deepseek-recipe's conversion and encoding
  to prefill       the prompt produced to `prefill` -> prefill takes it (the bus; `encode` between
                   them for a request with images)
  fetch hand-off   prefill takes it -> its prefix lookup starts on a fetch thread (waking that
                   thread, and the interpreter lock while the process's other threads hold it)
  prefix lookup    the lookup in the KV cache (the cache service's HTTP API when distributed)
  prefill          the lookup's end -> prefill sends the first token (the engine computes the prompt)
  result path      the first token sent -> the client reads the first chunk (tokenizer's output
                   conversion, results, the gateway's stream), from the client's clock

and, beside the first token, the hand-over that the second token waits for:

  state persist    the hand-over's store (the prompt's state, to the KV cache)
  to decode        the store's end -> decode takes the job (prefill sends it once stored; the bus)
  decode           decode takes it -> its span ends with the second token (the state's load, a step)

Prints the medians in ms and the share of the client's TTFT, and the engine alone's prefill of
the same prompt (in this process) as the floor.

Then the issue's measure of what the mesh adds: the same token ids (`--lengths`, a fresh prompt
each round, so that no round is a cache hit) through /v1/completions with max_tokens 1, streamed,
from a raw HTTP client, against the engine alone in a process of its own (`generate`, max_tokens 1, on
the served prefill's torch threads). The two are measured in turn for each prompt, which goes
first alternating, with the mesh idle between measurements (`SETTLE_SECONDS`): this machine's
speed drifts by tens of percent within seconds, so only the difference of two measurements that
close together means anything. Prints the medians of each side, of the pairs' differences and of
their ratios. This process takes `deepmesh serve`'s torch threads (one less than its cores, unless
DEEPMESH_TORCH_THREADS or OMP_NUM_THREADS say otherwise).

    python benchmarks/ttft_breakdown.py [--requests 20] [--prompt-words 8] [--lengths 16 2048]
        [--distributed] [--model D]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.support, as chaos_soak.py
MODEL_NAME = "deepmesh-tiny"
HOPS = (
    "gateway in",
    "to tokenizer",
    "tokenizer",
    "to prefill",
    "fetch hand-off",
    "prefix lookup",
    "prefill",
    "result path",
)
# after the first token is out (prefill sends it), beside the client reading it: the hand-over
OVERLAPPED = ("state persist", "to decode", "decode")


@contextmanager
def embedded(model: Path, traces: Path) -> Iterator[str]:
    from common.tracing import setup_tracing
    from tests.support.behaviour import served_embedded

    setup_tracing("serve", "jsonl", traces)  # the default exporter
    with served_embedded(model, traces.parent) as url:
        yield url


@contextmanager
def distributed(model: Path, traces: Path) -> Iterator[str]:
    from tests.support.cluster import served_distributed

    with served_distributed(traces.parent, model, traces) as url:
        yield url


def first_chunk(client: openai.OpenAI, i: int, words: int) -> tuple[float, float]:
    """(wall-clock time sent, seconds to the first chunk) of one streamed request."""
    from tests.support.behaviour import seconds_to_first_chunk

    sent = time.time()
    return sent, seconds_to_first_chunk(client, " ".join(["why"] * words) + f" {i}?")


def spans_by_job(traces: Path) -> dict[str, list[dict]]:
    spans = [json.loads(line) for line in traces.read_text().splitlines() if line.strip()]
    by_trace: dict[str, list[dict]] = {}
    for span in spans:
        by_trace.setdefault(span["trace_id"], []).append(span)
    jobs = {}
    for trace in by_trace.values():
        job = next(
            (s["attributes"].get("deepmesh.job_id") for s in trace if "deepmesh.job_id" in s["attributes"]), None
        )
        if job is not None:
            jobs[job] = sorted(trace, key=lambda s: s["start_ns"])
    return jobs


def hops(trace: list[dict], client_ttft: float) -> dict[str, float] | None:
    """The request's hops in ms (None: a trace without the spans of a prefilled, decoded request)."""

    def first(name: str, after: int = 0) -> dict | None:
        return next((s for s in trace if s["name"] == name and s["start_ns"] >= after), None)

    http = next((s for s in trace if s["kind"] == "SERVER"), None)
    sent_requests, tokenizer = first("send requests"), first("tokenizer.prompt")
    sent_prefill, prefill = first("send prefill"), first("prefill")
    if None in (http, sent_requests, tokenizer, sent_prefill, prefill):
        return None
    lookup = first("cache.lookup", prefill["start_ns"])
    sent_decode, decode = first("send decode", prefill["start_ns"]), first("decode", prefill["start_ns"])
    if None in (lookup, sent_decode, decode):
        return None
    persists = [s for s in trace if s["name"] == "cache.put_prefix" and s["end_ns"] <= sent_decode["start_ns"]]
    persist = persists[-1] if persists else None
    first_token = first("send tokens", prefill["start_ns"])
    if persist is None or first_token is None:
        return None
    marks = [
        http["start_ns"],
        sent_requests["start_ns"],
        tokenizer["start_ns"],
        sent_prefill["start_ns"],
        prefill["start_ns"],
        lookup["start_ns"],
        lookup["end_ns"],
        first_token["end_ns"],
    ]
    times = {hop: (b - a) / 1e6 for hop, a, b in zip(HOPS, marks, marks[1:], strict=False)}
    times["result path"] = client_ttft * 1000 - (first_token["end_ns"] - http["start_ns"]) / 1e6
    # decode's span ends with its last token: the second, of two asked
    handing = [persist["start_ns"], persist["end_ns"], decode["start_ns"], decode["end_ns"]]
    times |= {hop: (b - a) / 1e6 for hop, a, b in zip(OVERLAPPED, handing, handing[1:], strict=False)}
    return times


def engine_alone(model: Path, words: int, requests: int) -> float:
    """The engine's prefill and first token for the same prompt, in this process (ms, median)."""
    import torch

    from tokenizer_svc.protocol import Codec

    codec = Codec.for_model(model, MODEL_NAME)
    times = []
    for i in range(requests):
        question = " ".join(["why"] * words) + f" {i}?"
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": question}],
            "thinking": {"type": "disabled"},
        }
        times.append(alone_ttft(model, torch.get_num_threads(), codec.prompt("chat.completions", body).token_ids))
    return statistics.median(times[1:])


def fresh_prompts(length: int, rounds: int, vocab: int) -> list[list[int]]:
    """`rounds` prompts of `length` token ids that share no first block (a fresh prefill each)."""
    import random

    generator = random.Random(length)
    return [[generator.randrange(1000, vocab) for _ in range(length)] for _ in range(rounds)]


_engine = None  # the engine alone, in a process of its own, loaded by the first call


def alone_ttft(model: Path, threads: int, prompt: list[int]) -> float:
    """In a process the mesh does not run in (its threads would hold the interpreter lock): the pairs'
    engine process, or this one before any mesh starts (`engine_alone`). ms from `generate` to its
    one token, on `threads` torch threads (the served prefill's); the engine is loaded once a process."""
    import torch

    from engine import LLMEngine, SamplingParams

    global _engine
    torch.set_num_threads(threads)
    _engine = _engine or LLMEngine.from_pretrained(model)
    started = time.perf_counter()
    _engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    return (time.perf_counter() - started) * 1000


_http: httpx.Client | None = None  # the client process's connection, kept from one call to the next


def served_ttft(url: str, prompt: list[int]) -> float:
    """In the client process: ms from sending a streamed /v1/completions (max_tokens 1) to its first
    chunk. A raw HTTP client with the body serialized before the clock starts: the server's time, not
    a client library's (the OpenAI SDK's request transform walks a 2,048-id prompt for ~36 ms)."""
    global _http
    _http = _http or httpx.Client(timeout=300)
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True})
    headers = {"content-type": "application/json"}
    started = time.perf_counter()
    with _http.stream("POST", f"{url}/v1/completions", content=body.encode(), headers=headers) as response:
        response.raise_for_status()
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
    assert first != "data: [DONE]"
    return (time.perf_counter() - started) * 1000


# between two measurements: the mesh finishes what follows an answer (the prompt's state stored,
# the job recorded), so that neither side of a pair meets the tail of the request before it
SETTLE_SECONDS = 0.2


def paired_ttft(
    url: str,
    model: Path,
    threads: int,
    prompts: dict[int, list[list[int]]],
    client: ProcessPoolExecutor,
    spawn: multiprocessing.context.BaseContext,
) -> dict[int, list[tuple[float, float]]]:
    """(engine alone, served) ms for each prompt, measured one right after the other, which goes first
    alternating: this machine's speed drifts by tens of percent within seconds, so a difference is
    only meaningful between measurements that close together. The engine alone runs in a process of
    its own, the client in another (`client`). The first pair of each length, a warm-up, is left out."""
    pairs: dict[int, list[tuple[float, float]]] = {}
    with ProcessPoolExecutor(1, mp_context=spawn) as engine:

        def measure(side: str, prompt: list[int]) -> float:
            if side == "served":
                ms = client.submit(served_ttft, url, prompt).result()
            else:
                ms = engine.submit(alone_ttft, model, threads, prompt).result()
            time.sleep(SETTLE_SECONDS)
            return ms

        for length, batch in prompts.items():
            pairs[length] = []
            for i, prompt in enumerate(batch):
                order = ("served", "alone") if i % 2 else ("alone", "served")
                ms = {side: measure(side, prompt) for side in order}
                if i:
                    pairs[length].append((ms["alone"], ms["served"]))
    return pairs


def chat_side(url: str, requests: int, words: int) -> list[tuple[float, float]]:
    """In the client process (in the mesh's, its threads would hold the mesh's interpreter lock):
    the chat requests through the OpenAI SDK, one after the other (sent times and TTFTs)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120)
    first_chunk(client, -1, words)  # warm
    return [first_chunk(client, i, words) for i in range(requests)]


def print_added(mode: str, pairs: dict[int, list[tuple[float, float]]], threads: int) -> None:
    print(f"\n{mode}: TTFT of the same token ids, served (/v1/completions, max_tokens 1) and the engine alone")
    print(f"(the engine alone in a process of its own on {threads} torch thread(s), as the served prefill; the two")
    print("measured in turn for each prompt; `added` is the median of the pairs' differences)")
    print("| prompt tokens | pairs | engine alone (ms) | served (ms) | added (ms) | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for length, measured in pairs.items():
        base = statistics.median(b for b, _ in measured)
        mesh = statistics.median(m for _, m in measured)
        added = statistics.median(m - b for b, m in measured)
        ratio = statistics.median(m / b for b, m in measured)
        print(f"| {length} | {len(measured)} | {base:.1f} | {mesh:.1f} | {added:+.1f} | {ratio:.2f}x |")


def run(mode: str, model: Path, requests: int, words: int, lengths: list[int], vocab: int) -> None:
    serve = embedded if mode == "embedded" else distributed
    prompts = {length: fresh_prompts(length, 1 + max(3, requests // 2), vocab) for length in lengths}
    import torch

    # the engine alone with the served prefill's torch threads: the cluster gives every process one
    threads = torch.get_num_threads() if mode == "embedded" else 1
    with tempfile.TemporaryDirectory() as scratch:
        traces = Path(scratch) / "traces.jsonl"
        spawn = multiprocessing.get_context("spawn")
        with serve(model, traces) as url, ProcessPoolExecutor(1, mp_context=spawn) as client:
            measured = client.submit(chat_side, url, requests, words).result()
            pairs = paired_ttft(url, model, threads, prompts, client, spawn)
            time.sleep(1.0)  # the last spans written
        jobs = spans_by_job(traces)
        rows = []
        for sent, ttft in measured:
            # a request's trace: the one whose gateway span started closest after it was sent
            trace = min(jobs.values(), key=lambda t: abs(t[0]["start_ns"] / 1e9 - sent))
            if (row := hops(trace, ttft)) is not None:
                rows.append(row | {"client TTFT": ttft * 1000})
    print(f"\n{mode}: {len(rows)} of {requests} requests traced whole (medians: they need not add up)")
    total = statistics.median(r["client TTFT"] for r in rows)
    print("| hop | median (ms) | share of TTFT |\n| --- | ---: | ---: |")
    for hop in (*HOPS, "client TTFT"):
        value = statistics.median(r[hop] for r in rows)
        print(f"| {hop} | {value:.1f} | {value / total:.0%} |")
    print("| after the first token, the hand-over: | | |")
    for hop in OVERLAPPED:
        print(f"| {hop} | {statistics.median(r[hop] for r in rows):.1f} | |")
    print_added(mode, pairs, threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--prompt-words", type=int, default=8, help="a prompt of about this many + 8 tokens")
    parser.add_argument("--lengths", type=int, nargs="*", default=[16, 2048], help="prompt tokens of the comparison")
    parser.add_argument("--distributed", action="store_true")
    args = parser.parse_args()
    from deepmesh.cli import set_engine_threads

    set_engine_threads()  # the embedded mesh and the engine alone on deepmesh serve's torch threads
    model = args.model
    if model is None:
        from engine.checkpoint.make_model import make_model

        model = ROOT / ".cache" / "models" / "bench-tiny"
        if not (model / "config.json").is_file():
            make_model(model, "tiny", seed=0)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    print(f"engine alone (prefill and first token, this process): {engine_alone(model, args.prompt_words, 10):.1f} ms")
    for mode in ("embedded", *(("distributed",) if args.distributed else ())):
        run(mode, model, args.requests, args.prompt_words, args.lengths, vocab)


if __name__ == "__main__":
    main()
