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
        # what a worker uses to reach the cache service over HTTP: the store's database and tiers
        # stay in the service (importing them was 0.9 CPU-seconds of every worker's start)
        (["cache_svc.client"], {"sqlalchemy", "alembic", "redis", "cache_svc.store", "cache_svc.catalog"}),
        # Dynamo and Inductor load where graphs are made: imported, they cost 1.5 s of every start
        (
            ["engine", "prefill_svc.worker", "decode_svc.worker", "deepmesh.mesh", "deepmesh.cli"],
            {"torch._dynamo", "torch._inductor"},
        ),
    ],
    ids=["cache_svc", "gateway", "engine", "cache_client", "eager"],
)
def test_a_service_imports_nothing_below_its_boundary(modules, forbidden):
    imported = imported_modules(*modules)
    assert {name for name in forbidden if any(m == name or m.startswith(name + ".") for m in imported)} == set()


def test_the_tokenizer_reads_a_checkpoint_without_loading_torch(tiny_v41_preset):
    """The tokenizer service reads a checkpoint's config (engine.families: its family, context
    length, EOS ids, vision geometry) and nothing of the model: importing torch for it cost each
    tokenizer process 2.3 CPU-seconds to start, and the memory torch holds."""
    code = (
        "import sys; from tokenizer_svc.protocol import Codec; "
        f"codec = Codec.for_model({str(tiny_v41_preset)!r}, 'model'); "
        "print(codec.images is not None, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert found == ["True", "[]"]
