"""Dependencies point down: services use the engine and common code, never one another.

Each check imports a service's modules in a fresh interpreter and lists what came along:
an import that crosses a boundary fails here, not in a deployment (a cache host without
torch, a gateway image without the model code).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

WORKERS = {"prefill_svc", "decode_svc", "tokenizer_svc"}


def imported_packages(*modules: str) -> set[str]:
    code = f"import sys, {', '.join(modules)}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
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
    ],
    ids=["cache_svc", "gateway"],
)
def test_a_service_imports_nothing_below_its_boundary(modules, forbidden):
    assert imported_packages(*modules) & forbidden == set()
