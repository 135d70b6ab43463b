"""What running the suite in the Makefile's lanes, on pytest-xdist workers, needs of its tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def ids_run_once(items: Iterable[Any]) -> list[str]:
    """The ids that more than one test shares, outside the tests marked `alone` (run by one pytest
    of their own): the workers receive tests by id, so of several under one id only one would run,
    and no one would know."""
    counts = Counter(item.nodeid for item in items if not item.get_closest_marker("alone"))
    return sorted(nodeid for nodeid, n in counts.items() if n > 1)


def in_process_outside(items: Iterable[Any], tier: Path) -> list[str]:
    """The tests marked `in_process` outside `tier`: the lane that runs them collects only that tier
    (every pytest process imports what it collects), and the others deselect them, so they would
    never run, and no one would know."""
    return sorted(
        item.nodeid for item in items if item.get_closest_marker("in_process") and tier not in item.path.parents
    )
