"""The end-of-run check that nothing a test started outlives the run (tests/conftest.py), with a
mark of its own so that it sees only what it starts here."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

from tests.support.leftovers import MARK, leftovers, wait_for_leftovers


def sleeper(token: str | None) -> subprocess.Popen:
    """A process in a session of its own, as an orphaned beat would be, with the mark `token`."""
    env = {key: value for key, value in os.environ.items() if key != MARK}
    if token is not None:
        env[MARK] = token
    process = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
    # between fork and exec /proc shows the parent's environment, without the mark: wait for the exec
    deadline = time.monotonic() + 10
    while Path(f"/proc/{process.pid}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":
        assert time.monotonic() < deadline, "sleep did not start"
        time.sleep(0.001)
    return process


def test_a_process_the_run_started_is_found_wherever_it_went_and_killed(tmp_path):
    token = uuid.uuid4().hex
    marked, unmarked = sleeper(token), sleeper(None)
    try:
        assert [leftover.pid for leftover in leftovers(token, tmp_path)] == [marked.pid]
        assert [leftover.pid for leftover in wait_for_leftovers(token, tmp_path, grace=0.5)] == [marked.pid]
        assert marked.wait(timeout=10) == -9  # killed, so that a failed run leaves nothing behind
        assert leftovers(token, tmp_path) == []
    finally:
        for process in (marked, unmarked):
            process.kill()
            process.wait()


def test_the_stacks_own_processes_are_left_alone(tmp_path):
    """A broker a test restarted is left running on purpose: its pid file names it."""
    token = uuid.uuid4().hex
    broker = sleeper(token)
    try:
        assert [leftover.pid for leftover in leftovers(token, tmp_path)] == [broker.pid]
        (tmp_path / "kafka.pid").write_text(f"{broker.pid}\n")
        assert leftovers(token, tmp_path) == []
    finally:
        broker.kill()
        broker.wait()


def test_the_end_of_a_run_deletes_its_topics_but_not_those_a_live_consumer_reads():
    """What a run leaves on the stack's broker is deleted at its end: the topics and groups that
    appeared since it started, which may be another run's (a second pytest beside `make test`, whose
    clusters then lost their topics mid-test). A topic that a live consumer subscribes to stays, and
    its group; the rest go. Only this test's names are deleted here (`only`): the other tests of
    this run are running beside it."""
    from kafka.admin import KafkaAdminClient

    from common.bus import KafkaBus
    from tests.support.infra import BrokerNames, require_service

    bootstrap = require_service("DEEPMESH_KAFKA_BOOTSTRAP")
    names = BrokerNames(bootstrap)
    prefix = f"ends{uuid.uuid4().hex[:8]}."
    bus = KafkaBus(bootstrap, client_id="tests-cleanup-check")
    read, unread, done = f"{prefix}read", f"{prefix}unread", f"{prefix}done"
    bus.create_topics([read, unread, done], partitions=1)
    reader = bus.consumer([read], f"{prefix}reader")
    reader.wait_assigned(timeout=60)
    finished = bus.consumer([done], f"{prefix}finished")
    finished.wait_assigned(timeout=60)
    finished.close()  # its member leaves the group
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        assert names.delete_new(only=lambda name: name.startswith(prefix)) is None
        deadline = time.monotonic() + 30
        while {unread, done} & set(admin.list_topics()):  # deletion is asynchronous
            assert time.monotonic() < deadline, "the topics nobody reads were not deleted"
            time.sleep(0.2)
        assert read in admin.list_topics()
        groups = {group["group_id"] for group in admin.list_groups()}
        assert f"{prefix}reader" in groups and f"{prefix}finished" not in groups
    finally:
        reader.close()
        bus.close()
        assert names.delete_new(only=lambda name: name.startswith(prefix)) is None
        admin.close()
