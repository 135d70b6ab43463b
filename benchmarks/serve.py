"""Serving benchmark: time to first token, inter-token latency and throughput at several
concurrencies, the mesh embedded and distributed, with NVIDIA's aiperf as the load generator, and
the engine alone beside them (`make bench-serve`).

aiperf (the version scripts/compat pins, in .compat-venv) streams chat completions of
`--input-tokens` synthetic prompt tokens and exactly `--output-tokens` answer tokens
(`ignore_eos`), `--concurrency` requests in flight at a time, `--requests` times that many
requests per level (after a warm-up of one per slot). Its own report
(profile_export_aiperf.json) gives each row: TTFT p50 / p90, inter-token latency p50, output
tokens/s and requests/s.

- embedded: `deepmesh serve` as `make run` starts it, but with decode eager (`--no-compile`:
  compiling its graphs takes both cores for minutes), the tiny preset;
- distributed: every service its own process over the stack's Kafka (tests/support/cluster.py,
  one torch thread a process, decode eager);
- engine alone: the same numbers of prompt and answer tokens (random token ids) through one
  LLMEngine in this process (decode eager too), the same concurrency kept in flight, timed at
  its outputs.

The clients run on the same machine as the server (on this 2-core machine they take CPU from it
at high concurrency; the engine-alone row has no client at all). Prints a table, writes
benchmarks/results/serve.json and a plot, benchmarks/results/serve.png.

    python benchmarks/serve.py [--concurrency 1 8 32] [--requests 4] [--input-tokens 256]
        [--output-tokens 32] [--modes embedded distributed]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.support, as chaos_soak.py
sys.path.insert(0, str(ROOT / "scripts" / "compat"))  # the pinned clients' environment and server
import compat  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODES = ("engine alone", "embedded", "distributed")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def aiperf(base: str, work: Path, concurrency: int, requests: int, input_tokens: int, output_tokens: int) -> dict:
    """One aiperf run against `base`; its summary's numbers for the table."""
    out = work / f"aiperf-c{concurrency}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    argv = compat.command(
        f"{compat.q(compat.VENV / 'bin' / 'aiperf')} profile --model {compat.MODEL} --url {base}"
        f" --endpoint-type chat --streaming --tokenizer {compat.q(compat.rel(compat.MODEL_DIR))}"
        f" --synthetic-input-tokens-mean {input_tokens} --synthetic-input-tokens-stddev 0"
        f" --output-tokens-mean {output_tokens} --output-tokens-stddev 0 --extra-inputs ignore_eos:true"
        f" --warmup-request-count {concurrency} --request-count {requests} --concurrency {concurrency}"
        f" --random-seed 0 --artifact-dir {compat.q(compat.rel(out))} --ui-type none"
    )
    log = work / f"aiperf-c{concurrency}.log"
    # aiperf's memory-mapped dataset and its cache of them, in the work directory rather than
    # /tmp and ~/.cache/aiperf, where each run left a directory behind
    env = compat.client_env(work, offline=False) | {
        "AIPERF_DATASET_MMAP_BASE_PATH": str(work / "aiperf-mmap"),
        "AIPERF_DATASET_MMAP_CACHE_DIR": str(work / "aiperf-mmap-cache"),
    }
    process = compat.start(argv, log, env)
    try:
        process.wait(timeout=1800)
    finally:
        compat.stop(process, grace=10)
    summary_file = out / "profile_export_aiperf.json"
    if process.returncode or not summary_file.is_file():
        raise SystemExit(f"aiperf failed ({process.returncode}); the end of {log}:\n{compat.tail(log, 20)}")
    summary = json.loads(summary_file.read_text())
    errors = int((summary.get("error_request_count") or {}).get("avg") or 0)
    if errors:
        raise SystemExit(f"aiperf saw {errors} failed requests at concurrency {concurrency}: {out}")
    ttft, itl = summary["time_to_first_token"], summary["inter_token_latency"]
    return {
        "ttft_p50": ttft["p50"],
        "ttft_p90": ttft["p90"],
        "itl_p50": itl["p50"],
        "output_tokens_per_s": summary["output_token_throughput"]["avg"],
        "requests_per_s": summary["request_throughput"]["avg"],
        "requests": int(ttft.get("count") or requests),
    }


def engine_alone(concurrency: int, requests: int, input_tokens: int, output_tokens: int) -> dict:
    """`requests` prompts through one engine, `concurrency` in flight (a new one added as one
    ends), after a warm-up round; the same numbers as aiperf's, from the engine's outputs."""
    from engine import LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(compat.MODEL_DIR)
    vocab = engine.config.vocab_size
    generator = random.Random(concurrency)
    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)

    def prompt() -> list[int]:
        return [generator.randrange(1000, vocab - 1000) for _ in range(input_tokens)]

    engine.generate([prompt() for _ in range(concurrency)], params)  # warm-up
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    started = time.perf_counter()
    waiting = [f"r{i}" for i in range(requests)]
    while waiting or engine.has_unfinished_requests():
        while waiting and len(added) - len(done) < concurrency:
            request_id = waiting.pop(0)
            added[request_id] = time.perf_counter()
            engine.add_request(request_id, prompt(), params)
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
    wall = time.perf_counter() - started
    ttfts = [(first[r] - added[r]) * 1000 for r in added]
    itls = [(done[r] - first[r]) * 1000 / (output_tokens - 1) for r in added]
    return {
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p90": percentile(ttfts, 0.9),
        "itl_p50": percentile(itls, 0.5),
        "output_tokens_per_s": requests * output_tokens / wall,
        "requests_per_s": requests / wall,
        "requests": requests,
    }


@contextlib.contextmanager
def distributed(work: Path) -> Iterator[str]:
    from tests.support.cluster import served_distributed

    with served_distributed(work, compat.MODEL_DIR) as url:
        yield url


@contextlib.contextmanager
def embedded(work: Path) -> Iterator[str]:
    """`deepmesh serve` on a free port, as scripts/compat runs it (decode eager)."""
    with compat.server(work, record=False) as base:
        yield base


def plot(results: dict[str, dict[int, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (latency, throughput) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, rows in results.items():
        levels = sorted(rows)
        line = latency.plot(levels, [rows[c]["ttft_p50"] for c in levels], marker="o", label=f"{mode} p50")[0]
        latency.plot(
            levels, [rows[c]["ttft_p90"] for c in levels], ls="--", color=line.get_color(), label=f"{mode} p90"
        )
        throughput.plot(levels, [rows[c]["output_tokens_per_s"] for c in levels], marker="o", label=mode)
    levels = sorted({c for rows in results.values() for c in rows})
    for axis, label in ((latency, "time to first token (ms)"), (throughput, "output tokens/s")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(c) for c in levels])
        axis.set_xlabel("requests in flight")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle("deepmesh, tiny preset, 2 cores, aiperf (served) and the engine alone")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=4, help="requests per level, times its concurrency")
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--modes", nargs="+", choices=MODES[1:], default=list(MODES[1:]))
    args = parser.parse_args()
    install = compat.ensure_venv()
    if not (compat.MODEL_DIR / "config.json").is_file():
        subprocess.run([str(compat.DEEPMESH), "make-model", str(compat.MODEL_DIR), "--preset", "tiny"], check=True)
    work = ROOT / ".cache" / "bench-serve"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shape = (args.input_tokens, args.output_tokens)
    results: dict[str, dict[int, dict]] = {"engine alone": {}}
    for c in args.concurrency:
        results["engine alone"][c] = engine_alone(c, args.requests * c, *shape)
    servers = {"embedded": embedded, "distributed": distributed}
    for mode in args.modes:
        (work / mode).mkdir(exist_ok=True)
        with servers[mode](work / mode) as base:
            results[mode] = {c: aiperf(base, work / mode, c, args.requests * c, *shape) for c in args.concurrency}
    versions = ", ".join(f"{name} {version}" for name, version in compat.versions().items())
    print(
        f"\n{args.input_tokens} prompt tokens, {args.output_tokens} answer tokens; {versions} (install {install:.0f} s)"
    )
    print("| mode | in flight | TTFT p50 (ms) | TTFT p90 (ms) | ITL p50 (ms) | output tok/s | requests/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mode, rows in results.items():
        for c, row in sorted(rows.items()):
            print(
                f"| {mode} | {c} | {row['ttft_p50']:.1f} | {row['ttft_p90']:.1f} | {row['itl_p50']:.1f}"
                f" | {row['output_tokens_per_s']:.1f} | {row['requests_per_s']:.2f} |"
            )
    print("\nagainst the engine alone (served / alone):")
    print("| mode | in flight | TTFT p50 | output tok/s |\n| --- | ---: | ---: | ---: |")
    alone = results["engine alone"]
    for mode in args.modes:
        for c, row in sorted(results[mode].items()):
            ttft = row["ttft_p50"] / alone[c]["ttft_p50"]
            rate = row["output_tokens_per_s"] / alone[c]["output_tokens_per_s"]
            print(f"| {mode} | {c} | {ttft:.2f}x | {rate:.2f}x |")
    RESULTS.mkdir(exist_ok=True)
    meta = {"input_tokens": args.input_tokens, "output_tokens": args.output_tokens, "clients": versions}
    (RESULTS / "serve.json").write_text(json.dumps({"run": meta, "results": results}, indent=2) + "\n")
    plot(results, RESULTS / "serve.png")
    print(f"\nwrote {compat.rel(RESULTS / 'serve.json')} and {compat.rel(RESULTS / 'serve.png')}")


if __name__ == "__main__":
    main()
