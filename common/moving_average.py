"""What a replica measures of its own speed, smoothed: one exponentially weighted average.

Prefill weighs loading a prefix against computing it by the speeds it measured (and reports
them to the routers), decode reports its step time, and the cache weighs each tier by its read
speed. Each measurement is noisy (a step's batch, a read's size, the host's other work), so
each keeps a moving average: the first measurement replaces the assumed value, and each later
one moves the average by `weight`.
"""

from __future__ import annotations


class MovingAverage:
    def __init__(self, weight: float, assumed: float = 0.0):
        """`weight`: the share of each new measurement; `assumed`: the value until the first one
        (0: unknown, which readers check for)."""
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight!r}")
        self.weight = weight
        self.value = assumed
        self.samples = 0

    def observe(self, measured: float) -> float:
        """Take in one measurement; returns the new average."""
        if self.samples == 0:
            self.value = measured
        else:
            self.value = (1 - self.weight) * self.value + self.weight * measured
        self.samples += 1
        return self.value
