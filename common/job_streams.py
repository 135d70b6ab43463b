"""A job's stream of numbered items, rebuilt by a consumer from messages that may repeat,
regroup or arrive past a gap.

Messages on `tokens` and `results` carry consecutive items of one job's stream (its generated
token ids, its protocol events); `Envelope.seq` is the index of a message's first item. A
producer that replays (a restarted tokenizer, a decode replica that took a job over) starts
the stream again from item 0 and may group it differently, but the items are the same: greedy
and counter-seeded sampling give the same tokens, and the same tokens render the same events.
So a consumer keeps how many items it has, skips those again, and holds a message that starts
past that point until the items before it arrive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

M = TypeVar("M")


@dataclass
class StreamCursor(Generic[M]):
    """How far one job's stream has been taken, and the messages that wait beyond a gap."""

    position: int = 0  # items taken so far
    _ahead: dict[int, list[tuple[int, M]]] = field(default_factory=dict)  # first item -> (count, message)

    def take(self, first: int, count: int, message: M) -> list[tuple[M, int]]:
        """The messages that continue the stream now, in order, each with how many of its leading
        items were taken before (to skip). A message past a gap is kept until the gap is filled;
        one with nothing new is still returned, for what it says besides its items (the end)."""
        if first > self.position:
            self._ahead.setdefault(first, []).append((count, message))
            return []
        ready = [(message, self.position - first if first + count > self.position else count)]
        self.position = max(self.position, first + count)
        while waiting := [f for f in self._ahead if f <= self.position]:
            for start in sorted(waiting):
                for count, message in self._ahead.pop(start):
                    ready.append((message, min(count, self.position - start)))
                    self.position = max(self.position, start + count)
        return ready

    @property
    def waiting(self) -> int:
        """Messages held past a gap."""
        return sum(len(messages) for messages in self._ahead.values())
