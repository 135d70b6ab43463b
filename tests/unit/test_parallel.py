"""The guards against tests that pytest-xdist would silently run once, or that no lane of `make test`
would run (tests/support/parallel.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import SYSTEM_TIER
from tests.support.parallel import ids_run_once, in_process_outside


def item(nodeid: str, marker: str | None = None, path: Path = Path("tests/unit/test_a.py")) -> SimpleNamespace:
    mark = getattr(pytest.mark, marker).mark if marker else None
    return SimpleNamespace(nodeid=nodeid, path=path, get_closest_marker=lambda name: mark if name == marker else None)


def test_tests_sharing_an_id_are_named_unless_one_pytest_runs_them_all():
    together = [item("b::v", "alone"), item("b::v", "alone")]
    behind = [item("c::w", "in_process"), item("c::w", "in_process")]  # on workers too
    assert ids_run_once([item("a::t"), item("a::u"), item("a::t"), *together, *behind]) == ["a::t", "c::w"]
    assert ids_run_once([item("a::t"), item("a::u")]) == []


def test_in_process_tests_outside_the_system_tier_are_named():
    tier = Path("/repo/tests/system")
    behind = item("s::t", "in_process", tier / "test_s.py")
    stray = item("i::t", "in_process", Path("/repo/tests/integration/test_i.py"))
    assert in_process_outside([behind, stray, item("s::u", path=tier / "test_s.py"), item("u::t")], tier) == ["i::t"]
    assert in_process_outside([behind], tier) == []


def test_this_suite_has_none(request):
    assert ids_run_once(request.session.items) == []
    assert in_process_outside(request.session.items, SYSTEM_TIER) == []
