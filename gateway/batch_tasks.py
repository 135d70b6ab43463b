"""The batch runner as a Celery task, for the distributed mode: Celery beat schedules a round
every DEEPMESH_BATCH_ROUND_SECONDS on the stack's Redis, and a worker runs it against the
gateway's database, the shared files directory and Kafka:

    celery -A gateway.batch_tasks worker --beat --pool solo

Any number of gateway replicas serve the batch API meanwhile; none of them needs to be up for
batches to progress (results wait in Kafka for a gateway's job recorder). Rounds never
overlap on one worker (`--pool solo`); two workers may overlap safely (gateway/batch_runner.py
takes each request under a row lock), but one is enough.
"""

from __future__ import annotations

import logging
from functools import cache

from celery import Celery
from celery.signals import celeryd_init
from celery.signals import setup_logging as logging_signal

from common.bus import KafkaBus
from common.claims import ClaimStore
from common.logs import setup_logging
from common.settings import Settings
from common.topics import create_all
from common.tracing import setup_tracing
from gateway.batch_runner import BatchRunner
from gateway.dispatch import Dispatcher
from gateway.files import FileStore
from gateway.jobs import JobStore

settings = Settings()
app = Celery("deepmesh.batches", broker=settings.redis_url)
app.conf.update(
    beat_schedule={
        "advance": {
            "task": "deepmesh.batches.advance",
            "schedule": settings.batch_round_seconds,
            # a round that waited in the queue behind a slow one is pointless: the next beat sends another
            "options": {"expires": settings.batch_round_seconds * 5},
        }
    },
    task_default_queue=f"{settings.topic_prefix}batches",  # one queue per mesh
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    task_time_limit=300,
)


@celeryd_init.connect
def observe(**_) -> None:
    """The worker logs as every service does (JSON lines, from before its start-up checks warn),
    and the batch requests it sends start their traces."""
    setup_logging("batches", settings.log_level, settings.log_format)
    logging.captureWarnings(True)
    setup_tracing("batches", settings.trace_exporter, settings.trace_file)


@logging_signal.connect
def keep_our_logging(**_) -> None:
    """Connected, so that Celery leaves the logging set up above as it is."""


@cache
def runner() -> BatchRunner:
    """One per worker process: its database pool and Kafka producer are kept between rounds."""
    claims = ClaimStore.from_settings(settings)
    bus = KafkaBus(
        settings.kafka_bootstrap, "deepmesh-batches", claims, session_timeout_ms=settings.kafka_session_timeout_ms
    )
    create_all(bus, settings.topic_prefix, settings.topic_partitions)
    jobs = JobStore(settings.database_url)
    dispatcher = Dispatcher(bus, settings.topic_prefix)
    files = FileStore(jobs.session, settings.files_dir)
    return BatchRunner(
        jobs,
        files,
        dispatcher.send,
        dispatcher.cancel,
        settings.batch_in_flight,
        resend_after=settings.batch_resend_after_seconds,
    )


@app.task(name="deepmesh.batches.advance")
def advance() -> None:
    runner().advance()
