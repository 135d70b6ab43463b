"""What the gateway's handlers share: its settings, the bus, the stores and the result waiter.

`create_app` builds one `GatewayState` and sets it on `app.state.gateway`; the routers reach it
through the dependencies below, so every handler is a plain function of its module, testable
and readable without the application around it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from common.bus import Bus
from gateway.admission import Admission
from gateway.batch_store import BatchStore
from gateway.dispatch import Dispatcher
from gateway.files import FileStore
from gateway.jobs import JobStore
from gateway.keys import KeyStore
from gateway.ledger import Ledger
from gateway.quotas import MemoryQuotas, RedisQuotas
from gateway.results import JobRecorder, ResultRouter
from gateway.stored_responses import StoredResponses


@dataclass
class GatewayState:
    """One gateway process's settings and collaborators. The stores are None without a
    database (`jobs` None: only the protocol endpoints are served)."""

    bus: Bus
    served_models: list[str]
    result_timeout: float
    require_keys: bool
    batch_rounds: float | None  # a batch round every so many seconds in this process; None: elsewhere
    batch_in_flight: int
    admission: Admission | None  # None: every call is queued
    router: ResultRouter  # hands each waiting call its job's results
    recorder: JobRecorder  # stores async jobs' results
    dispatcher: Dispatcher
    quotas: MemoryQuotas | RedisQuotas
    jobs: JobStore | None
    files: FileStore | None
    batches: BatchStore | None
    keys: KeyStore | None
    ledger: Ledger | None
    stored_responses: StoredResponses | None
    cache_stats: Callable[[], dict] | None = None  # the embedded KV cache's statistics
    max_model_len: int | None = None  # the served model's context length (GET /v1/models)
    stop_batches: threading.Event = field(default_factory=threading.Event)


async def gateway_state(request: Request) -> GatewayState:  # async: a plain def would run on a thread (auth.py)
    return request.app.state.gateway


State = Annotated[GatewayState, Depends(gateway_state)]
