"""A batch runner's round in a process of its own that dies part way. Kept apart from the test
module: a spawned process imports the module its target lives in, and this one imports only
the gateway's batch code (the test module's imports would cost the child seconds)."""

from __future__ import annotations

import os
from pathlib import Path

from gateway.batch_runner import BatchRunner
from gateway.files import FileStore
from gateway.jobs import JobStore


def round_killed(url: str, files: str, produced: str, kill_after: int) -> None:
    """A runner process's round that dies as under SIGKILL (no `finally`, no commit) right
    after the broker took its `kill_after`-th record (0: before the first)."""
    jobs = JobStore(url)
    taken: list[str] = []

    def send(job_id: str, endpoint: str, body: dict, options: dict) -> None:
        if kill_after == 0:
            os._exit(9)
        taken.append(job_id)
        Path(produced).write_text("\n".join(taken))
        if len(taken) == kill_after:
            os._exit(9)

    BatchRunner(jobs, FileStore(jobs.session, files), send, lambda job_id: None, 6).advance()
