"""Processes a test run started that outlive it.

The run marks its own environment with a token of its own (`mark_this_run`); every process a
test starts inherits the mark, whatever became of its parent (a Celery beat orphaned by its
killed worker keeps it). At the end of the run, any process still alive with the mark is a
leftover, except:

* the stack's services (`scripts/stack`'s pid files): a test that restarts the broker leaves
  the new one running on purpose, for the next run;
* helpers of this very process that end with it: Python's multiprocessing resource tracker
  and Inductor's compile workers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

MARK = "DEEPMESH_TEST_RUN"
ENDS_WITH_ITS_PARENT = ("multiprocessing.resource_tracker", "torch/_inductor/compile_worker")


@dataclass(frozen=True)
class Leftover:
    pid: int
    parent: int
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid} (parent {self.parent}): {self.command}"


def mark_this_run() -> str:
    """Mark this process's environment, and so every process it starts from now on, with a
    token of its own (each pytest-xdist worker checks what it started, not its neighbour's)."""
    os.environ[MARK] = uuid.uuid4().hex
    return os.environ[MARK]


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # gone meanwhile, or not ours to read
        return b""


def _stack_pids(stack_dir: Path) -> set[int]:
    pids = set()
    for pid_file in stack_dir.glob("*.pid"):
        text = _read(pid_file).decode().strip()
        if text.isdigit():
            pids.add(int(text))
    postmaster = _read(stack_dir / "pg-data" / "postmaster.pid").decode().split("\n", 1)[0].strip()
    if postmaster.isdigit():
        pids.add(int(postmaster))
    return pids


def leftovers(token: str, stack_dir: Path) -> list[Leftover]:
    """Every live process but this one whose environment carries this run's mark."""
    wanted = f"{MARK}={token}".encode()
    stack = _stack_pids(stack_dir)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        if wanted not in _read(entry / "environ").split(b"\0"):
            continue
        # /proc/PID/stat: "pid (command) state ppid ...", the command may hold spaces and ")"
        fields = _read(entry / "stat").decode().rpartition(")")[2].split()
        if not fields or fields[0] == "Z":  # gone, or a zombie: already dead
            continue
        parent = int(fields[1])
        command = _read(entry / "cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
        pid = int(entry.name)
        if pid in stack or parent in stack:
            continue
        if parent == os.getpid() and any(helper in command for helper in ENDS_WITH_ITS_PARENT):
            continue
        found.append(Leftover(pid, parent, command))
    return found


def wait_for_leftovers(token: str, stack_dir: Path, grace: float = 10.0) -> list[Leftover]:
    """The leftovers still there after `grace` seconds (a process told to stop may still be
    stopping); each of them is then killed, so that a failed run leaves nothing behind."""
    deadline = time.monotonic() + grace
    while (found := leftovers(token, stack_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for leftover in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(leftover.pid, signal.SIGKILL)
    return found
