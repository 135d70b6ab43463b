"""Multi-turn conversations replayed through prefill, the KV cache and decode: how much of
each prompt the prefix cache serves, against the most any cache could, and what a hit does to
the time to first token.

Trace format: JSON lines, one request each, in arrival order:

    {"session": "c07", "turn": 2, "input": [[hash_id, n_tokens], ...], "output_tokens": 48}

A session's first prompt is its input segments. A later turn's prompt is the session's
previous prompt, the tokens generated for it, then its own input segments. A segment is
`n_tokens` token ids drawn from a generator seeded with `hash_id`, so equal hash ids are
equal text (a system prompt shared by conversations, say). A Mooncake trace line
(`{"hash_ids": [...], "input_length": n, "output_length": m}`, 512-token blocks) becomes a
one-turn session with `from_mooncake`. Without `--trace`, a seeded synthetic workload: N
conversations x T turns, most of them starting with one of a few shared system prompts.

Ideal: for each prompt, its longest prefix that repeats an earlier prompt, or an earlier
prompt followed by its output (at most all but its last token, whose logits must be
computed). Prints the hit rate against that ideal, and TTFT cold vs hit for a 4,096-token
prompt whose first 4,000 tokens are stored; writes a PNG of both over the replay.

    python benchmarks/multiturn_replay.py [--conversations 50 --turns 6 --seed 0 --trace FILE]
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prometheus_client import REGISTRY

from cache_svc.store import StateStore
from common.bus import MemoryBus
from common.messages import Envelope, PrefillPayload, Sampling, TokensPayload, decode
from common.settings import Settings
from common.topics import Topic, topic_name
from deepmesh.mesh import Mesh
from engine.checkpoint.make_model import make_model

ROOT = Path(__file__).resolve().parent.parent
VOCAB = (1000, 120_000)  # ordinary text tokens of the V4 vocabulary: no special tokens
PREFIX = "deepmesh."


def segment(hash_id: int, n_tokens: int) -> list[int]:
    rng = random.Random(hash_id)
    return [rng.randrange(*VOCAB) for _ in range(n_tokens)]


def synthetic_trace(conversations: int, turns: int, seed: int) -> list[dict]:
    """Conversations of growing context; 80% open with one of four shared system prompts."""
    rng = random.Random(seed)
    systems = [(10_000 + i, rng.randrange(200, 800)) for i in range(4)]
    sessions = []
    for c in range(conversations):
        system = [list(rng.choice(systems))] if rng.random() < 0.8 else []
        sessions.append(
            [
                {
                    "session": f"c{c:03d}",
                    "turn": t,
                    "input": (system if t == 0 else []) + [[rng.randrange(1 << 40), rng.randrange(20, 200)]],
                    "output_tokens": rng.randrange(16, 64),
                }
                for t in range(turns)
            ]
        )
    # interleave: conversations start at different times and take turns
    trace, live = [], []
    pending = list(sessions)
    while pending or live:
        if pending and (not live or rng.random() < 0.3):
            live.append(pending.pop(0))
        session = rng.choice(live)
        trace.append(session.pop(0))
        if not session:
            live.remove(session)
    return trace


def from_mooncake(lines: list[dict], block_tokens: int = 512) -> list[dict]:
    """Mooncake's hash_ids JSONL as this script's trace: each line a one-turn session."""
    trace = []
    for i, line in enumerate(lines):
        ids, length = line["hash_ids"], line["input_length"]
        sizes = [block_tokens] * (len(ids) - 1) + [length - block_tokens * (len(ids) - 1)]
        trace.append(
            {
                "session": f"m{i}",
                "turn": 0,
                "input": [[h, n] for h, n in zip(ids, sizes, strict=True)],
                "output_tokens": line["output_length"],
            }
        )
    return trace


class Trie:
    """Token sequences seen so far, to find the longest prefix of a prompt that repeats one."""

    def __init__(self) -> None:
        self.root: dict = {}

    def add(self, tokens: list[int]) -> None:
        node = self.root
        for token in tokens:
            node = node.setdefault(token, {})

    def longest(self, tokens: list[int]) -> int:
        node, n = self.root, 0
        for token in tokens:
            node = node.get(token)
            if node is None:
                break
            n += 1
        return n


class Replay:
    """Prefill and decode workers on one bus and store, fed prompts as token ids (no chat template)."""

    def __init__(self, model: Path, workdir: Path):
        self.bus = MemoryBus()
        store = StateStore.from_settings(
            Settings(database_url=f"sqlite:///{workdir}/cache.db", cache_dir=str(workdir / "kv"))
        )
        self.mesh = Mesh(model, self.bus, store).start([])  # no workers on threads: the cache's maintenance
        self.waiting: dict[str, queue.Queue] = {}
        self.lock = threading.Lock()
        self.consumer = self.bus.consumer([topic_name(Topic.TOKENS, PREFIX)], "replay")
        threading.Thread(target=self._route, daemon=True).start()

    def _route(self) -> None:
        while not self.mesh.stopping.is_set():
            for record in self.consumer.poll(timeout=0.1):
                envelope = decode(record.value, "tokens")
                with self.lock:
                    inbox = self.waiting.get(envelope.job_id)
                if inbox is not None:
                    inbox.put((time.perf_counter(), envelope.seq, TokensPayload.model_validate(envelope.payload)))

    def request(self, prompt: list[int], max_tokens: int) -> tuple[float, int, list[int]]:
        """(TTFT, cached prompt tokens, generated tokens) of one greedy request."""
        job_id = uuid.uuid4().hex
        inbox: queue.Queue = queue.Queue()
        with self.lock:
            self.waiting[job_id] = inbox
        payload = PrefillPayload(
            endpoint="chat.completions",
            prompt_token_ids=prompt,
            sampling=Sampling(max_tokens=max_tokens, temperature=0, top_p=1),
        )
        sent = time.perf_counter()
        message = Envelope(type="prefill", job_id=job_id, payload=payload.model_dump())
        self.bus.produce(topic_name(Topic.PREFILL, PREFIX), job_id, message.encode())
        generated: list[int] = []
        ttft, cached = 0.0, 0
        while True:
            arrived, seq, tokens = inbox.get(timeout=600)
            if seq == 0:
                ttft, cached = arrived - sent, tokens.cached_tokens
            generated.extend(tokens.token_ids)
            if tokens.finished:
                break
        with self.lock:
            del self.waiting[job_id]
        return ttft, cached, generated


def replay_trace(replay: Replay, trace: list[dict], concurrency: int) -> list[dict]:
    """Sessions in parallel, each session's turns in order; returns one row per request."""
    sessions: dict[str, list[dict]] = {}
    for line in trace:
        sessions.setdefault(line["session"], []).append(line)
    seen, seen_lock = Trie(), threading.Lock()
    rows: list[dict] = []

    def run(turns: list[dict]) -> None:
        context: list[int] = []
        for line in sorted(turns, key=lambda t: t["turn"]):
            prompt = context + [t for h, n in line["input"] for t in segment(h, n)]
            with seen_lock:
                ideal = min(seen.longest(prompt), len(prompt) - 1)
            ttft, cached, generated = replay.request(prompt, line["output_tokens"])
            with seen_lock:
                seen.add(prompt + generated)  # covers the prompt itself too
                rows.append({"prompt": len(prompt), "cached": cached, "ideal": ideal, "ttft": ttft, "at": time.time()})
            context = prompt + generated

    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(run, turns) for turns in sessions.values()]:
            future.result()
    return sorted(rows, key=lambda r: r["at"])


def ttft_cold_vs_hit(replay: Replay, cached: int, total: int, rounds: int) -> tuple[float, float]:
    cold, hit = [], []
    for i in range(rounds):
        cold.append(replay.request(segment(50_000 + i, total), 1)[0])
        stored = segment(60_000 + i, cached)
        replay.request(stored, 1)  # its prompt's state is stored
        ttft, got, _ = replay.request(stored + segment(70_000 + i, total - cached), 1)
        assert got == cached, f"expected a {cached}-token hit, got {got}"
        hit.append(ttft)
    return statistics.median(cold), statistics.median(hit)


def stored_bytes(store: StateStore) -> dict[str, int]:
    """What the cache holds, and what it would hold if entries did not share their blocks."""
    from sqlalchemy import select

    from cache_svc.catalog import Entry

    with store.catalog.session() as session:
        entries = {e.key: e for e in session.scalars(select(Entry))}
    anchors = [e for e in entries.values() if e.kind == "anchor"]
    unshared = sum(a.size + sum(entries[b].size for b in a.blocks if b in entries) for a in anchors)
    return {
        "anchors": len(anchors),
        "blocks": len(entries) - len(anchors),
        "bytes": sum(e.size for e in entries.values()),
        "unshared_bytes": unshared,
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, ttft) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    prompt = cached = ideal = 0
    achieved, best = [], []
    for row in rows:
        prompt, cached, ideal = prompt + row["prompt"], cached + row["cached"], ideal + row["ideal"]
        achieved.append(cached / prompt)
        best.append(ideal / prompt)
    rate.plot(achieved, label="prefix cache")
    rate.plot(best, label="ideal", linestyle="--")
    rate.set_ylabel("prompt tokens served from cache (cumulative)")
    rate.legend()
    hits = [i for i, r in enumerate(rows) if r["cached"]]
    misses = [i for i, r in enumerate(rows) if not r["cached"]]
    ttft.scatter(hits, [rows[i]["ttft"] * 1e3 for i in hits], s=8, label="hit")
    ttft.scatter(misses, [rows[i]["ttft"] * 1e3 for i in misses], s=8, label="miss")
    ttft.set_ylabel("TTFT (ms)")
    ttft.set_xlabel("request")
    ttft.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / ".cache/models/tiny")
    parser.add_argument("--conversations", type=int, default=50)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", type=Path, default=None, help="a trace in the format above (JSON lines)")
    parser.add_argument("--mooncake", action="store_true", help="--trace is a Mooncake hash_ids trace")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/multiturn_replay")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        make_model(args.model, "tiny", seed=0)
    if args.trace is None:
        trace = synthetic_trace(args.conversations, args.turns, args.seed)
    else:
        lines = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
        trace = from_mooncake(lines) if args.mooncake else lines

    with tempfile.TemporaryDirectory() as workdir:
        replay = Replay(args.model, Path(workdir))
        results: dict = {}

        def drive() -> None:
            try:
                results["rows"] = replay_trace(replay, trace, args.concurrency)
                results["resident"] = int(
                    REGISTRY.get_sample_value("deepmesh_prefix_cache_tokens_total", {"outcome": "resident"}) or 0
                )
                results["ttft"] = ttft_cold_vs_hit(replay, cached=4000, total=4096, rounds=3)
            finally:
                replay.mesh.stopping.set()

        driver = threading.Thread(target=drive)
        driver.start()
        replay.mesh.run_engines()  # this thread loaded the model: the one thread that runs PyTorch
        driver.join()
        replay.mesh.stop()
        storage = stored_bytes(replay.mesh.store)
    rows = results["rows"]
    cold, hit = results["ttft"]
    resident = results["resident"]  # of the replay's hits: prefill took them from its own memory
    prompt = sum(r["prompt"] for r in rows)
    cached, ideal = sum(r["cached"] for r in rows), sum(r["ideal"] for r in rows)
    print(f"{len(rows)} requests, {prompt:,} prompt tokens")
    print(f"served from cache: {cached:,} ({cached / prompt:.1%}); ideal: {ideal:,} ({ideal / prompt:.1%})")
    print(f"hit rate against the ideal: {cached / ideal:.1%}  (target: >= 95%)")
    print(f"of the tokens served, from prefill's own memory (tier 0, no load): {resident:,} ({resident / cached:.1%})")
    print(f"TTFT, 4,096-token prompt: cold {cold * 1e3:.0f} ms, 4,000 tokens cached {hit * 1e3:.0f} ms")
    print(f"hit / cold: {hit / cold:.1%}  (target: <= 20%)")
    print(
        f"stored: {storage['anchors']:,} anchors, {storage['blocks']:,} blocks, {storage['bytes'] / 1e6:.1f} MB; "
        f"{storage['unshared_bytes'] / 1e6:.1f} MB if each anchor held its own blocks"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, args.out.with_suffix(".png"))
    summary = {"requests": len(rows), "prompt_tokens": prompt, "cached_tokens": cached, "ideal_tokens": ideal}
    summary["resident_tokens"] = resident
    summary |= {"ttft_cold_s": cold, "ttft_hit_s": hit, "storage": storage, "rows": rows}
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
