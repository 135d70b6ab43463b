"""Cache maintenance: write-behind, expiry sweeps, tier rebalancing and orphan collection.

The work happens where the data is: in the cache service process, which holds T1 in its
memory. Distributed, Celery beat schedules the tasks on a Redis broker and a Celery worker
runs each one by calling the cache service (POST /v1/maintenance/{task}):

    celery -A cache_svc.maintenance worker --beat

In the embedded mode (`deepmesh serve`) a thread of the serving process runs the same tasks
on the same schedule, on the store directly.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx
from celery import Celery

from cache_svc.store import StateStore
from common.settings import Settings

log = logging.getLogger(__name__)

TASKS: dict[str, Callable[[StateStore], object]] = {
    "flush": StateStore.flush,  # first: what expiry or rebalancing drops must have been written down
    "sweep": StateStore.sweep,
    "rebalance": StateStore.rebalance,
    "collect_orphans": StateStore.collect_orphans,
}
# how many maintenance periods apart each task runs: orphan collection reads the whole catalog
EVERY = {"flush": 1, "sweep": 1, "rebalance": 1, "collect_orphans": 30}

settings = Settings()
app = Celery("deepmesh.cache", broker=settings.redis_url)
app.conf.update(
    beat_schedule={
        task: {"task": f"deepmesh.cache.{task}", "schedule": EVERY[task] * settings.cache_maintenance_seconds}
        for task in TASKS
    },
    # one queue per mesh and cache replica: each replica's worker and beat serve that replica only
    task_default_queue=f"{settings.topic_prefix}cache-maintenance@{urlsplit(settings.cache_url).netloc}",
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)


def _call_cache(task: str) -> dict:
    response = httpx.post(f"{settings.cache_url.rstrip('/')}/v1/maintenance/{task}", timeout=300)
    response.raise_for_status()
    return response.json()


def _remote(task: str) -> None:
    """Register a Celery task that runs a maintenance task in the cache service."""

    def run() -> dict:
        return _call_cache(task)

    run.__name__ = run.__qualname__ = task
    app.task(name=f"deepmesh.cache.{task}")(run)


for _task in TASKS:
    _remote(_task)


def run_task(store: StateStore, task: str) -> object:
    return TASKS[task](store)


class MaintenanceThread(threading.Thread):
    """The embedded mode's scheduler: every task, every `interval` seconds, on the store itself."""

    def __init__(self, store: StateStore, interval: float, stop: threading.Event):
        super().__init__(name="cache-maintenance", daemon=True)
        self.store, self.interval, self.stop = store, interval, stop

    def run(self) -> None:
        rounds = 0
        while not self.stop.wait(self.interval):
            rounds += 1
            for task in (t for t in TASKS if rounds % EVERY[t] == 0):
                try:
                    run_task(self.store, task)
                except Exception:  # the next round retries; a cache must not take the service down
                    log.exception("cache maintenance task %s failed", task)
