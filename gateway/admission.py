"""Admission control: refuse a call now (429, Retry-After) rather than queue it past a bound.

The prefill replicas report the prompt tokens they have queued and how fast they compute
(common/replicas.py); the soonest any of them could start a new prompt is the least of
queued / speed. The gateway adds what it admitted itself since those reports were taken (its
own calls are not in them yet): without that, a burst would all be admitted on the strength
of one report. Async jobs are never refused: they wait in the queue, which is what they are for.

No reports, or no prefill replica in rotation (all restarting), admits: the job waits in
Kafka for the replica that comes next, as it would without routing.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from common.replicas import ReplicaTable
from common.routing import DEFAULT_TOKENS_PER_SECOND

BYTES_PER_TOKEN = 4  # a request body's size in tokens, roughly, before the tokenizer has seen it


class Admission:
    def __init__(self, replicas: ReplicaTable, max_wait_seconds: float, clock: Callable[[], float] = time.time):
        """`clock`: the time reports are stamped in (a simulation's own)."""
        self.replicas = replicas
        self.max_wait_seconds = max_wait_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._admitted: deque[tuple[float, int]] = deque()  # (clock(), estimated tokens)

    def predicted_wait(self) -> float | None:
        """Seconds until the least loaded prefill replica could start a new prompt (None: no
        replica in rotation to ask)."""
        reports = self.replicas.live("prefill")
        if not reports:
            return None
        oldest_report = min(r.sent_at for r in reports)
        with self._lock:
            while self._admitted and self._admitted[0][0] < oldest_report - 1.0:
                self._admitted.popleft()
            unreported = sum(tokens for at, tokens in self._admitted if at >= oldest_report)
        speeds = [r.tokens_per_second or DEFAULT_TOKENS_PER_SECOND for r in reports]
        soonest = min(r.queued_tokens / speed for r, speed in zip(reports, speeds, strict=True))
        return soonest + unreported / sum(speeds)  # what it admitted since spreads over the replicas

    def retry_after(self, body_bytes: int) -> int | None:
        """None to admit the call (and count it), or the whole seconds after which to retry."""
        if self.max_wait_seconds <= 0:
            return None
        wait = self.predicted_wait()
        if wait is not None and wait > self.max_wait_seconds:
            return max(1, math.ceil(wait - self.max_wait_seconds))
        with self._lock:
            self._admitted.append((self.clock(), body_bytes // BYTES_PER_TOKEN))
        return None
