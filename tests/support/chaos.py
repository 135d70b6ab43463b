"""Faults while jobs run: the harness behind tests/system/test_chaos.py and benchmarks/chaos_soak.py.

Every service is an OS process over the stack's real Apache Kafka and PostgreSQL (a
tests/support/cluster.py), two replicas of each worker. While clients stream answers and
submit async jobs, `Faults` SIGKILLs a process of a random kind every few seconds and starts
a new one in its place, and SIGKILLs the broker once and starts it again. Each answer is
compared with the same greedy request computed in this process.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.behaviour import MODEL, one_process_answers, sse_events
from tests.support.cluster import Cluster
from tests.support.infra import wait_until_up

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ("tokenizer", "prefill", "decode")


def body(i: int, max_tokens: int = 24) -> dict:
    """A greedy request of its own: the i-th question."""
    question = f"Question {i}: what does a Kafka consumer group do with partition {i % 7}?"
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "thinking": {"type": "disabled"},
    }


def expected_answers(model: Path, bodies: list[dict]) -> list[tuple[str, str]]:
    """(content, finish_reason) of each request, computed by one engine in this process."""
    answers = one_process_answers(model, [("chat.completions", body) for body in bodies])
    return [(a["choices"][0]["message"]["content"], a["choices"][0]["finish_reason"]) for a in answers]


def start_cluster(root: Path, model: Path, replicas: int = 2) -> Cluster:
    """Every service but the batch runner (no batches here), with `replicas` of each worker."""
    cluster = Cluster(root, model).start(("cache", "gateway", "tokenizer", "prefill", "decode"))
    for kind in WORKERS:
        for _ in range(replicas - 1):
            cluster.spawn(kind)
    return cluster


def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


def replace(cluster: Cluster, kind: str) -> None:
    """SIGKILL one running process of this kind and start a new one in its place."""
    victims = [p for name, p in cluster.processes.items() if name.startswith(f"{kind}-") and p.poll() is None]
    kill(random.choice(victims))
    if kind == "gateway":
        cluster.spawn("gateway", "--port", str(cluster.gateway_port))
        wait_until_up(f"{cluster.url}/readyz", [], 180, f"see {cluster.root}")
    elif kind == "cache":
        cluster.spawn("cache", "--port", str(cluster.cache_port), "--dir", str(cluster.root / "kv"))
    else:
        cluster.spawn(kind)


def _broker_pid() -> int:
    """The stack's broker, as scripts/stack recorded it."""
    return int((ROOT / ".cache" / "stack" / "kafka.pid").read_text())


def restart_broker(down_seconds: float = 2.0) -> None:
    """SIGKILL the stack's broker and start it again (scripts/stack up starts what is not running)."""
    pid = _broker_pid()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(down_seconds)
    subprocess.run([str(ROOT / "scripts" / "stack"), "up"], check=True, capture_output=True, timeout=180)


@contextlib.contextmanager
def broker_frozen() -> Iterator[None]:
    """The stack's broker stopped (SIGSTOP), then continued: connections to it stay open, and
    nothing answers on them, as across a network partition."""
    pid = _broker_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def random_plan(seconds: float, every: float, kinds: tuple[str, ...], broker: bool = True) -> list[str]:
    """A fault every `every` seconds for `seconds`, each of a random kind; the broker once, midway."""
    plan = [random.choice(kinds) for _ in range(max(1, int(seconds / every)))]
    if broker:
        plan.insert(len(plan) // 2, "broker")
    return plan


@dataclass
class Faults:
    """Runs a plan of faults, one every `every` seconds: a kind of service (one of its processes
    is SIGKILLed and a new one started in its place) or "broker" (killed and started again).
    The load runs until the plan is done (`finished`), so every fault meets work in flight."""

    cluster: Cluster
    plan: list[str]
    every: float
    done: list[str] = field(default_factory=list)  # what was done, in order
    finished: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None  # a fault that could not be done
    _thread: threading.Thread | None = None

    def __enter__(self) -> Faults:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._thread.join(timeout=600)
        if self.error is not None:
            raise RuntimeError(f"fault plan stopped after {self.done}") from self.error

    def _run(self) -> None:
        try:
            for fault in self.plan:
                time.sleep(self.every)
                if fault == "broker":
                    restart_broker()
                else:
                    replace(self.cluster, fault)
                self.done.append(fault)
        except BaseException as err:
            self.error = err
        finally:
            self.finished.set()


@dataclass
class Outcome:
    """What the clients saw. `refused`: calls answered 503 (the broker away) or not connected
    (the gateway away) and sent again; not a failure, as nothing had been accepted."""

    sent: int = 0
    completed: int = 0
    failed: int = 0
    hung: int = 0
    wrong: int = 0
    refused: int = 0
    problems: list[str] = field(default_factory=list)

    def add(self, kind: str, problem: str | None = None) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if problem:
            self.problems.append(problem)

    def line(self) -> str:
        return (
            f"sent {self.sent}, completed {self.completed}, failed {self.failed}, hung {self.hung}, "
            f"wrong {self.wrong} (refused and sent again: {self.refused})"
        )


def _retrying(call, outcome: Outcome, lock: threading.Lock, until: float):
    """Call until it is not refused (503, or the gateway not there) or the time is up."""
    while True:
        try:
            response = call()
        except httpx.TransportError:  # not connected, or the connection reset: the gateway is away
            response = None
        if response is not None and response.status_code != 503:
            return response
        if response is not None:
            response.close()
        with lock:
            outcome.refused += 1
        if time.monotonic() > until:
            return None
        time.sleep(1.0)


def run_streams(
    url: str,
    bodies: list[dict],
    expected: list[tuple[str, str]],
    timeout: float,
    outcome: Outcome,
    spacing: float,
    until: threading.Event | None = None,
) -> None:
    """The requests streamed (the gateway stays up), one started every `spacing` seconds, each
    checked against its expected answer; after the last, from the first again until `until`."""
    lock = threading.Lock()

    def one(i: int) -> None:
        deadline = time.monotonic() + timeout
        with lock:
            outcome.sent += 1
        try:
            with httpx.Client(timeout=httpx.Timeout(timeout, connect=10)) as client:
                request = client.build_request("POST", f"{url}/v1/chat/completions", json={**bodies[i], "stream": True})
                response = _retrying(lambda: client.send(request, stream=True), outcome, lock, deadline)
                if response is None or response.status_code != 200:
                    with lock:
                        outcome.add("failed", f"stream {i}: {response and response.status_code}")
                    return
                events = sse_events(response)
                response.close()
        except httpx.TimeoutException:
            with lock:
                outcome.add("hung", f"stream {i}: no end after {timeout}s")
            return
        chunks = [json.loads(data) for _, data in events if data != "[DONE]"]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
        reasons = [
            c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]
        ]
        with lock:
            if not reasons:
                outcome.add("hung", f"stream {i}: ended without a finish")
            elif (content, reasons[-1]) != expected[i]:
                outcome.add("wrong", f"stream {i}: {content!r} / {reasons} != {expected[i]!r}")
            else:
                outcome.completed += 1

    with ThreadPoolExecutor(64) as pool:
        started = 0
        while started < len(bodies) or (until is not None and not until.is_set()):
            pool.submit(one, started % len(bodies))
            started += 1
            time.sleep(spacing)


def run_jobs(url: str, bodies: list[dict], expected: list[tuple[str, str]], timeout: float, outcome: Outcome) -> None:
    """Each request as an async job (the gateway may be killed meanwhile): its result and its
    replayed events checked against its expected answer."""
    lock = threading.Lock()
    deadline = time.monotonic() + timeout
    job_ids: dict[int, str] = {}
    for i, request in enumerate(bodies):
        outcome.sent += 1
        submitted = _retrying(
            lambda r=request: httpx.post(
                f"{url}/v1/jobs", json={"endpoint": "chat.completions", "body": r}, timeout=30
            ),
            outcome,
            lock,
            deadline,
        )
        if submitted is None or submitted.status_code != 202:
            outcome.add("failed", f"job {i}: submit answered {submitted and submitted.status_code}")
            continue
        job_ids[i] = submitted.json()["id"]
    while job_ids and time.monotonic() < deadline:
        for i, job_id in list(job_ids.items()):
            polled = _retrying(lambda j=job_id: httpx.get(f"{url}/v1/jobs/{j}", timeout=30), outcome, lock, deadline)
            if polled is None or polled.json()["status"] not in ("succeeded", "failed", "cancelled"):
                continue
            del job_ids[i]
            job = polled.json()
            if job["status"] != "succeeded":
                outcome.add("failed", f"job {i}: {job['status']}")
                continue
            choice = job["result"]["choices"][0]
            # read whole, and again if the gateway is killed meanwhile, as a client that retries would
            events = _retrying(
                lambda j=job_id: httpx.get(f"{url}/v1/jobs/{j}/events", timeout=60), outcome, lock, deadline
            )
            if events is None:
                outcome.add("failed", f"job {i}: its events were never replayed")
                continue
            chunks = [json.loads(d) for n, d in sse_events(events) if n is None and d != "[DONE]"]
            replayed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
            if (choice["message"]["content"], choice["finish_reason"]) != expected[i] or replayed != expected[i][0]:
                outcome.add("wrong", f"job {i}: {choice['message']['content']!r} / replayed {replayed!r}")
            else:
                outcome.completed += 1
        time.sleep(0.5)
    for i in job_ids:
        outcome.add("hung", f"job {i}: not done after {timeout}s")


def summary(done: list[str]) -> str:
    """What the faults were: `decode x3, broker x1, ...`."""
    counts = Counter(done)
    return ", ".join(f"{kind} x{n}" for kind, n in sorted(counts.items()))
