"""What running the suite on pytest-xdist workers needs of its tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any


def ids_run_once(items: Iterable[Any]) -> list[str]:
    """The ids that more than one test shares, outside the tests marked `alone` or `in_process`
    (each run by one pytest of its own): the workers receive tests by id, so of several under one
    id only one would run, and no one would know."""
    single = ("alone", "in_process")
    counts = Counter(item.nodeid for item in items if not any(item.get_closest_marker(marker) for marker in single))
    return sorted(nodeid for nodeid, n in counts.items() if n > 1)
