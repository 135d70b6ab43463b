"""Prefill routing at 8, 16 and 64 replicas, in simulated time: the real router and admission
control decide, simulated replicas do the work.

benchmarks/routing.py runs the real workers, and two cores cannot run more than a few of them
before the harness, not the replicas, is what saturates. Here the deciding parts are the real
classes (common/routing.Router over a common/replicas.ReplicaTable, and the gateway's
gateway/admission.Admission), fed real LoadReports on a clock of the simulation's own. What a
replica does with a job is modelled as the prefill worker does it:

- it takes the job in at once (its `consumed` offset moves on, as the router's in-flight count
  expects), then starts it from the longest prefix it holds itself (tier 0: no load), or loads
  a longer one from the cache service if that is quicker than computing the difference (as
  PrefillWorker._too_slow_to_load), at the speed of the tier that holds it (T1 memory, T2 disk);
  a load holds only its own job, not the engine;
- its engine computes the jobs whose prefix has arrived, first come first served, in steps of
  at most `step_tokens` prompt tokens (chunked prefill) that take `step_seconds + tokens /
  tokens_per_second`; a job's first token comes when its last chunk is computed;
- it stores the prompt's anchors (its end and every 1,024 tokens inside it) in its tier 0 (least
  recently used beyond `tier0_tokens`) and in the cache service; when the answer is decoded (at
  `itl_seconds` a token, or on decode replicas whose steps take longer with every sequence
  they hold), the conversation's end too, in the cache service and in the tier 0 of the
  replica that prefilled it (decode's warm message);
- it reports every 0.25 s (REPORT_SECONDS), each replica at its own phase, and the report
  reaches the routers `hop_seconds` later.

Workload: an agentic trace. Sessions arrive at `rate` per second (Poisson); each opens with one of
a few shared system prompts (Zipf-popular), then alternates a model turn (answer, often a tool
call) with a tool's output (long: logs, files, search results) or the user's next message,
after a think time (the tool running, the user reading). Every turn's prompt is the whole
conversation so far, so a turn's prefix is the previous turn's prompt and answer.

Policies: hashing (a job's partition by its id, as Kafka's partitioner places it with no router),
session hashing (a conversation always to the same replica), round-robin, least-loaded (queued
tokens, blind to prefixes) and deepmesh's router; besides, a reference no router can be (one
central queue: CENTRAL_QUEUE). For each replica count, the rate at which hashing's P90 TTFT is
2 s is found by bisection, and every policy is run at it.

Measured per run: TTFT P50/P90/P99, the per-second imbalance of prefill work (max / mean of the
time each replica spent computing in that second, over the seconds the replicas were at least
half busy on average; P95; and the same over 10 s windows), prompt tokens served from tier 0,
from the cache service and computed, calls admission refused, and the router's decision time
(wall clock).

    python benchmarks/routing_sim.py [--replicas 8 16 64 --seconds 120 --seed 0]
    python benchmarks/routing_sim.py --live [--live-rate 0.5 --cost-scale 8]  # against real workers
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import random
import time
import zlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.blocks import BLOCK_SIZE
from common.prefixes import PromptKeys, base_length, reported
from common.replicas import REPORT_SECONDS, LoadReport, ReplicaTable
from common.routing import Route, Router, backlog_tokens
from gateway.admission import BYTES_PER_TOKEN, Admission

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("hashing", "session_hashing", "round_robin", "least_loaded", "deepmesh")
# Not a policy a router can run: one queue for every replica, seen as it is (no report's lag), each
# job handed to a replica once its engine's next step has room for more (Simulation.dispatch says
# which). Work-conserving: no engine idles while a job waits. The reference the imbalance target
# is read against.
CENTRAL_QUEUE = "central_queue"
TENANT = "default"
ANCHOR_INTERVAL = 1024  # common/settings.py cache_anchor_interval


# -- the workload ------------------------------------------------------------------------------------


@dataclass
class Turn:
    system: int | None  # the shared system prompt it opens with (turn 0), by index into Trace.systems
    input_tokens: int  # the new tokens it appends besides: a message, a tool's output
    output_tokens: int
    think_seconds: float  # after the answer, until the next turn is sent


@dataclass
class Trace:
    systems: list[int]  # the shared system prompts' sizes
    sessions: list[list[Turn]]


def agentic_trace(seed: int, count: int, scale: float = 1.0, max_context: int | None = None) -> Trace:
    """`count` sessions of 2 to 16 turns. Sizes (tokens, times `scale`): system prompts
    1,000-4,000, Zipf-popular; the first user message 20-400; a tool's output (70% of later
    turns) 100-6,000, log-normal around 600; a user's later message 10-300; answers 30-600,
    log-normal around 120. Think times: a tool 0.2-10 s (log-normal around 1 s), a user 1-30 s.
    A session ends before a turn that would take it past `max_context` tokens."""
    rng = random.Random(seed)

    def size(low: int, high: int, median: float | None = None) -> int:
        drawn = rng.randrange(low, high) if median is None else min(high, max(low, rng.lognormvariate(median, 1.0)))
        return max(1, int(drawn * scale))

    systems = 6
    sizes = [size(1000, 4000) for _ in range(systems)]
    weights = [1 / (i + 1) for i in range(systems)]
    sessions = []
    for _ in range(count):
        turns, context = [], 0
        for t in range(rng.randrange(2, 17)):
            tool = t > 0 and rng.random() < 0.7
            if t == 0:
                system, new = rng.choices(range(systems), weights)[0], size(20, 400)
            elif tool:
                system, new = None, size(100, 6000, math.log(600))
            else:
                system, new = None, size(10, 300)
            think = min(10.0, max(0.2, rng.lognormvariate(0.0, 1.0))) if tool else rng.uniform(1.0, 30.0)
            output = int(min(600, max(30, rng.lognormvariate(math.log(120), 0.8))) * scale) or 1
            context += (sizes[system] if system is not None else 0) + new + output
            if max_context is not None and context > max_context and turns:
                break
            turns.append(Turn(system, new, output, think))
        sessions.append(turns)
    return Trace(sizes, sessions)


def token_ids(rng: random.Random, count: int) -> array:
    """Distinct text: what the keys hash is the ids' bytes, whatever they would decode to."""
    return array("I", rng.randbytes(4 * count))


def system_prompt(index: int, size: int) -> array:
    return token_ids(random.Random(10_000 + index), size)


class Session:
    """A conversation's tokens so far (one array: turns share it, a prompt is a prefix of it)."""

    def __init__(self, index: int, turns: list[Turn], systems: list[array]):
        self.index, self.turns, self.systems = index, turns, systems
        self.tokens = array("I")
        self.rng = random.Random(index * 7919 + 1)

    def extend(self, turn: Turn) -> None:
        if turn.system is not None:
            self.tokens.extend(self.systems[turn.system])
        self.answer(turn.input_tokens)

    def answer(self, tokens: int) -> None:
        self.tokens.extend(token_ids(self.rng, tokens))


# -- what a replica or the cache service holds ------------------------------------------------------


class PrefixIndex:
    """Prefixes held, least recently used first, up to `capacity_tokens` (None: all), found as
    the routers find them (common/routing.resident_tokens): by the key of their full blocks,
    then their own."""

    def __init__(self, capacity_tokens: int | None):
        self.capacity_tokens = capacity_tokens
        self.entries: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()  # key -> (tokens, base key)
        self.by_base: dict[tuple[int, bytes], set[tuple[int, bytes]]] = {}
        self.tokens = 0

    def add(self, keys: dict[int, bytes], n: int) -> None:
        key, base = keys[n], keys[base_length(n)]
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        self.entries[key] = (n, base)
        self.by_base.setdefault((base_length(n), base), set()).add((n, key))
        self.tokens += n
        while self.capacity_tokens is not None and self.tokens > self.capacity_tokens:
            old, (m, old_base) = self.entries.popitem(last=False)
            self.by_base[(base_length(m), old_base)].discard((m, old))
            self.tokens -= m

    def longest(self, hashed: PromptKeys, limit: int) -> tuple[int, bytes | None]:
        """The longest prefix held of at most `limit` tokens, and its key (0, None: none)."""
        boundaries = hashed.at(range(0, limit + 1, BLOCK_SIZE))
        candidates = [n for b, k in boundaries.items() for n, _ in self.by_base.get((b, k), ()) if n <= limit]
        keys = hashed.at(candidates)
        found = max((n for n in candidates if keys[n] in self.entries), default=0)
        if not found:
            return 0, None
        self.entries.move_to_end(keys[found])
        return found, keys[found]

    def reported(self) -> list[tuple[int, str, str]]:
        return [(n, reported(base), reported(key)) for key, (n, base) in self.entries.items()]


def prefix_keys(tokens: array, lengths: Sequence[int]) -> dict[int, bytes]:
    """Keys at these lengths and at their base lengths."""
    return PromptKeys(TENANT, tokens).at({*lengths, *(base_length(n) for n in lengths)})


# -- the simulation -----------------------------------------------------------------------------------


@dataclass
class Costs:
    """A prefill replica's speed, a load's, and decode's."""

    step_seconds: float = 0.015  # an engine step's fixed cost
    tokens_per_second: float = 8000.0  # prompt tokens a replica computes per second
    step_tokens: int = 4096  # the most prompt tokens one step computes (max_num_batched_tokens)
    load_tokens_per_second: dict[str, float] = field(default_factory=lambda: {"t1": 400_000.0, "t2": 60_000.0})
    load_latency_seconds: float = 0.002
    t1_tokens: int = 4_000_000  # the cache service's memory tier; everything is also on disk (T2)
    tier0_tokens: int = 400_000  # what a replica holds in its own memory
    itl_seconds: float = 0.02  # decode's time per generated token
    # or, with decode_replicas: decode steps of decode_step_seconds + decode_seq_seconds a sequence,
    # every sequence of a replica in each (a job goes to the one with the fewest)
    decode_replicas: int = 0
    decode_step_seconds: float = 0.0
    decode_seq_seconds: float = 0.0
    hop_seconds: float = 0.003  # a message on the bus: router to replica, replica to client, a report

    def load_seconds(self, tokens: int, tier: str) -> float:
        return self.load_latency_seconds + tokens / self.load_tokens_per_second[tier]


@dataclass(eq=False)  # each job is itself: held in sets and dicts by identity
class Job:
    job_id: str
    session: Session
    length: int  # its prompt: the session's first `length` tokens
    output_tokens: int
    think_seconds: float
    turn: int
    sent: float
    replica: SimReplica | None = None
    start: int = 0  # tokens it starts from (a held or loaded prefix)
    source: str = "computed"  # where the start came from: tier0, t1, t2, computed
    remaining: int = 0
    ttft: float | None = None
    answered_at: float | None = None  # when its last token reached the client

    @property
    def prompt(self) -> array:
        return self.session.tokens[: self.length]


class Policy:
    """How a benchmark's router picks a prefill replica: one of POLICIES (benchmarks/routing.py
    runs all but session hashing). The hashings name no replica: the job goes where its key
    hashes, as Kafka's partitioner places it; so does every job before a replica has reported."""

    def __init__(self, name: str, table: ReplicaTable):
        self.name, self.table = name, table
        self.router = Router(table, "prefill")
        self.turn = 0
        self.decision_seconds: list[float] = []

    def route(self, job_id: str, prompt: Sequence[int]) -> Route:
        started = time.perf_counter()
        live = sorted(self.table.live("prefill"), key=lambda r: r.replica)
        if self.name == "deepmesh":
            route = self.router.prefill(job_id, TENANT, prompt)
        elif self.name in ("hashing", "session_hashing") or not live:
            route = Route(None, None, "hash", len(prompt))
        else:
            if self.name == "round_robin":
                chosen = live[self.turn % len(live)]
                self.turn += 1
            else:  # least_loaded: queued tokens and what this router sent since, blind to prefixes

                def load(report: LoadReport) -> tuple[int, int]:
                    backlog = backlog_tokens(report, self.table.in_flight(report))
                    return backlog, zlib.crc32(f"{job_id}{report.replica}".encode())

                chosen = min(live, key=load)
            route = Route(chosen.replica, chosen.partitions[0], "load", len(prompt))
        self.decision_seconds.append(time.perf_counter() - started)
        return route


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Simulation:
    """Events on one clock: arrivals, loads, engine steps, reports, decode ends."""

    def __init__(
        self, replicas: int, costs: Costs, policy: str, seed: int, admission_wait: float, cutoff: float = math.inf
    ):
        """`cutoff`: no session sends a turn after it (as benchmarks/routing.py's sessions)."""
        self.clock = Clock()
        self.costs = costs
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = 0
        self.table = ReplicaTable(clock=self.clock)
        self.policy = Policy(policy, self.table)
        self.admission = Admission(self.table, admission_wait, clock=self.clock)
        self.store = PrefixIndex(None)  # the cache service: every anchor, on disk (T2) at least
        self.t1 = PrefixIndex(costs.t1_tokens)  # those in its memory too
        self.replicas = [SimReplica(self, i) for i in range(replicas)]
        self.decoders = [SimDecoder(self) for _ in range(costs.decode_replicas)]
        self.jobs: list[Job] = []
        self.central: deque[Job] = deque()  # CENTRAL_QUEUE's one queue
        self.refused = 0  # calls admission control answered with a 429
        self.open_sessions = 0  # sessions arrived or to arrive, not yet at their last answer
        self.cutoff = cutoff
        rng = random.Random(seed)
        for replica in self.replicas:
            self.at(rng.uniform(0, REPORT_SECONDS), replica.report)

    def at(self, when: float, action: Callable[[], None]) -> None:
        self._order += 1
        heapq.heappush(self._events, (when, self._order, action))

    def after(self, seconds: float, action: Callable[[], None]) -> None:
        self.at(self.clock.now + seconds, action)

    def arrive(self, session: Session, at: float) -> None:
        self.open_sessions += 1
        self.at(at, lambda: self.send(session, 0))

    def run(self, horizon: float) -> None:
        """Until every session is done (reports go on as long as the replicas do), or `horizon`."""
        while self._events and self.open_sessions and self._events[0][0] <= horizon:
            when, _, action = heapq.heappop(self._events)
            self.clock.now = when
            action()

    # -- a turn: admitted, routed, prefilled, decoded, then the next one ----------------------

    def send(self, session: Session, turn: int, first_try: float | None = None) -> None:
        spec = session.turns[turn]
        if first_try is None:
            session.extend(spec)
        wait = self.admission.retry_after(len(session.tokens) * BYTES_PER_TOKEN)
        if wait is not None:  # the client waits as told and sends again
            self.refused += 1
            self.after(wait, lambda: self.send(session, turn, first_try or self.clock.now))
            return
        job = Job(
            f"s{session.index}t{turn}",
            session,
            len(session.tokens),
            spec.output_tokens,
            spec.think_seconds,
            turn,
            first_try or self.clock.now,
        )
        self.jobs.append(job)
        if self.policy.name == CENTRAL_QUEUE:
            self.central.append(job)
            self.dispatch()
            return
        replica, route = self.route(job)
        self.policy.router.sent(route, (replica.index, replica.produced))  # a route to no replica counts nothing
        replica.produced += 1
        self.after(self.costs.hop_seconds, lambda: replica.take(job))

    def route(self, job: Job) -> tuple[SimReplica, Route]:
        route = self.policy.route(job.job_id, job.prompt)
        if route.replica is not None:
            return next(r for r in self.replicas if r.name == route.replica), route
        key = f"s{job.session.index}" if self.policy.name == "session_hashing" else job.job_id
        return self.replicas[zlib.crc32(key.encode()) % len(self.replicas)], route

    def dispatch(self) -> None:
        """CENTRAL_QUEUE: the jobs waiting, first come first served, each to a replica whose next
        engine step has room: the one holding the fewest tokens to compute, then the one that has
        computed least in this second (what the imbalance measures), then the one holding the
        longest prefix of its prompt in tier 0."""
        second = math.floor(self.clock.now)
        while self.central and (ready := [r for r in self.replicas if r.has_room]):
            job = self.central.popleft()
            hashed = PromptKeys(TENANT, job.prompt)
            own = {r.index: r.tier0.longest(hashed, job.length - 1)[0] for r in ready}
            replica = min(ready, key=lambda r: (r.held, r.busy_since(second), -own[r.index], r.index))
            replica.assigned += 1
            self.after(self.costs.hop_seconds, lambda replica=replica, job=job: replica.take(job))

    def first_token(self, job: Job, replica: SimReplica) -> None:
        job.ttft = self.clock.now + self.costs.hop_seconds - job.sent
        if self.decoders:
            decoder = min(self.decoders, key=lambda d: len(d.running))
            self.after(self.costs.hop_seconds, lambda: decoder.take(job))
        else:
            self.after(self.costs.hop_seconds + job.output_tokens * self.costs.itl_seconds, lambda: self.answered(job))

    def answered(self, job: Job) -> None:
        """Decode stored the conversation's end and asked its prefill replica to hold it; the
        next turn comes after the think time."""
        job.answered_at = self.clock.now
        session = job.session
        session.answer(job.output_tokens)
        end = len(session.tokens)
        keys = prefix_keys(session.tokens, [end])
        self.store.add(keys, end)
        self.t1.add(keys, end)
        if job.replica is not None and job.replica.alive:
            job.replica.tier0.add(keys, end)
        if job.turn + 1 < len(session.turns) and self.clock.now + job.think_seconds <= self.cutoff:
            self.after(job.think_seconds, lambda: self.send(session, job.turn + 1))
        else:
            self.open_sessions -= 1


class SimReplica:
    """A prefill replica: its partition, its jobs, its engine's steps and its tier 0."""

    def __init__(self, sim: Simulation, index: int):
        self.sim, self.index, self.name = sim, index, f"prefill-{index:02d}"
        self.costs = sim.costs
        self.produced = 0  # offsets sent to its partition
        self.assigned = 0  # CENTRAL_QUEUE: jobs handed to it, on their way
        self.consumed = 0  # offsets it has taken in
        self.loading: list[Job] = []
        self.waiting: deque[Job] = deque()  # prefix in place, computing first come first served
        self.tier0 = PrefixIndex(self.costs.tier0_tokens)
        self.stepping = False
        self.alive = True
        self.busy: list[tuple[float, float]] = []  # the engine's steps: (start, end)
        self.speed = 0.0  # measured, as the worker's moving averages: what it reports
        self.load_speed = 0.0

    @property
    def held(self) -> int:
        """Prompt tokens its engine has yet to compute (a job loading its prefix holds none yet)."""
        return sum(job.remaining for job in self.waiting)

    def busy_since(self, start: float) -> float:
        """Seconds its engine computed from `start` until now, in steps that have ended."""
        total = 0.0
        for begun, ended in reversed(self.busy):
            if ended <= start:
                break
            total += ended - max(begun, start)
        return total

    @property
    def has_room(self) -> bool:
        """CENTRAL_QUEUE: its engine's next step could take more prompt tokens than it holds."""
        return self.alive and not self.assigned and self.held < self.costs.step_tokens

    def take(self, job: Job) -> None:
        self.consumed += 1
        self.assigned = max(0, self.assigned - 1)
        job.replica = self
        prompt = job.prompt
        hashed = PromptKeys(TENANT, prompt)
        limit = len(prompt) - 1  # the last token's logits are always computed
        own, _ = self.tier0.longest(hashed, limit)
        stored, key = self.sim.store.longest(hashed, limit)
        job.start, job.source = own, "tier0" if own else "computed"
        if stored > own and key is not None:
            tier = "t1" if key in self.sim.t1.entries else "t2"
            seconds = self.costs.load_seconds(stored, tier)
            compute_speed = self.speed or self.costs.tokens_per_second
            if seconds <= (stored - own) / compute_speed:  # else computing the difference is quicker
                job.start, job.source, job.remaining = stored, tier, len(prompt) - stored
                self.loading.append(job)
                self.sim.after(seconds, lambda: self.loaded(job, stored, seconds))
                return
        job.remaining = len(prompt) - job.start
        self.ready(job)

    def loaded(self, job: Job, tokens: int, seconds: float) -> None:
        self.loading.remove(job)
        self.load_speed = _moving(self.load_speed, tokens / seconds)
        self.sim.t1.add(prefix_keys(job.session.tokens, [tokens]), tokens)  # read back into memory
        self.ready(job)

    def ready(self, job: Job) -> None:
        self.waiting.append(job)
        if not self.stepping:
            self.step()

    def step(self) -> None:
        self.sim.dispatch()
        budget, chunks = self.costs.step_tokens, []
        for job in self.waiting:
            if budget <= 0:
                break
            chunk = min(job.remaining, budget)
            chunks.append((job, chunk))
            budget -= chunk
        if not chunks:
            self.stepping = False
            return
        self.stepping = True
        tokens = self.costs.step_tokens - budget
        seconds = (self.costs.step_seconds + tokens / self.costs.tokens_per_second) * self.slowdown
        started = self.sim.clock.now
        self.sim.after(seconds, lambda: self.stepped(chunks, tokens, started))

    slowdown = 1.0

    def stepped(self, chunks: list[tuple[Job, int]], tokens: int, started: float) -> None:
        now = self.sim.clock.now
        self.busy.append((started, now))
        self.speed = _moving(self.speed, tokens / (now - started))
        for job, chunk in chunks:
            job.remaining -= chunk
            if job.remaining == 0:
                self.waiting.remove(job)
                self.stored(job)
                self.sim.first_token(job, self)
        self.step()

    def stored(self, job: Job) -> None:
        """The prompt's anchors: its end and every ANCHOR_INTERVAL tokens inside it."""
        lengths = [*range(ANCHOR_INTERVAL, job.length, ANCHOR_INTERVAL), job.length]
        keys = prefix_keys(job.session.tokens, lengths)
        for n in lengths:
            self.tier0.add(keys, n)
            self.sim.store.add(keys, n)
            self.sim.t1.add(keys, n)

    def report(self) -> None:
        held = [*self.loading, *self.waiting]
        report = LoadReport(
            replica=self.name,
            stage="prefill",
            sent_at=self.sim.clock.now,
            partitions=[self.index],
            consumed={self.index: self.consumed},
            queued_jobs=len(self.loading),
            running_jobs=len(self.waiting),
            queued_tokens=sum(job.remaining for job in held),
            keep_tokens=0,
            tokens_per_second=self.speed,
            load_tokens_per_second=self.load_speed,
            resident=self.tier0.reported(),
        )
        self.sim.after(self.costs.hop_seconds, lambda: self.sim.table.update(report))
        self.sim.after(REPORT_SECONDS, self.report)
        self.sim.table.forget_counted()


class SimDecoder:
    """A decode replica: a token for every sequence it holds each step (prefill sampled the first)."""

    def __init__(self, sim: Simulation):
        self.sim = sim
        self.running: dict[Job, int] = {}  # -> tokens left to generate
        self.stepping = False

    def take(self, job: Job) -> None:
        self.running[job] = job.output_tokens - 1
        if not self.stepping:
            self.step()

    def step(self) -> None:
        for job in [job for job, left in self.running.items() if left <= 0]:
            del self.running[job]
            self.sim.after(self.sim.costs.hop_seconds, lambda job=job: self.sim.answered(job))
        self.stepping = bool(self.running)
        if self.stepping:
            costs = self.sim.costs
            self.sim.after(costs.decode_step_seconds + costs.decode_seq_seconds * len(self.running), self.stepped)

    def stepped(self) -> None:
        for job in self.running:
            self.running[job] -= 1
        self.step()


def _moving(average: float, value: float, weight: float = 0.1) -> float:
    return value if average == 0 else (1 - weight) * average + weight * value


# -- one run, and what it measured ---------------------------------------------------------------------


def simulate(
    trace: Trace,
    replicas: int,
    rate: float,
    policy: str,
    seconds: float,
    costs: Costs,
    seed: int = 0,
    admission_wait: float = 30.0,
    whole_run: bool = False,
) -> dict:
    """Sessions arrive at `rate` per second for `seconds`; the run goes on until every turn sent
    is answered. TTFTs count the turns sent in the second half of that (`whole_run`: every turn,
    and no session sends one past 1.5 x `seconds`, as benchmarks/routing.py's)."""
    sim = Simulation(replicas, costs, policy, seed, admission_wait, 1.5 * seconds if whole_run else math.inf)
    rng = random.Random(seed)
    systems = [system_prompt(i, size) for i, size in enumerate(trace.systems)]
    at = rng.expovariate(rate)
    for i, turns in enumerate(trace.sessions):
        if at > seconds:
            break
        sim.arrive(Session(i, turns, systems), at)
        at += rng.expovariate(rate)
    else:
        raise ValueError(f"the trace's {len(trace.sessions)} sessions ran out before {seconds} s at {rate}/s")
    sim.run(horizon=4 * seconds)  # an overloaded run never drains: what is left by then counts as never answered
    return measured(sim, policy, rate, (0.0, math.inf) if whole_run else (seconds / 2, seconds))


def measured(sim: Simulation, policy: str, rate: float, window: tuple[float, float]) -> dict:
    """Over the turns sent in the window (by default the second half of the arrivals: the first
    fills the replicas with sessions midway through theirs)."""
    warm, seconds = window[0], min(window[1], sim.clock.now)
    jobs = [j for j in sim.jobs if warm <= j.sent <= seconds]
    ttfts = [math.inf if j.ttft is None else j.ttft for j in jobs]
    tokens = {source: sum(j.start for j in jobs if j.source == source) for source in ("tier0", "t1", "t2")}
    computed = sum(j.length - j.start for j in jobs)
    return {
        "policy": policy,
        "replicas": len(sim.replicas),
        "rate": rate,
        "jobs": len(jobs),
        "unanswered": sum(1 for j in jobs if j.ttft is None),
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p90": percentile(ttfts, 90),
        "ttft_p99": percentile(ttfts, 99),
        "imbalance_p95": imbalance_p95([r.busy for r in sim.replicas], warm, seconds),
        "imbalance_p95_10s": imbalance_p95([r.busy for r in sim.replicas], warm, seconds, width=10.0),
        "busy_share": sum(b - a for r in sim.replicas for a, b in r.busy if warm <= a <= seconds)
        / (len(sim.replicas) * (seconds - warm)),
        "tier0_tokens": tokens["tier0"],
        "t1_tokens": tokens["t1"],
        "t2_tokens": tokens["t2"],
        "computed_tokens": computed,
        "refused_calls": sim.refused,
        "decision_p99_ms": None if (p99 := percentile(sim.policy.decision_seconds, 99)) is None else p99 * 1e3,
        "itl_p50": percentile(
            [
                (j.answered_at - j.sent - j.ttft) / (j.output_tokens - 1)
                for j in jobs
                if j.answered_at is not None and j.ttft is not None and j.output_tokens > 1
            ],
            50,
        ),
    }


def imbalance_p95(busy: list[list[tuple[float, float]]], begin: float, end: float, width: float = 1.0) -> float | None:
    """Per `width` seconds from `begin` to `end`, max / mean of the time each replica computed in
    it, over the intervals where the replicas were at least half busy on average; its P95."""
    first = int(begin / width)
    rows = [[0.0] * len(busy) for _ in range(first, int(end / width))]
    for i, steps in enumerate(busy):
        for start, stop in steps:
            slot = max(first, int(start / width))
            while slot - first < len(rows) and slot * width < stop:
                rows[slot - first][i] += max(0.0, min(stop, (slot + 1) * width) - max(start, slot * width))
                slot += 1
    ratios = [max(row) / mean for row in rows if (mean := sum(row) / len(row)) >= 0.5 * width]
    return percentile(ratios, 95) if ratios else None


def percentile(values: Sequence[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


# -- the sweep ---------------------------------------------------------------------------------------


def hashing_rate(trace: Trace, replicas: int, seconds: float, costs: Costs, target: float, steps: int) -> float:
    """The session rate at which hashing's P90 TTFT is `target` seconds (bisection on a log scale)."""

    def p90(rate: float) -> float:
        result = simulate(trace, replicas, rate, "hashing", seconds, costs)
        print(f"    hashing at {rate:.3f} sessions/s: P90 TTFT {result['ttft_p90']:.2f} s", flush=True)
        return result["ttft_p90"]

    low, high = 0.0, replicas * 1.0
    while p90(high) < target:
        low, high = high, high * 1.5
    for _ in range(steps):
        middle = math.sqrt(low * high) if low else high / 2
        low, high = (middle, high) if p90(middle) < target else (low, middle)
    return low or high / 2


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({r["replicas"] for r in results})
    at = range(len(counts))  # evenly spaced, whatever the counts
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for policy in (*POLICIES, CENTRAL_QUEUE):
        rows = {r["replicas"]: r for r in results if r["policy"] == policy}
        if len(rows) < len(counts):
            continue
        style = {"marker": "o", "label": policy, "linestyle": "--" if policy == CENTRAL_QUEUE else "-"}
        axes[0].plot(at, [rows[n]["ttft_p90"] for n in counts], **style)
        axes[1].plot(at, [rows[n]["imbalance_p95"] or float("nan") for n in counts], **style)
    axes[0].set(xticks=at, xticklabels=counts, xlabel="prefill replicas", ylabel="P90 TTFT (s)")
    axes[1].set(xticks=at, xticklabels=counts, xlabel="prefill replicas", ylabel="imbalance P95 (per second)")
    axes[0].set_title("at the load where hashing's P90 is 2 s")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: list[dict]) -> str:
    lines = [
        "| replicas | sessions/s | policy | turns | TTFT P50 | P90 | P99 | imbalance P95 (1 s / 10 s) | busy"
        " | tier 0 / cache T1 / T2 / computed (M tokens) | decision p99 |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        served = " / ".join(f"{r[k] / 1e6:.1f}" for k in ("tier0_tokens", "t1_tokens", "t2_tokens", "computed_tokens"))
        imbalance = imbalances(r)
        lines.append(
            f"| {r['replicas']} | {r['rate']:.2f} | {r['policy']} | {r['jobs']:,} | {r['ttft_p50']:.2f} s"
            f" | {r['ttft_p90']:.2f} s | {r['ttft_p99']:.2f} s | {imbalance} | {r['busy_share']:.0%} | {served}"
            f" | {'-' if r['decision_p99_ms'] is None else format(r['decision_p99_ms'], '.2f') + ' ms'} |"
        )
    return "\n".join(lines)


def imbalances(run: dict) -> str:
    """Its imbalance P95 per second and per 10 s ("-": never half busy)."""
    return " / ".join(f"{run[k]:.2f}" if run[k] else "-" for k in ("imbalance_p95", "imbalance_p95_10s"))


def targets(results: list[dict]) -> str:
    lines = ["targets (P90 TTFT <= 0.5x hashing, imbalance P95 <= 1.10):"]
    for n in sorted({r["replicas"] for r in results}):
        runs = {r["policy"]: r for r in results if r["replicas"] == n}
        ours, hashing = runs["deepmesh"], runs["hashing"]
        ratios = ", ".join(f"{p} {ours['ttft_p90'] / runs[p]['ttft_p90']:.2f}x" for p in POLICIES if p != "deepmesh")
        imbalance = imbalances(ours)
        lines.append(
            f"  {n} replicas: P90 TTFT {ours['ttft_p90']:.2f} s against hashing's {hashing['ttft_p90']:.2f} s"
            f" ({ratios}); imbalance P95 over 1 s / 10 s {imbalance}"
        )
        if central := runs.get(CENTRAL_QUEUE):
            lines.append(
                f"    one central queue, work-conserving: imbalance {imbalances(central)},"
                f" P90 TTFT {central['ttft_p90']:.2f} s"
                f" (the router's {ours['ttft_p90'] / central['ttft_p90']:.2f}x)"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument(
        "--seconds", type=float, default=120.0, help="how long sessions arrive (measured: the second half)"
    )
    parser.add_argument("--target-p90", type=float, default=2.0, help="hashing's P90 TTFT that sets the load")
    parser.add_argument("--bisect-steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--live", action="store_true", help="check a 2-replica prediction against real workers")
    parser.add_argument("--cost-scale", type=float, default=8.0, help="--live: the fitted step times, multiplied")
    parser.add_argument("--live-rate", type=float, default=0.5, help="--live: sessions a second")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/routing_sim")
    args = parser.parse_args()
    if args.live:
        check_live(args)
        return
    costs = Costs()
    print(f"replica model: {costs}")
    results = []
    for n in args.replicas:
        trace = agentic_trace(args.seed, count=int(n * 8 * args.seconds))
        print(f"{n} replicas: finding the load where hashing's P90 TTFT is {args.target_p90:g} s", flush=True)
        rate = hashing_rate(trace, n, args.seconds, costs, args.target_p90, args.bisect_steps)
        for policy in (*POLICIES, CENTRAL_QUEUE):
            started = time.perf_counter()
            result = simulate(trace, n, rate, policy, args.seconds, costs, args.seed)
            results.append(result)
            print(
                f"  {n} replicas, {rate:.2f} sessions/s, {policy:<15} turns {result['jobs']:>6}"
                f" TTFT p50/p90/p99 {result['ttft_p50']:.2f}/{result['ttft_p90']:.2f}/{result['ttft_p99']:.2f} s"
                f" imbalance {result['imbalance_p95'] or 0:.2f} ({result['imbalance_p95_10s'] or 0:.2f} over 10 s)"
                f" busy {result['busy_share']:.0%}"
                f" ({time.perf_counter() - started:.0f} s to simulate)",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"costs": str(costs), "runs": results}, indent=1) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(table(results))
    print(targets(results))
    print(f"wrote {args.out.with_suffix('.png')} and {args.out.with_suffix('.json')}")


# -- the check against real workers ----------------------------------------------------------------------


def check_live(args: argparse.Namespace) -> None:
    """Two prefill replicas and one decode replica for real (benchmarks/routing.py: the real
    workers, bus, store, tier 0 and reports, over a model that sleeps as a cost model fitted to
    the engine on this machine says), against what this simulation predicts for the same trace,
    arrivals and costs: hashing and the router, at `--live-rate` sessions a second."""
    import routing as live  # the real workers: torch, the engine

    from common.bus import MemoryBus
    from engine import LLMEngine
    from engine.checkpoint.make_model import make_model

    model_path = ROOT / ".cache/models/tiny"
    if not (model_path / "config.json").is_file():
        make_model(model_path, "tiny", seed=0)
    fitted = live.CostModel.measured(model_path)
    # every step longer, as benchmarks/routing.py --cost-scale: the replicas, not the harness on
    # these cores, are what fills up
    cost = live.CostModel(*(args.cost_scale * v for v in dataclasses.astuple(fitted)))
    model = LLMEngine.from_pretrained(model_path).model
    print(
        f"fitted, x{args.cost_scale:g}: prefill {cost.prefill_base * 1e3:.1f} ms"
        f" + {cost.prefill_per_token * 1e6:.0f} us/token,"
        f" decode {cost.decode_base * 1e3:.1f} ms + {cost.decode_per_seq * 1e3:.2f} ms/sequence"
    )
    costs = Costs(
        step_seconds=cost.prefill_base,
        tokens_per_second=1 / cost.prefill_per_token,
        step_tokens=1024,  # the live replicas' max_num_batched_tokens
        tier0_tokens=2048 * BLOCK_SIZE,  # their num_blocks
        t1_tokens=1 << 40,
        decode_replicas=1,
        decode_step_seconds=cost.decode_base,
        decode_seq_seconds=cost.decode_per_seq,
        hop_seconds=0.001,
    )
    seconds = args.seconds
    scale, max_context = 0.5, 7000  # the tiny model has 8,192 positions
    trace = agentic_trace(args.seed, int(50 * seconds), scale, max_context)
    rate = args.live_rate
    live_args = argparse.Namespace(
        prefill=2,
        decode=1,
        seed=args.seed,
        seconds=seconds,
        turns=4,
        mooncake=None,
        agentic_scale=scale,
        agentic_max_context=max_context,
    )
    rows = []
    for policy in ("hashing", "deepmesh"):
        real = live.run(live_args, MemoryBus(), model, cost, policy, "agentic", rate)
        loads = [load for _, load in real["replica_speeds"] if load > 0]
        if loads:  # the store's speed as the replicas measured it, for the simulation's tiers
            costs.load_tokens_per_second = {"t1": min(loads), "t2": min(loads)}
        predicted = simulate(trace, 2, rate, policy, seconds, costs, args.seed, whole_run=True)
        rows.append((policy, real, predicted))
        print(f"  {policy}: measured {_ttfts(real)}, predicted {_ttfts(predicted)}", flush=True)
        print(
            f"    decode, a token: measured {real['itl_p50'] * 1e3:.0f} ms,"
            f" predicted {predicted['itl_p50'] * 1e3:.0f} ms"
        )
    print(f"{rate:.3f} sessions/s for {seconds:g} s, 2 prefill replicas, predicted busy {predicted['busy_share']:.0%}:")
    print("| policy | turns measured / predicted | TTFT P50 measured / predicted | P90 | P99 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for policy, real, predicted in rows:
        cells = [f"{real[k]:.2f} / {predicted[k]:.2f} s" for k in ("ttft_p50", "ttft_p90", "ttft_p99")]
        print(f"| {policy} | {real['jobs']} / {predicted['jobs']} | " + " | ".join(cells) + " |")
    (_, hash_real, hash_predicted), (_, ours_real, ours_predicted) = rows
    print(
        f"router P90 / hashing P90: measured {ours_real['ttft_p90'] / hash_real['ttft_p90']:.2f}x,"
        f" predicted {ours_predicted['ttft_p90'] / hash_predicted['ttft_p90']:.2f}x"
    )


def _ttfts(result: dict) -> str:
    return "TTFT P50/P90/P99 " + "/".join(f"{result[k]:.2f}" for k in ("ttft_p50", "ttft_p90", "ttft_p99")) + " s"


if __name__ == "__main__":
    main()
