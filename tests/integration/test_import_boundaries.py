"""What each service really imports, in a fresh interpreter: the static table of
tests/unit/test_layering.py, checked against sys.modules after the import."""

from __future__ import annotations

import subprocess
import sys

import pytest

WORKERS = {"prefill_svc", "decode_svc", "tokenizer_svc"}


def imported_modules(*modules: str) -> set[str]:
    code = f"import sys, {', '.join(modules)}; print(' '.join(sorted(sys.modules)))"
    return set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())


@pytest.mark.parametrize(
    "modules, forbidden",
    [
        # stores bytes and metadata: runs where no model can
        (
            ["cache_svc.app", "cache_svc.client", "cache_svc.store", "cache_svc.maintenance"],
            {"torch", "engine", "safetensors"} | WORKERS,
        ),
        # talks HTTP and Kafka only
        (["gateway.app"], {"torch", "engine", "cache_svc", "deepseek_recipe"} | WORKERS),
        # runs embedded in any service: none of them, nor their wire messages or database
        (
            ["engine", "engine.prefix_connector", "engine.prefix_store", "engine.resident_prefixes"],
            {"cache_svc", "gateway", "sqlalchemy", "kafka", "common.messages", "common.bus"} | WORKERS,
        ),
        # Dynamo and Inductor load where graphs are made: imported, they cost 1.5 s of every start
        (
            ["engine", "prefill_svc.worker", "decode_svc.worker", "deepmesh.mesh", "deepmesh.cli"],
            {"torch._dynamo", "torch._inductor"},
        ),
    ],
    ids=["cache_svc", "gateway", "engine", "eager"],
)
def test_a_service_imports_nothing_below_its_boundary(modules, forbidden):
    imported = imported_modules(*modules)
    assert {name for name in forbidden if any(m == name or m.startswith(name + ".") for m in imported)} == set()
