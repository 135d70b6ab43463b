"""The guard against tests that pytest-xdist would silently run once (tests/support/parallel.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.support.parallel import ids_run_once


def item(nodeid: str, marker: str | None = None) -> SimpleNamespace:
    mark = getattr(pytest.mark, marker).mark if marker else None
    return SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda name: mark if name == marker else None)


def test_tests_sharing_an_id_are_named_unless_one_pytest_runs_them_all():
    together = [item("b::v", "alone"), item("b::v", "alone")]
    behind = [item("c::w", "in_process"), item("c::w", "in_process")]  # on workers too
    assert ids_run_once([item("a::t"), item("a::u"), item("a::t"), *together, *behind]) == ["a::t", "c::w"]
    assert ids_run_once([item("a::t"), item("a::u")]) == []


def test_this_suite_has_none(request):
    assert ids_run_once(request.session.items) == []
