"""Continuous batching: which sequences run in the next step, and with how many tokens.

A step is either all prefill (chunks of prompts, within a token budget) or all decode
(one token for every running sequence). Sequences join between any two steps and leave
as soon as they finish or are aborted. When state blocks run out, the most recently
admitted sequence is preempted: its state is dropped and it is recomputed later from
its tokens, which gives the same result; nothing is ever truncated.

Priorities (SamplingParams.priority, 0 first): a waiting request is admitted, and a chunked
prompt continued, before any of a larger number; when blocks run out, the victim is the
most recently admitted request of the largest number. A prefill step with priority-0 work
in it takes nothing else, and one without takes at most `max_low_priority_tokens` tokens, so
that priority-0 work arriving meanwhile waits for a short step only; while priority-0
requests decode, such steps alternate with decode steps; and while `hold_low_priority` is set
(priority-0 work is on its way to this engine or another one on the same thread), steps take
priority-0 work only. So batch work (1) runs in what interactive work (0) leaves free, and
gives it back as soon as interactive work needs it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.sequence import Sequence, SequenceStatus
from engine.state_cache import StateCache


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # tokens each sequence computes in this step
    is_prefill: bool


class Scheduler:
    def __init__(
        self, cache: StateCache, max_num_seqs: int, max_num_batched_tokens: int, max_low_priority_tokens: int = 256
    ):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_low_priority_tokens = max_low_priority_tokens
        self._low_prefill_last = False  # the last step prefilled priority > 0 work only
        # while set, steps take priority-0 work only: something priority-0 is on its way that
        # must not wait for steps of other work (another engine on the same thread may set it)
        self.hold_low_priority = False
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose slot and blocks are already set up (its state was imported)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the schedule and give back its state."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def schedule(self) -> ScheduledBatch | None:
        if self._low_prefill_last and any(s.params.priority == 0 and s.num_pending == 1 for s in self.running):
            # priority-0 requests are decoding: they get a step between two low-priority prefill steps
            step = self._schedule_decode()
        else:
            step = self._schedule_prefill() or self._schedule_decode()
        self._low_prefill_last = step is not None and step.is_prefill and all(s.params.priority for s in step.seqs)
        return step

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        low_budget = self.max_low_priority_tokens
        # priority-0 work to prefill: the step takes no other
        urgent = any(s.params.priority == 0 for s in self.waiting) or any(
            s.params.priority == 0 and s.num_pending > 1 for s in self.running
        )
        seqs: list[Sequence] = []
        counts: list[int] = []

        def allowed(seq: Sequence) -> int:
            if seq.params.priority == 0:
                return budget
            return 0 if urgent or self.hold_low_priority else min(budget, low_budget)

        # Sequences already admitted but with more than one token to compute (chunked prompts) first.
        for seq in sorted(self.running, key=_priority):
            if budget == 0:
                break
            if seq.num_pending <= 1 or seq not in self.running:
                continue
            n = min(seq.num_schedulable, allowed(seq))
            if n == 0 or not self._reserve(seq, seq.num_computed + n, protect=seqs):
                break
            seqs.append(seq)
            counts.append(n)
            budget -= n
            low_budget -= n * (seq.params.priority > 0)
        if any(s.params.priority for s in self.waiting):  # stable: first come first within a priority
            self.waiting = deque(sorted(self.waiting, key=_priority))
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_schedulable, allowed(seq))
            if n == 0 or self.cache.num_free_slots == 0 or not self._fits(seq.num_computed + n, seq):
                break
            self.waiting.popleft()
            seq.slot = self.cache.allocate_slot()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._reserve(seq, seq.num_computed + n, protect=seqs)
            seqs.append(seq)
            counts.append(n)
            budget -= n
            low_budget -= n * (seq.params.priority > 0)
        return ScheduledBatch(seqs, counts, is_prefill=True) if seqs else None

    def _schedule_decode(self) -> ScheduledBatch | None:
        seqs: list[Sequence] = []
        for seq in list(self.running):
            if seq not in self.running or seq.num_pending != 1:  # preempted to make room for an earlier one
                continue
            if self.hold_low_priority and seq.params.priority:
                continue
            # and room for the rows of its drafts, which a verify step computes past its tokens
            if self._reserve(seq, seq.num_tokens + len(seq.drafts), protect=seqs):
                seqs.append(seq)
        return ScheduledBatch(seqs, [1] * len(seqs), is_prefill=False) if seqs else None

    def _fits(self, num_tokens: int, seq: Sequence) -> bool:
        if not self.cache.uses_blocks:
            return True
        return self.cache.blocks_needed(num_tokens) - len(seq.block_table) <= self.cache.block_allocator.num_free

    def _reserve(self, seq: Sequence, num_tokens: int, protect: list[Sequence]) -> bool:
        """Give `seq` blocks for `num_tokens` tokens, preempting newer sequences if needed.

        Returns False (and preempts `seq` itself) when only `protect`ed sequences are left to preempt.
        """
        if not self.cache.uses_blocks:
            return True
        while not self._fits(num_tokens, seq):
            victims = [s for s in self.running if s is not seq and s not in protect]
            if not victims:
                self._preempt(seq)
                return False
            self._preempt(max(victims, key=lambda s: (s.params.priority, s.arrival)))
        while len(seq.block_table) < self.cache.blocks_needed(num_tokens):
            seq.block_table.append(self.cache.block_allocator.allocate())
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed = 0
        seq.drafts = []  # guesses at what followed the state it no longer has
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        for block_id in seq.block_table:
            self.cache.block_allocator.release(block_id)
        seq.block_table = []
        if seq.slot is not None:
            self.cache.release_slot(seq.slot)
            seq.slot = None


def _priority(seq: Sequence) -> int:
    return seq.params.priority
