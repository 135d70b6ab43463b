"""Batch work beside interactive traffic: does a large batch slow interactive calls down, and
does interactive traffic starve the batch?

One `deepmesh serve`-style process (the embedded mesh: gateway, tokenizer, prefill and decode
over the in-process bus, the engines on the main thread, the batch runner on a thread; decode
through its compiled graphs and prefill through its compiled pieces where `deepmesh serve` would
compile them, all ready before the first round; `--no-compile`: both eager) and,
in a process of their own, interactive clients that open streaming chat calls at Poisson
arrivals and time each call's first token. In the same run:

1. interactive alone: `--rate` calls a second for `--seconds`;
2. the batch alone: `--batch` requests through the OpenAI Batch API, from submission to
   `completed`;
3. both: the same batch submitted, then the same interactive load while it runs;

`--rounds` times, since a single round on a shared machine varies by a factor of two. Prints
interactive TTFT P50/P90/P99 alone and beside the batch (target: P90 <= 1.2x), and the
batch's throughput beside light interactive traffic against alone (target: >= 80%), per
round and their medians.

    python benchmarks/priority.py [--rate 2 --seconds 20 --batch 500 --max-tokens 32 --rounds 3] [--no-compile]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import multiprocessing
import random
import socket
import statistics
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import openai
import uvicorn

from cache_svc.store import StateStore
from common.bus import MemoryBus
from common.settings import Settings
from deepmesh.cli import set_engine_threads
from deepmesh.mesh import Mesh
from engine.checkpoint.make_model import make_model
from gateway.app import create_app
from gateway.jobs import JobStore

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "deepmesh-tiny"
WORDS = "partition broker offset replica leader follower segment index consumer producer topic log".split()  # noqa: SIM905


def question(rng: random.Random) -> str:
    """A prompt of its own (no two share more than the chat template): no cache hit flatters either side."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))


def chat_body(text: str, max_tokens: int, stream: bool) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "thinking": {"type": "disabled"},
        "stream": stream,
    }


def interactive_load(url: str, rate: float, seconds: float, seed: int, max_tokens: int) -> list[tuple[float, float]]:
    """Streaming calls at Poisson arrivals for `seconds`: each call's time to its first token, and
    the share of its prompt the server found cached (its usage chunk's `cached_tokens`)."""
    return asyncio.run(_interactive_load(url, rate, seconds, seed, max_tokens))


async def _interactive_load(
    url: str, rate: float, seconds: float, seed: int, max_tokens: int
) -> list[tuple[float, float]]:
    rng = random.Random(seed)
    calls_seen: list[tuple[float, float]] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as http:

        async def call(body: dict) -> None:
            sent = time.perf_counter()
            first, usage = None, None
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():  # read to the end: the call takes its slot till then
                    if first is None and line.startswith("data: ") and '"content"' in line:
                        first = time.perf_counter() - sent
                    if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                        usage = json.loads(line[len("data: ") :])["usage"]
            if first is None or usage is None:
                raise RuntimeError(f"a call answered {response.status_code} without content or usage")
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            calls_seen.append((first, cached / usage["prompt_tokens"]))

        calls, began, at = [], time.perf_counter(), 0.0
        while True:
            at += rng.expovariate(rate)
            if at > seconds:
                break
            await asyncio.sleep(max(0.0, began + at - time.perf_counter()))
            body = {**chat_body(question(rng), max_tokens, True), "stream_options": {"include_usage": True}}
            calls.append(asyncio.create_task(call(body)))
        await asyncio.gather(*calls)
    return calls_seen


def run_batch(url: str, size: int, seed: int, max_tokens: int) -> tuple[float, str]:
    """Submit a batch of `size` requests and wait for it: seconds from submission to completed."""
    rng = random.Random(seed)
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": chat_body(question(rng), max_tokens, False),
        }
        for i in range(size)
    ]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
    started = time.perf_counter()
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.5)  # as a client would poll (often enough to time a batch of tens of seconds)
        batch = client.batches.retrieve(batch.id)
    if batch.status != "completed" or batch.request_counts.completed != size:
        raise RuntimeError(f"the batch ended {batch.status} with {batch.request_counts}")
    return time.perf_counter() - started, batch.id


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / ".cache/models/tiny")
    parser.add_argument("--rate", type=float, default=2.0, help="interactive calls per second")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the interactive load lasts")
    parser.add_argument("--batch", type=int, default=500, help="requests in the batch")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--in-flight", type=int, default=64, help="DEEPMESH_BATCH_IN_FLIGHT")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three phases (the machine is noisy)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-compile", action="store_true", help="both engines eager")
    args = parser.parse_args()
    set_engine_threads()  # as deepmesh serve: one torch thread less than the cores
    if not (args.model / "config.json").is_file():
        make_model(args.model, "tiny", seed=0)
    workdir = Path(tempfile.mkdtemp(prefix="deepmesh-priority-"))
    settings = Settings(database_url=f"sqlite:///{workdir}/cache.db", cache_dir=str(workdir / "kv"))
    bus = MemoryBus()
    # what `deepmesh serve` compiles (DEEPMESH_COMPILE_DECODE and _PREFILL, both on by default)
    compile_decode = settings.compile_decode and not args.no_compile
    compile_prefill = settings.compile_prefill and not args.no_compile
    mesh = Mesh(
        args.model,
        bus,
        StateStore.from_settings(settings),
        served_model=MODEL_NAME,
        compile_decode=compile_decode,
        compile_prefill=compile_prefill,
    )
    mesh.start([mesh.tokenizer])
    jobs = JobStore(f"sqlite:///{workdir}/jobs.db")
    app = create_app(
        bus,
        "deepmesh.",
        [MODEL_NAME],
        jobs,
        files_dir=str(workdir / "files"),
        batch_rounds=0.2,
        batch_in_flight=args.in_flight,
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    serving = threading.Thread(target=server.run, daemon=True)
    serving.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    finished = threading.Event()
    rounds: list[dict] = []

    def one_round(clients: ProcessPoolExecutor, n: int) -> dict:
        # the same load each time, on prompts of its own: the calls beside the batch must not find
        # the states of the calls alone in the cache (their own seed), nor one round another's
        def load(seed: int) -> tuple:
            return (url, args.rate, args.seconds, seed, args.max_tokens)

        print(f"round {n + 1}: interactive alone, {args.rate:g}/s for {args.seconds:g} s", flush=True)
        alone = clients.submit(interactive_load, *load(args.seed + 10 * n)).result()
        print(f"round {n + 1}: a batch of {args.batch} alone", flush=True)
        batch_alone, _ = run_batch(url, args.batch, args.seed + 10 * n + 1, args.max_tokens)
        print(f"round {n + 1}: the batch and the interactive load together", flush=True)
        together: dict = {}
        batch = threading.Thread(
            target=lambda: together.setdefault(
                "seconds", run_batch(url, args.batch, args.seed + 10 * n + 2, args.max_tokens)[0]
            )
        )
        batch.start()
        time.sleep(2.0)  # the batch is running
        beside = clients.submit(interactive_load, *load(args.seed + 10 * n + 3)).result()
        batch.join()
        return {"alone": alone, "beside": beside, "batch_alone": batch_alone, "batch_beside": together["seconds"]}

    def drive() -> None:
        try:
            # steady state: every graph ready (each one's first run is on the engine thread)
            started = time.monotonic()
            compiling = [
                e for e in (mesh.decode.engine, mesh.prefill.engine) if e.compiled_decode or e.compiled_prefill
            ]
            if compiling:
                if not all(e.wait_compiled() for e in compiling):
                    raise RuntimeError("an engine's graphs did not compile: run with --no-compile")
                print(f"compiled graphs ready in {time.monotonic() - started:.0f} s", flush=True)
            else:
                print("both engines eager", flush=True)
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
                clients.submit(time.sleep, 0).result()
                httpx.post(f"{url}/v1/chat/completions", json=chat_body("warm up", 2, False), timeout=120)
                for n in range(args.rounds):
                    rounds.append(one_round(clients, n))
        finally:
            finished.set()

    driver = threading.Thread(target=drive)
    driver.start()
    mesh.run_engines(until=finished)
    driver.join()
    server.should_exit = True
    serving.join(timeout=30)  # its shutdown runs on threads the interpreter's exit would refuse
    mesh.stop()
    jobs.close()

    ratios, shares = [], []
    for n, r in enumerate(rounds, start=1):
        # the comparison holds only between calls the cache did not answer: a repeated prompt is
        # a cache hit, with a time to first token of its own
        cached = {phase: max(share for _, share in r[phase]) for phase in ("alone", "beside")}
        for phase, found in cached.items():
            if found > 0.5:
                raise RuntimeError(f"round {n}: a call {phase} found {found:.0%} of its prompt cached: a repeat")
        alone, beside = [ttft for ttft, _ in r["alone"]], [ttft for ttft, _ in r["beside"]]
        print(f"\nround {n}: interactive calls: {len(alone)} alone, {len(beside)} beside the batch")
        print(f"the most of a call's prompt found cached: {cached['alone']:.0%} alone, {cached['beside']:.0%} beside")
        print(f"{'interactive TTFT':<28} {'P50':>8} {'P90':>8} {'P99':>8}")
        for name, values in (("alone", alone), ("beside a running batch", beside)):
            p50, p90, p99 = (percentile(values, p) for p in (50, 90, 99))
            print(f"{name:<28} {p50:>7.3f}s {p90:>7.3f}s {p99:>7.3f}s")
        ratios.append(percentile(beside, 90) / percentile(alone, 90))
        alone_rate, beside_rate = args.batch / r["batch_alone"], args.batch / r["batch_beside"]
        shares.append(beside_rate / alone_rate)
        print(
            f"batch of {args.batch}: {r['batch_alone']:.1f} s alone ({alone_rate:.2f} requests/s), "
            f"{r['batch_beside']:.1f} s beside {args.rate:g} interactive calls/s ({beside_rate:.2f} requests/s)"
        )
        print(f"P90 TTFT beside / alone {ratios[-1]:.2f}x; batch throughput beside / alone {shares[-1]:.0%}")
    print(
        f"\nmedian over {len(rounds)} rounds: P90 TTFT beside the batch / alone {statistics.median(ratios):.2f}x "
        f"(target <= 1.2x); batch throughput beside interactive traffic / alone {statistics.median(shares):.0%} "
        "(target >= 80%)"
    )


if __name__ == "__main__":
    main()
