"""The gateway over the embedded mesh (every service in this process) for the modules that test it
with the official SDKs: each says which checkpoint it serves as its `model` fixture."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from common.bus import MemoryBus
from common.claims import ClaimStore
from deepmesh.mesh import Mesh
from gateway.app import create_app
from gateway.jobs import JobStore
from tests.support.behaviour import MODEL, ServerThread, scripted_gateway
from tests.support.infra import fresh_database, scratch_store


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Job state in a schema of its own in the stack's PostgreSQL (SQLite when run by hand
    without it): each module's batch runner sees its own batches only."""
    store = JobStore(fresh_database(tmp_path_factory.mktemp("db")))
    yield store
    store.close()


@pytest.fixture(scope="module")
def mesh_options() -> dict:
    """More keyword arguments for the module's Mesh (a module overrides this fixture)."""
    return {}


@pytest.fixture(scope="module")
def service(model, jobs, tmp_path_factory, mesh_options):
    bus = MemoryBus(ClaimStore(tmp_path_factory.mktemp("claims")))  # as `deepmesh serve` runs it
    state = scratch_store(tmp_path_factory.mktemp("state"))
    mesh = Mesh(model, bus, state, served_model=MODEL, **mesh_options).start()
    files_dir = tmp_path_factory.mktemp("files")
    app = create_app(bus, "deepmesh.", [MODEL], jobs, files_dir=str(files_dir), batch_rounds=0.2)
    with ServerThread(app) as server:
        yield SimpleNamespace(
            url=server.url,
            model=model,
            decode_running=lambda: len(mesh.decode.jobs),
            pinned_by=mesh.store.catalog.pinned_by,
            reusable=mesh.prefill.engine.reusable_prefix,
            mesh=mesh,
            bus=bus,
            prefix="deepmesh.",
        )
    mesh.stop()


@pytest.fixture(scope="module")
def scripted(model, jobs, tmp_path_factory):
    with scripted_gateway(model, jobs, tmp_path_factory.mktemp("claims")) as running:
        yield running
