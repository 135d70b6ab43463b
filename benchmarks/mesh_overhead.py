"""What the mesh adds on top of the engine: the same requests, through the full pipeline and direct.

Baseline: the requests' prompts go straight into one LLMEngine in this process, all at once.
Mesh: N concurrent clients, in a process of their own, stream the same requests over HTTP
through the gateway, the in-process bus, tokenizer, prefill, the state hand-over and decode
(`deepmesh serve`'s embedded mode). Both on the same checkpoint, greedy, in the same run. Prints p50 / p99
end-to-end latency, time to first token, output tokens/s and the overhead ratios.

    python benchmarks/mesh_overhead.py [--concurrency 16] [--max-tokens 128] [--model PATH]
"""

from __future__ import annotations

import argparse
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

from common.bus import MemoryBus
from deepmesh.mesh import Mesh
from engine import LLMEngine, SamplingParams
from engine.make_model import make_model
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
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_engine(model: Path, prompts: list[list[int]], max_tokens: int) -> dict:
    engine = LLMEngine.from_pretrained(model)
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens = 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            tokens += len(out.new_token_ids)
            if out.finished:
                done[out.request_id] = now
    return summarise(start, first, done, tokens)


def stream_clients(url: str, bodies: list[dict]) -> tuple[float, dict, dict, int]:
    """N concurrent streaming clients, started together; runs in its own process, like real clients,
    so that their HTTP and JSON work does not compete with the mesh for this process's interpreter."""
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    counts: dict[str, int] = {}
    barrier = threading.Barrier(len(bodies) + 1)

    def client(i: int, body: dict) -> None:
        key = f"r{i}"
        barrier.wait()
        with httpx.stream("POST", url, json=body, timeout=600) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
                if delta.get("content"):
                    first.setdefault(key, time.perf_counter())
                if chunk.get("usage"):
                    counts[key] = chunk["usage"]["completion_tokens"]
        done[key] = time.perf_counter()

    threads = [threading.Thread(target=client, args=(i, b)) for i, b in enumerate(bodies)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    return start, first, done, sum(counts.values())


def run_mesh(model: Path, bodies: list[dict], workdir: Path) -> dict:
    bus = MemoryBus()
    mesh = Mesh(model, bus, workdir / "state", served_model=MODEL_NAME).start()
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
    warm = {**bodies[0], "max_tokens": 2}
    httpx.post(url, json=warm, timeout=120).read()

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
        clients.submit(time.sleep, 0).result()  # the client process is up before the clock starts
        start, first, done, tokens = clients.submit(stream_clients, url, bodies).result()
    server.should_exit = True
    mesh.stop()
    jobs.close()
    return summarise(start, first, done, tokens or len(bodies) * bodies[0]["max_tokens"])


def summarise(start: float, first: dict[str, float], done: dict[str, float], tokens: int) -> dict:
    latencies = [t - start for t in done.values()]
    ttfts = [t - start for t in first.values()]
    return {
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
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/mesh_overhead.json")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        make_model(args.model, "tiny", seed=0)

    bodies = [request_body(i, args.max_tokens) for i in range(args.concurrency)]
    codec = Codec.for_model(args.model, MODEL_NAME)
    prompts = [codec.prompt("chat.completions", body).token_ids for body in bodies]
    print(f"{args.concurrency} concurrent requests, {len(prompts[0])}-token prompts, {args.max_tokens} new tokens")
    engine = run_engine(args.model, prompts, args.max_tokens)
    with tempfile.TemporaryDirectory() as workdir:
        mesh = run_mesh(args.model, bodies, Path(workdir))

    header = f"{'':>10} | {'p50 e2e s':>9} | {'p99 e2e s':>9} | {'p50 TTFT s':>10} | {'p99 TTFT s':>10} | {'tok/s':>7}"
    print(header + "\n" + "-" * len(header))
    for name, r in (("engine", engine), ("mesh", mesh)):
        print(
            f"{name:>10} | {r['p50_s']:>9.2f} | {r['p99_s']:>9.2f} | {r['ttft_p50_s']:>10.2f} | "
            f"{r['ttft_p99_s']:>10.2f} | {r['tokens_per_s']:>7.1f}"
        )
    overhead = mesh["p50_s"] / engine["p50_s"]
    print(f"\nmesh / engine: p50 e2e {overhead:.2f}x, p99 e2e {mesh['p99_s'] / engine['p99_s']:.2f}x, ", end="")
    print(f"tokens/s {mesh['tokens_per_s'] / engine['tokens_per_s']:.2f}x  (target: p50 within 1.10x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"engine": engine, "mesh": mesh, "p50_overhead": overhead}, indent=2) + "\n")


if __name__ == "__main__":
    main()
