"""Routers: which replica a job goes to, decided by whoever sends it.

The tokenizer sends each prompt to the prefill replica with the lowest predicted time to first
token: the work already queued there (what it reported plus what this router sent it since),
then the prompt itself, less the prefix that replica can start from. A replica holding a
prefix of the prompt in its own memory (tier 0) starts from it for free; any other replica
can load the same prefix from the cache service (prefill stores every state it keeps), at the
load speed it measured. Prefill sends each prefilled job to the decode replica with the most
headroom: free batch slots and free state blocks, after what is queued and in flight.

Ties are broken by the job id, so routers that see the same reports make the same choices
and need no state of their own beyond what they sent in the last fraction of a second:
several tokenizers send a conversation's turns to the same replica because they read the same
reports, and a burst from one router spreads out because its dispatches count at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from common import metrics
from common.blocks import BLOCK_SIZE
from common.prefixes import PromptKeys, reported
from common.replicas import Dispatch, LoadReport, ReplicaTable, Stage

DEFAULT_TOKENS_PER_SECOND = 1000.0  # prefill speed assumed of a replica that has not measured its own yet


@dataclass(frozen=True)
class Route:
    """Where a job goes: a replica and one of its partitions, or (replica None) wherever its key
    hashes to, when no replica is in rotation (Kafka keeps it until one takes it)."""

    replica: str | None
    partition: int | None
    reason: str  # prefix, load, only_choice, rerouted, no_replica
    cost: int = 0  # what the job adds to the replica: prefill, tokens to compute; decode, state blocks
    predicted_seconds: float = 0.0  # prefill: predicted time to the first token
    resident_tokens: int = 0  # prefill: of the prompt, held by that replica in its own memory


def resident_tokens(reports: Sequence[LoadReport], tenant: str, prompt: Sequence[int]) -> dict[str, int]:
    """For each replica, the longest prefix of the prompt it reports holding and may start it from
    (0: none): its prefixes with the prompt's base at their base length (common/prefixes.py), no
    longer than the prompt less the tokens the replica always computes (`keep_tokens`, as the
    engine's reusable_prefix), then of those, the ones whose own key is the prompt's at their length."""

    hashed = PromptKeys(tenant, prompt)
    boundaries = hashed.at(range(0, len(prompt) + 1, BLOCK_SIZE))
    bases = [(n, reported(key)) for n, key in boundaries.items()]

    def held(report: LoadReport) -> list[tuple[int, str]]:
        # by_base once a report, not once a base: an agent's 20,000-token prompt has 157 bases
        index, usable = report.by_base(), max(0, len(prompt) - report.keep_tokens)
        return [entry for base in bases for entry in index.get(base, ()) if entry[0] <= usable]

    candidates = {r.replica: held(r) for r in reports}
    keys = hashed.at({n for held in candidates.values() for n, _ in held})
    wanted = {n: reported(key) for n, key in keys.items()}
    return {replica: max((n for n, key in held if wanted[n] == key), default=0) for replica, held in candidates.items()}


def backlog_tokens(report: LoadReport, sent: Sequence[Dispatch]) -> int:
    """Prompt tokens ahead of a new job on a prefill replica: what it reported, and what was sent
    to it since."""
    return report.queued_tokens + sum(d.cost for d in sent)


def _tie_break(job_id: str, replica: str) -> int:
    """A per-job order of the replicas (rendezvous hashing): ties spread evenly, the same everywhere."""
    return int.from_bytes(hashlib.blake2b(f"{job_id}/{replica}".encode(), digest_size=8).digest())


def _partition(report: LoadReport, job_id: str) -> int:
    return sorted(report.partitions)[zlib.crc32(job_id.encode()) % len(report.partitions)]


def choose_prefill(
    reports: Sequence[LoadReport], in_flight: dict[str, list[Dispatch]], job_id: str, tenant: str, prompt: Sequence[int]
) -> Route:
    if not reports:
        return Route(None, None, "no_replica", len(prompt))
    held = resident_tokens(reports, tenant, prompt)
    anywhere = max(held.values())  # stored by the replica that holds it: loadable by every other one
    measured = [r.tokens_per_second for r in reports if r.tokens_per_second > 0]
    fallback = statistics.median(measured) if measured else DEFAULT_TOKENS_PER_SECOND
    best: tuple[float, int, LoadReport, int] | None = None
    for report in reports:
        speed = report.tokens_per_second or fallback
        backlog = backlog_tokens(report, in_flight.get(report.replica, ()))
        own = held[report.replica]
        compute = len(prompt) - own
        start = compute / speed
        if anywhere > own and report.load_tokens_per_second > 0:  # load the longer prefix from the cache service
            loading = (anywhere - own) / report.load_tokens_per_second + (len(prompt) - anywhere) / speed
            if loading < start:  # what it adds to that replica's work is then only the rest
                start, compute = loading, len(prompt) - anywhere
        predicted = backlog / speed + start
        candidate = (predicted, _tie_break(job_id, report.replica), report, compute)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    assert best is not None
    predicted, _, chosen, compute = best
    own = held[chosen.replica]
    reason = "only_choice" if len(reports) == 1 else "prefix" if own and own == anywhere else "load"
    return Route(chosen.replica, _partition(chosen, job_id), reason, compute, predicted, own)


def choose_decode(
    reports: Sequence[LoadReport], in_flight: dict[str, list[Dispatch]], job_id: str, num_tokens: int
) -> Route:
    """`num_tokens`: the job's prompt and the most it may generate (the state it may come to hold)."""
    blocks = -(-num_tokens // BLOCK_SIZE)
    if not reports:
        return Route(None, None, "no_replica", blocks)

    def headroom(report: LoadReport) -> tuple[float, int]:
        sent = in_flight.get(report.replica, ())
        slots = (report.free_slots - report.queued_jobs - len(sent)) / max(1, report.max_slots)
        room = (report.free_blocks - sum(d.cost for d in sent)) / max(1, report.total_blocks)
        return min(slots, room), -_tie_break(job_id, report.replica)

    chosen = max(reports, key=headroom)
    reason = "only_choice" if len(reports) == 1 else "load"
    return Route(chosen.replica, _partition(chosen, job_id), reason, blocks)


def choose_encoder(
    reports: Sequence[LoadReport], in_flight: dict[str, list[Dispatch]], job_id: str, num_images: int
) -> Route:
    """The encoder replica with the fewest images ahead of a job's (`queued_tokens` counts images
    there), those sent to it since its report included."""
    if not reports:
        return Route(None, None, "no_replica", num_images)

    def ahead(report: LoadReport) -> tuple[int, int]:
        sent = sum(d.cost for d in in_flight.get(report.replica, ()))
        return report.queued_tokens + sent, _tie_break(job_id, report.replica)

    chosen = min(reports, key=ahead)
    reason = "only_choice" if len(reports) == 1 else "load"
    return Route(chosen.replica, _partition(chosen, job_id), reason, num_images)


class Router:
    """Routes one stage's jobs over a ReplicaTable, and counts what it sent until reports do."""

    def __init__(self, table: ReplicaTable, stage: Stage):
        self.table, self.stage = table, stage

    def _in_flight(self, reports: list[LoadReport]) -> dict[str, list[Dispatch]]:
        return {r.replica: self.table.in_flight(r) for r in reports}

    def prefill(self, job_id: str, tenant: str, prompt: Sequence[int], rerouted: bool = False) -> Route:
        started = time.perf_counter()
        reports = self.table.live(self.stage)
        route = choose_prefill(reports, self._in_flight(reports), job_id, tenant, prompt)
        return self._decided(route, started, rerouted)

    def decode(self, job_id: str, num_tokens: int, rerouted: bool = False) -> Route:
        started = time.perf_counter()
        reports = self.table.live(self.stage)
        route = choose_decode(reports, self._in_flight(reports), job_id, num_tokens)
        return self._decided(route, started, rerouted)

    def encoder(self, job_id: str, num_images: int, rerouted: bool = False) -> Route:
        started = time.perf_counter()
        reports = self.table.live(self.stage)
        route = choose_encoder(reports, self._in_flight(reports), job_id, num_images)
        return self._decided(route, started, rerouted)

    def _decided(self, route: Route, started: float, rerouted: bool) -> Route:
        if rerouted and route.replica is not None:
            route = dataclasses.replace(route, reason="rerouted")
        metrics.ROUTE_DECISION_SECONDS.labels(self.stage).observe(time.perf_counter() - started)
        metrics.ROUTE_DECISIONS.labels(self.stage, route.reason).inc()
        return route

    def sent(self, route: Route, where: tuple[int, int] | None) -> None:
        """The job is stored at `where` (partition, offset): it counts against the replica until
        a report shows the replica has read past it."""
        if route.replica is None or where is None:
            return
        metrics.ROUTED_JOBS.labels(self.stage, route.replica).inc()
        self.table.sent(self.stage, Dispatch(where[0], where[1], route.cost))
