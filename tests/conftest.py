"""Shared fixtures (small random checkpoints written once per test session) and the check that
nothing a test started outlives the run.

Tiers: tests/unit (no subprocess, network or broker), tests/integration (the stack's real
Kafka, PostgreSQL and Redis; the mesh embedded in this process), tests/system (services as
processes of their own, compiled engines, the reference matrices)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine import LLMEngine
from engine.checkpoint.make_model import write_checkpoint
from tests.support.infra import BrokerNames
from tests.support.leftovers import mark_this_run, wait_for_leftovers
from tests.support.models import PARITY_CONFIGS
from tests.support.parallel import ids_run_once, in_process_outside

# One torch thread in this process and in every process the tests start (OMP_NUM_THREADS is
# inherited): a run holds many processes at once (two pytest-xdist workers, clusters of services),
# and where each has as many OpenMP threads as the machine has cores, every parallel op waits at
# its barrier for a thread whose core another process holds. On two cores beside a running suite,
# `deepmesh generate` decoded the tiny preset at 5 tokens/s with two threads and at 32 with one.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)

# Every service the tests start decodes and prefills eager: compiling takes minutes a bucket on a
# fresh machine. tests/system/test_compiled_decode.py and test_compiled_prefill.py compile once and
# check the compiled steps' tokens.
os.environ["DEEPMESH_COMPILE_DECODE"] = "0"
os.environ["DEEPMESH_COMPILE_PREFILL"] = "0"
# Inductor's code generation in the compiling process itself, not in a pool of two workers and its
# sidecar, which start as more processes importing torch on the same two cores (Inductor's test:
# 77 CPU-seconds with the pool, 68 without) and outlived a run of that module alone, whose check
# for leftover processes then failed it.
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"

THIS_RUN = mark_this_run()
STACK_DIR = Path(__file__).resolve().parent.parent / ".cache" / "stack"


SYSTEM_TIER = Path(__file__).resolve().parent / "system"
# The in_process modules that take longest, longest first (CPU seconds on two cores: 112, 62, 58,
# 38, 30, 30; the rest take 20 or less). The two workers running behind take a module each, then
# the next as each finishes: the longest first, they end within seconds of each other (started
# last, test_parity_v41.py ran 45 s on one worker after the other had finished).
LONGEST_MODULES = [
    SYSTEM_TIER / name
    for name in (
        "test_compiled_decode.py",
        "test_parity_v41.py",
        "test_compiled_decode_inductor.py",
        "test_checkpoint_formats.py",
        "test_cli.py",
        "test_engine_sweeps.py",
    )
]
BROKER_NAMES = pytest.StashKey[BrokerNames]()


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The system tier runs alone (after the parallel part of `make test`): its clusters, compiles
    and restarts take both cores, and its tests wait on deadlines that a neighbour would miss.
    Its `in_process` tests (long computations in the test's own process, no deadline) run behind
    the rest from the start, at the lowest CPU priority (the Makefile), on what it leaves idle."""
    for item in items:
        if SYSTEM_TIER in item.path.parents and item.get_closest_marker("in_process") is None:
            item.add_marker(pytest.mark.alone)
    # the longest modules first: on workers, started last they would run alone at the end (the
    # Makefile's --no-loadscope-reorder keeps this order; xdist's own is by number of tests)
    order = {path: i for i, path in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: order.get(item.path, len(order)))
    if shared := ids_run_once(items):
        raise pytest.UsageError(f"tests collected under one id, outside the `alone` part: {shared}")
    if stray := in_process_outside(items, SYSTEM_TIER):
        raise pytest.UsageError(f"`in_process` outside tests/system, where the lane behind never looks: {stray}")


def pytest_sessionstart(session: pytest.Session) -> None:
    bootstrap = os.environ.get("DEEPMESH_KAFKA_BOOTSTRAP")
    # the run as a whole, not each pytest-xdist worker
    if bootstrap and "PYTEST_XDIST_WORKER" not in os.environ and (names := BrokerNames.taken(bootstrap)):
        session.config.stash[BROKER_NAMES] = names


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail the run if a process one of its tests started is still alive (and end it); delete
    the topics and consumer groups its tests made."""
    found = wait_for_leftovers(THIS_RUN, STACK_DIR)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    names = session.config.stash.get(BROKER_NAMES, None)
    if names is not None and (problem := names.delete_new()) is not None and reporter is not None:
        reporter.write_line(f"the topics and groups this run made stay on the broker: {problem}", yellow=True)
    if not found:
        return
    if reporter is not None:
        reporter.write_sep("=", f"{len(found)} process(es) started by this run outlived it (now killed)", red=True)
        for leftover in found:
            reporter.write_line(str(leftover))
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        name: write_checkpoint(root / name, config, seed=seed)
        for seed, (name, config) in enumerate(PARITY_CONFIGS.items(), start=1)
    }


@pytest.fixture(scope="session")
def tiny_preset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset as `make run` makes it (seed 0, the V4 tokenizer): what the mesh, the
    gateway and the distributed tests serve. Written once; nothing writes into it."""
    from engine.checkpoint.make_model import make_model

    return make_model(tmp_path_factory.mktemp("preset") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_v41_preset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny DeepSeek-V4.1 preset as `deepmesh make-model D --preset tiny-v41 --seed 1` makes it
    (the V4.1 tokenizer): what the tests that run on both families serve for V4.1. Seed 1: greedy,
    its random weights close a free JSON string and stop after one tool call within the
    structured-output tests' max_tokens, as the V4 preset's seed 0 does (seed 0's do not)."""
    from engine.checkpoint.make_model import make_model

    return make_model(tmp_path_factory.mktemp("preset-v41") / "tiny-v41", "tiny-v41", seed=1)


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["tiny-preset"]


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint: Path):
    return LLMEngine.from_pretrained(tiny_checkpoint).model


@pytest.fixture
def engine(tiny_model) -> LLMEngine:
    """A fresh engine (scheduler and state) over the shared tiny model."""
    return LLMEngine(tiny_model, max_num_seqs=16, max_num_batched_tokens=512)
