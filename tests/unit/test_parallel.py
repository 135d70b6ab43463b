"""The guard against tests that pytest-xdist would silently run once (tests/support/parallel.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.support.parallel import ids_run_once


def item(nodeid: str, alone: bool = False) -> SimpleNamespace:
    marker = pytest.mark.alone.mark if alone else None
    return SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda name: marker if name == "alone" else None)


def test_tests_sharing_an_id_are_named_unless_they_run_alone():
    assert ids_run_once([item("a::t"), item("a::u"), item("a::t"), item("b::v", True), item("b::v", True)]) == ["a::t"]
    assert ids_run_once([item("a::t"), item("a::u")]) == []


def test_this_suite_has_none(request):
    assert ids_run_once(request.session.items) == []
