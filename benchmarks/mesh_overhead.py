"""What the mesh adds on top of the engine: the same requests, through the full pipeline and direct.

Baseline: the requests' prompts go straight into one LLMEngine in this process, all at once.
Mesh: N concurrent clients, in a process of their own, stream the same requests over HTTP
through the gateway, the in-process bus, tokenizer, prefill, the state hand-over and decode
(`deepmesh serve`'s embedded mode). Both on the same checkpoint, greedy, in the same run, with
the same work: both stop at the model's end of sequence, and the tokens each side generated
are counted (the mesh's from each stream's usage chunk) and must agree. Time to first token
is the arrival of a request's first generated token on both sides: the engine's first output,
the stream's first chunk (the tokenizer sends the role chunk with the first token's text).
Prints p50 / p99 end-to-end latency, time to first token, output tokens/s and the ratios.

    python benchmarks/mesh_overhead.py [--concurrency 16] [--max-tokens 128] [--model PATH] [--no-compile]

Both engines decode through compiled graphs (engine/compiled_decode.py) unless --no-compile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import uvicorn

from cache_svc.store import StateStore
from common.bus import MemoryBus
from common.settings import Settings
from deepmesh.mesh import Mesh
from engine import LLMEngine, SamplingParams
from engine.checkpoint.make_model import make_model
from gateway.app import create_app
from gateway.jobs import JobStore
from tokenizer_svc.protocol import Codec

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "deepmesh-tiny"


def request_body(i: int, max_tokens: int) -> dict:
    question = f"Request {i}: summarise how Kafka consumer groups share partitions, in detail."
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "thinking": {"type": "disabled"},
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def engine_round(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts into the engine at once, stepped to the end on this thread; stopping at the
    end of sequence as a chat request does."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    start = time.perf_counter()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    counts: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
            if out.finished:
                done[out.request_id] = now
    return summarise(start, first, done, counts)


def stream_clients(url: str, bodies: list[dict]) -> tuple[float, dict, dict, int]:
    """N concurrent streaming clients, started together. They run in a process of their own, on
    one event loop, so they take as little as possible from the machine the mesh runs on."""
    return asyncio.run(_stream_clients(url, bodies))


async def _stream_clients(url: str, bodies: list[dict]) -> tuple[float, dict, dict, int]:
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    counts: dict[str, int] = {}
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        health = url.replace("/v1/chat/completions", "/healthz")
        await asyncio.gather(*(http.get(health) for _ in bodies))  # connected before the clock starts
        start = asyncio.Event()

        async def client(i: int, body: dict) -> None:
            key = f"r{i}"
            await start.wait()
            async with http.stream("POST", url, json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    first.setdefault(key, time.perf_counter())
                    chunk = json.loads(line.removeprefix("data: "))
                    if chunk.get("usage"):
                        counts[key] = chunk["usage"]["completion_tokens"]
            done[key] = time.perf_counter()
            if key not in counts:
                raise RuntimeError(f"stream {key} ended without a usage chunk: its tokens cannot be counted")

        tasks = [asyncio.create_task(client(i, b)) for i, b in enumerate(bodies)]
        await asyncio.sleep(0.1)
        began = time.perf_counter()
        start.set()
        await asyncio.gather(*tasks)
    return began, first, done, counts


def measure(
    model: Path, bodies: list[dict], prompts: list[list[int]], workdir: Path, rounds: int, compile_decode: bool
):
    """Rounds of the engine alone and of the mesh, alternating, so both meet the machine in the same
    state. The mesh runs as `deepmesh serve` does: prefill and decode on this thread (the one
    thread that runs PyTorch, here and in the engine rounds), tokenizer and HTTP on others."""
    max_tokens = bodies[0]["max_tokens"]
    engine = LLMEngine.from_pretrained(model, compile_decode=compile_decode)
    engine.wait_compiled()  # steady state: the mesh's decode engine waits the same way, below
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    bus = MemoryBus()
    settings = Settings(database_url=f"sqlite:///{workdir}/cache.db", cache_dir=str(workdir / "kv"))
    store = StateStore.from_settings(settings)
    mesh = Mesh(model, bus, store, served_model=MODEL_NAME, compile_decode=compile_decode)
    mesh.decode.engine.wait_compiled()
    mesh.start([mesh.tokenizer])
    jobs = JobStore(f"sqlite:///{workdir}/jobs.db")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(bus, "deepmesh.", [MODEL_NAME], jobs), port=port, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    go, round_done = threading.Event(), threading.Event()
    measured: list[tuple] = []

    def drive() -> None:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
            clients.submit(time.sleep, 0).result()  # the client process is up before any clock starts
            httpx.post(url, json={**bodies[0], "max_tokens": 2}, timeout=120).read()  # warm-up
            round_done.set()
            for _ in range(rounds):
                go.wait()
                go.clear()
                measured.append(clients.submit(stream_clients, url, bodies).result())
                round_done.set()

    driver = threading.Thread(target=drive)
    driver.start()
    mesh.run_engines(until=round_done)  # serves the warm-up
    engine_rounds = []
    for _ in range(rounds):
        round_done.clear()
        engine_rounds.append(engine_round(engine, prompts, max_tokens))
        go.set()
        mesh.run_engines(until=round_done)
    driver.join()
    server.should_exit = True
    mesh.stop()
    jobs.close()
    mesh_rounds = [summarise(start, first, done, counts) for start, first, done, counts in measured]
    for engine_, mesh_ in zip(engine_rounds, mesh_rounds, strict=True):
        if engine_["tokens"] != mesh_["tokens"]:  # not the same work: the comparison would mean nothing
            raise RuntimeError(
                f"the engine generated {engine_['tokens']} tokens per request, the mesh {mesh_['tokens']}"
            )
    return engine_rounds, mesh_rounds


def median_round(rounds: list[dict]) -> dict:
    return sorted(rounds, key=lambda r: r["p50_s"])[len(rounds) // 2]


def summarise(start: float, first: dict[str, float], done: dict[str, float], counts: dict[str, int]) -> dict:
    latencies = [t - start for t in done.values()]
    ttfts = [t - start for t in first.values()]
    tokens = sum(counts.values())
    return {
        "tokens": dict(sorted(counts.items())),
        "p50_s": statistics.median(latencies),
        "p99_s": percentile(latencies, 0.99),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "tokens_per_s": tokens / (max(done.values()) - start),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / ".cache/models/tiny")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each; the median one (by p50) is reported")
    parser.add_argument("--no-compile", action="store_true", help="both engines decode eager")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/mesh_overhead.json")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        make_model(args.model, "tiny", seed=0)

    bodies = [request_body(i, args.max_tokens) for i in range(args.concurrency)]
    codec = Codec.for_model(args.model, MODEL_NAME)
    prompts = [codec.prompt("chat.completions", body).token_ids for body in bodies]
    print(f"{args.concurrency} concurrent requests, {len(prompts[0])}-token prompts, {args.max_tokens} new tokens")
    with tempfile.TemporaryDirectory() as workdir:
        engine_rounds, mesh_rounds = measure(
            args.model, bodies, prompts, Path(workdir), args.rounds, not args.no_compile
        )
    for name, rounds in (("engine", engine_rounds), ("mesh", mesh_rounds)):
        p50s = ", ".join(f"{r['p50_s']:.2f} s" for r in rounds)
        print(f"{name} p50 e2e by round: {p50s}")
    engine, mesh = median_round(engine_rounds), median_round(mesh_rounds)

    header = f"{'':>10} | {'p50 e2e s':>9} | {'p99 e2e s':>9} | {'p50 TTFT s':>10} | {'p99 TTFT s':>10} | {'tok/s':>7}"
    print(header + "\n" + "-" * len(header))
    for name, r in (("engine", engine), ("mesh", mesh)):
        print(
            f"{name:>10} | {r['p50_s']:>9.2f} | {r['p99_s']:>9.2f} | {r['ttft_p50_s']:>10.2f} | "
            f"{r['ttft_p99_s']:>10.2f} | {r['tokens_per_s']:>7.1f}"
        )
    overhead = mesh["p50_s"] / engine["p50_s"]
    # each mesh round against the engine round just before it: the machine's drift cancels out
    paired = statistics.median(m["p50_s"] / e["p50_s"] for e, m in zip(engine_rounds, mesh_rounds, strict=True))
    print(f"\nmesh / engine: p50 e2e {overhead:.2f}x, p99 e2e {mesh['p99_s'] / engine['p99_s']:.2f}x, ", end="")
    print(f"tokens/s {mesh['tokens_per_s'] / engine['tokens_per_s']:.2f}x")
    print(f"median of the rounds' p50 ratios: {paired:.2f}x  (target: within 1.10x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"engine": engine, "mesh": mesh, "p50_overhead": overhead, "paired_p50_overhead": paired}
    report["rounds"] = {"engine": engine_rounds, "mesh": mesh_rounds}
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
