"""Job state: every async job, its status, its result and the events it streamed (for replay).

SQLAlchemy 2 over SQLite by default and PostgreSQL in production; the schema is owned by the
Alembic migrations in gateway/migrations, applied at start-up.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import JSON, Boolean, Float, ForeignKey, Integer, String, Text, delete, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from common.database import open_database

MIGRATIONS = Path(__file__).parent / "migrations"
FINAL = ("succeeded", "failed", "cancelled")
Recorded = Literal["stored", "ignored", "gap", "outcome_only"]


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    endpoint: Mapped[str] = mapped_column(String(32))
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), index=True)  # queued|running|succeeded|failed|cancelled
    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    done_data: Mapped[str | None] = mapped_column(Text, nullable=True)
    event_count: Mapped[int] = mapped_column(Integer, default=0)  # events 0 .. event_count - 1 are stored
    tenant: Mapped[str] = mapped_column(String(64), default="default")  # whose it is: nobody else reads it
    # store the events (to replay them), or only the outcome (a stored response answered as it ran)
    keep_events: Mapped[bool] = mapped_column(Boolean, default=True)
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True, index=True)  # None: kept

    @classmethod
    def queued(
        cls,
        job_id: str,
        endpoint: str,
        body: dict[str, Any],
        tenant: str = "default",
        keep_events: bool = True,
        keep_seconds: float | None = None,
    ) -> Job:
        """A new job, not yet run; deleted `keep_seconds` after it was created (None: kept)."""
        now = time.time()
        return cls(
            id=job_id,
            endpoint=endpoint,
            body=body,
            status="queued",
            created_at=now,
            event_count=0,
            tenant=tenant,
            keep_events=keep_events,
            expires_at=now + keep_seconds if keep_seconds is not None else None,
        )

    def to_api(self) -> dict[str, Any]:
        succeeded = self.status == "succeeded"
        return {
            "id": self.id,
            "object": "job",
            "endpoint": self.endpoint,
            "status": self.status,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "result": self.result if succeeded else None,
            "error": self.result if self.status == "failed" else None,
            "usage": (self.result or {}).get("usage") if succeeded else None,
        }


class JobEvent(Base):
    __tablename__ = "job_events"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)  # the event's index in the job's stream
    name: Mapped[str | None] = mapped_column(String(64), nullable=True)
    data: Mapped[str] = mapped_column(Text)


class JobStore:
    def __init__(self, url: str):
        self.engine, self.session = open_database(url, MIGRATIONS)

    def create(self, job_id: str, endpoint: str, body: dict[str, Any], **options: Any) -> Job:
        """`options`: Job.queued's (tenant, keep_events, keep_seconds)."""
        job = Job.queued(job_id, endpoint, body, **options)
        with self.session.begin() as s:
            s.add(job)
        return job

    def delete(self, job_id: str) -> None:
        with self.session.begin() as s:
            job = s.get(Job, job_id)
            if job is not None:
                s.delete(job)

    def get(self, job_id: str) -> Job | None:
        with self.session() as s:
            return s.get(Job, job_id)

    def record(
        self,
        job_id: str,
        first_event: int,
        events: list[tuple[str | None, str]],
        done: bool,
        status: int,
        body: dict[str, Any] | None,
        done_data: str | None,
    ) -> Recorded:
        """Store one results message of a job: its events, by their index in the job's stream
        (`first_event` is the first one's), and when done the outcome. "ignored" when there is
        nothing to store for this id (not an async job, or one that has ended); "gap" when the
        message starts past the events stored so far (the caller holds it until they arrive);
        "outcome_only" for a job that keeps no events (only its end will change it again).

        Idempotent: events already stored, however a replay regroups them, are skipped.
        """
        with self.session.begin() as s:
            job = s.get(Job, job_id, with_for_update=True)
            if job is None or job.status in FINAL:
                return "ignored"
            if job.keep_events:
                if first_event > job.event_count:
                    return "gap"
                for index, (name, data) in enumerate(events, start=first_event):
                    if index >= job.event_count:
                        s.add(JobEvent(job_id=job_id, seq=index, name=name, data=data))
            job.event_count = max(job.event_count, first_event + len(events))
            now = time.time()
            if job.status == "queued":
                job.status, job.started_at = "running", now
            if done:
                job.status = "succeeded" if status == 200 else "failed"
                job.finished_at, job.status_code, job.result, job.done_data = now, status, body, done_data
            return "stored" if job.keep_events or done else "outcome_only"

    def cancel(self, job_id: str) -> Job | None:
        with self.session.begin() as s:
            job = s.get(Job, job_id, with_for_update=True)
            if job is not None and job.status not in FINAL:
                job.status, job.finished_at = "cancelled", time.time()
            return job

    def purge_expired(self, now: float | None = None) -> int:
        """Delete the jobs past their expiry (their events go with them); how many."""
        with self.session.begin() as s:
            gone = s.execute(delete(Job).where(Job.expires_at < (now if now is not None else time.time())))
            return gone.rowcount or 0

    def last_event(self, job_id: str, names: frozenset[str]) -> JobEvent | None:
        """The job's latest event of one of these names."""
        with self.session() as s:
            query = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.name.in_(names))
            return s.scalars(query.order_by(JobEvent.seq.desc()).limit(1)).first()

    def events(self, job_id: str, after: int = -1) -> list[JobEvent]:
        with self.session() as s:
            query = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.seq > after).order_by(JobEvent.seq)
            return list(s.scalars(query))

    def close(self) -> None:
        self.engine.dispose()
