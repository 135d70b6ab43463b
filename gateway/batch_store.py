"""Batch state: the `batches` table and one `batch_requests` row per request, and their queries.

A request runs as an async job (gateway/jobs.py) whose id its row holds, so its result is
recorded the way every async job's is, whichever gateway replica reads it. How a batch's input
is read and how each protocol shows a batch is gateway/batches.py; moving batches through their
lifecycle, gateway/batch_runner.py.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, String, func, select, update
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from gateway.jobs import FINAL, Base, Job

COMPLETION_WINDOWS = {"24h": 86400.0}

# a request's state: pending (not sent yet), sending (its job exists; being produced), sent (its
# job runs), then one of the final ones
PENDING, SENDING, SENT = "pending", "sending", "sent"
SUCCEEDED, ERRORED, CANCELED, EXPIRED = "succeeded", "errored", "canceled", "expired"
ENDED = ("completed", "failed", "expired", "cancelled")  # batch statuses after which nothing runs
RUNNING = ("in_progress", "cancelling")  # batch statuses whose requests may still run


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_tenant", "tenant", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    protocol: Mapped[str] = mapped_column(String(16))  # openai | anthropic
    tenant: Mapped[str] = mapped_column(String(64))
    endpoint: Mapped[str] = mapped_column(String(32))
    input_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    completion_window: Mapped[str] = mapped_column(String(8))
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON, nullable=True)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    usage: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    output_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float)
    in_progress_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finalizing_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    completed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    failed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    expired_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    cancelling_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    cancelled_at: Mapped[float | None] = mapped_column(Float, nullable=True)

    @property
    def ended_at(self) -> float | None:
        return self.completed_at or self.failed_at or self.expired_at or self.cancelled_at


class BatchRequest(Base):
    __tablename__ = "batch_requests"
    __table_args__ = (Index("ix_batch_requests_state", "batch_id", "state"),)

    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    custom_id: Mapped[str] = mapped_column(String(512))
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    job_id: Mapped[str] = mapped_column(String(64), unique=True)
    state: Mapped[str] = mapped_column(String(16))
    sent_at: Mapped[float | None] = mapped_column(Float, nullable=True)


def job_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request a batch line runs: never streamed."""
    return {**body, "stream": False}


class BatchStore:
    def __init__(self, session: sessionmaker[Session]):
        self.session = session

    def create(
        self,
        protocol: str,
        tenant: str,
        endpoint: str,
        completion_window: str = "24h",
        input_file_id: str | None = None,
        metadata: dict[str, str] | None = None,
        requests: list[tuple[str, dict[str, Any]]] | None = None,
    ) -> Batch:
        """A new batch: validating (its input file is read by the runner), or in progress with
        `requests` given."""
        now = time.time()
        prefix = "msgbatch_" if protocol == "anthropic" else "batch_"
        batch = Batch(
            id=f"{prefix}{uuid.uuid4().hex}",
            protocol=protocol,
            tenant=tenant,
            endpoint=endpoint,
            input_file_id=input_file_id,
            status="validating",
            completion_window=completion_window,
            metadata_=metadata,
            created_at=now,
            expires_at=now + COMPLETION_WINDOWS[completion_window],
        )
        with self.session.begin() as s:
            s.add(batch)
            if requests is not None:
                s.flush()
                self._add_requests(s, batch, requests)
        return batch

    def start(self, batch_id: str, requests: list[tuple[str, dict[str, Any]]]) -> None:
        """A validated batch's requests, pending: the batch is in progress."""
        with self.session.begin() as s:
            batch = s.get(Batch, batch_id, with_for_update=True)
            if batch is not None and batch.status == "validating":
                self._add_requests(s, batch, requests)

    @staticmethod
    def _add_requests(s: Session, batch: Batch, requests: list[tuple[str, dict[str, Any]]]) -> None:
        rows = [
            {"batch_id": batch.id, "index": i, "custom_id": c, "body": job_body(b), "job_id": uuid.uuid4().hex}
            | {"state": PENDING}
            for i, (c, b) in enumerate(requests)
        ]
        s.execute(BatchRequest.__table__.insert(), rows)
        batch.status, batch.in_progress_at = "in_progress", time.time()

    def fail(self, batch_id: str, errors: list[dict[str, Any]]) -> None:
        with self.session.begin() as s:
            batch = s.get(Batch, batch_id, with_for_update=True)
            if batch is not None and batch.status == "validating":
                batch.status, batch.failed_at, batch.errors = "failed", time.time(), errors

    def get(self, tenant: str, batch_id: str, protocol: str) -> Batch | None:
        with self.session() as s:
            return _owned(s.get(Batch, batch_id), tenant, protocol)

    def list(self, tenant: str, protocol: str, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """A page of the tenant's batches, newest first, after the batch `after`; and whether more follow."""
        with self.session() as s:
            query = select(Batch).where(Batch.tenant == tenant, Batch.protocol == protocol)
            if after and (cursor := s.get(Batch, after)) is not None:
                query = query.where(Batch.created_at < cursor.created_at)
            rows = list(s.scalars(query.order_by(Batch.created_at.desc()).limit(limit + 1)))
        return rows[:limit], len(rows) > limit

    def cancel(self, tenant: str, batch_id: str, protocol: str) -> Batch | None:
        """Ask a batch to stop: cancelling (the runner cancels what runs and ends it). One that
        has ended stays as it is."""
        with self.session.begin() as s:
            batch = _owned(s.get(Batch, batch_id, with_for_update=True), tenant, protocol)
            if batch is None:
                return None
            if batch.status in ("validating", "in_progress"):
                batch.status, batch.cancelling_at = "cancelling", time.time()
            return batch

    def delete(self, tenant: str, batch_id: str, protocol: str) -> Batch | None:
        with self.session.begin() as s:
            batch = _owned(s.get(Batch, batch_id), tenant, protocol)
            if batch is not None and batch.status in ENDED:
                s.delete(batch)  # its requests go with it (ON DELETE CASCADE)
            return batch

    def counts(self, batch_id: str) -> dict[str, int]:
        """How many of the batch's requests are in each state."""
        with self.session() as s:
            query = (
                select(BatchRequest.state, func.count())
                .where(BatchRequest.batch_id == batch_id)
                .group_by(BatchRequest.state)
            )
            return {state: count for state, count in s.execute(query)}

    def results(self, batch_id: str, chunk: int = 500) -> Iterator[tuple[BatchRequest, Job | None]]:
        """Every request that has ended, with its job, in the order of the batch."""
        last = -1
        while True:
            with self.session() as s:
                query = (
                    select(BatchRequest, Job)
                    .outerjoin(Job, Job.id == BatchRequest.job_id)
                    .where(
                        BatchRequest.batch_id == batch_id,
                        BatchRequest.index > last,
                        BatchRequest.state.in_((SUCCEEDED, ERRORED, CANCELED, EXPIRED)),
                    )
                    .order_by(BatchRequest.index)
                    .limit(chunk)
                )
                rows = s.execute(query).all()
            yield from rows
            if len(rows) < chunk:
                return
            last = rows[-1][0].index

    # -- the batch runner's queries (gateway/batch_runner.py) --------------------------------------

    def validating(self) -> list[Batch]:
        """The batches whose input file is still to be read."""
        with self.session() as s:
            return list(s.scalars(select(Batch).where(Batch.status == "validating")))

    def running(self) -> list[Batch]:
        with self.session() as s:
            return list(s.scalars(select(Batch).where(Batch.status.in_(RUNNING))))

    def take_job_outcomes(self) -> None:
        """Requests whose jobs ended take the job's outcome (a job cancelled because its batch
        expired: expired). `sending` ones too: a runner killed after producing a request but
        before marking it sent leaves it `sending` while its job runs to the end."""
        with self.session.begin() as s:
            query = (
                select(BatchRequest, Job.status, Batch.expired_at)
                .join(Job, Job.id == BatchRequest.job_id)
                .join(Batch, Batch.id == BatchRequest.batch_id)
                .where(BatchRequest.state.in_((SENDING, SENT)), Job.status.in_(FINAL))
            )
            for request, status, expired_at in s.execute(query).all():
                stopped = EXPIRED if expired_at is not None else CANCELED
                request.state = {"succeeded": SUCCEEDED, "failed": ERRORED}.get(status, stopped)

    def stopping(self, now: float) -> list[Batch]:
        """The running batches that are cancelled or past their window; one past its window is
        marked expired (at `now`) if it was not yet."""
        with self.session.begin() as s:
            query = select(Batch).where(
                Batch.status.in_(RUNNING), (Batch.status == "cancelling") | (Batch.expires_at <= now)
            )
            stopping = list(s.scalars(query.with_for_update()))
            for batch in stopping:
                if batch.status != "cancelling" and batch.expired_at is None:
                    batch.expired_at = now
        return stopping

    def end_pending(self, batch_id: str, outcome: str) -> list[str]:
        """The batch's pending requests end with `outcome`; the job ids of those sending or sent."""
        with self.session.begin() as s:
            s.execute(
                update(BatchRequest)
                .where(BatchRequest.batch_id == batch_id, BatchRequest.state == PENDING)
                .values(state=outcome)
            )
            return list(
                s.scalars(
                    select(BatchRequest.job_id).where(
                        BatchRequest.batch_id == batch_id, BatchRequest.state.in_((SENDING, SENT))
                    )
                )
            )

    def end_running(self, batch_id: str, outcome: str) -> None:
        """The batch's requests still sending or sent end with `outcome`."""
        with self.session.begin() as s:
            s.execute(
                update(BatchRequest)
                .where(BatchRequest.batch_id == batch_id, BatchRequest.state.in_((SENDING, SENT)))
                .values(state=outcome)
            )

    def sendable(self, in_flight_limit: int) -> tuple[dict[str, Batch], Counter[str], dict[str, list[int]]]:
        """The batches in progress, how many requests of each are in flight (sending or sent),
        and per batch the indexes of its next pending requests: as many as there are free places
        under `in_flight_limit` (not a 50,000-request batch every round), none without one."""
        with self.session() as s:
            active = {b.id: b for b in s.scalars(select(Batch).where(Batch.status == "in_progress"))}
            if not active:
                return active, Counter(), {}
            in_flight = Counter(
                dict(
                    s.execute(
                        select(BatchRequest.batch_id, func.count())
                        .where(BatchRequest.batch_id.in_(active), BatchRequest.state.in_((SENDING, SENT)))
                        .group_by(BatchRequest.batch_id)
                    ).all()
                )
            )
            free = in_flight_limit - sum(in_flight.values())
            pending: dict[str, list[int]] = {}
            if free <= 0:
                return active, in_flight, pending
            for batch_id in active:
                query = (
                    select(BatchRequest.index)
                    .where(BatchRequest.batch_id == batch_id, BatchRequest.state == PENDING)
                    .order_by(BatchRequest.index)
                    .limit(free)
                )
                if indexes := list(s.scalars(query)):
                    pending[batch_id] = indexes
        return active, in_flight, pending

    def claim(
        self,
        chosen: list[tuple[str, int]],
        batches: dict[str, Batch],
        refused: Callable[[BatchRequest, str], Job | None],
        now: float,
    ) -> list[BatchRequest]:
        """Each chosen request (batch id, index) still pending gets its job and is marked
        sending, in one transaction under row locks (another runner skips it); one `refused`
        answers with a job (already failed) is marked sent instead, and `take_job_outcomes`
        gives it that job's outcome. The requests to produce."""
        requests: list[BatchRequest] = []
        with self.session.begin() as s:
            for batch_id, index in chosen:
                request = s.get(BatchRequest, (batch_id, index), with_for_update=True)
                if request is None or request.state != PENDING:
                    continue  # another runner took it
                batch = batches[batch_id]
                if (failed := refused(request, batch.endpoint)) is not None:
                    s.add(failed)
                    request.state = SENT
                    continue
                s.add(Job.queued(request.job_id, batch.endpoint, request.body))
                request.state, request.sent_at = SENDING, now
                requests.append(request)
        return requests

    def mark_sent(self, keys: list[tuple[str, int]]) -> None:
        """The requests (batch id, index) produced are sent, unless another state was given them meanwhile."""
        with self.session.begin() as s:
            for key in keys:
                request = s.get(BatchRequest, key)
                if request is not None and request.state == SENDING:
                    request.state = SENT

    def unfinished(self, state: str, older_than: float) -> tuple[list[BatchRequest], dict[str, Batch]]:
        """The requests in `state` since before `older_than` whose jobs have not ended, and their batches."""
        with self.session() as s:
            query = (
                select(BatchRequest)
                .join(Job, Job.id == BatchRequest.job_id)
                .where(BatchRequest.state == state, BatchRequest.sent_at < older_than, Job.status.not_in(FINAL))
            )
            requests = list(s.scalars(query))
            batches = {b.id: b for b in s.scalars(select(Batch).where(Batch.id.in_({r.batch_id for r in requests})))}
        return requests, batches

    def mark_sending(self, requests: list[BatchRequest]) -> None:
        with self.session.begin() as s:
            for request in requests:
                s.get(BatchRequest, (request.batch_id, request.index)).state = SENDING

    def finalizing(self, batch_id: str, now: float) -> None:
        with self.session.begin() as s:
            s.get(Batch, batch_id).finalizing_at = now

    def end(self, batch_id: str, output_id: str | None, error_id: str | None, usage: dict[str, Any] | None) -> None:
        """A batch with nothing left to run ends: cancelled, expired or completed, with its files and usage."""
        with self.session.begin() as s:
            ended = s.get(Batch, batch_id, with_for_update=True)
            now = time.time()
            ended.output_file_id, ended.error_file_id, ended.usage = output_id, error_id, usage
            if ended.status == "cancelling":
                ended.status, ended.cancelled_at = "cancelled", now
            elif ended.expired_at is not None:
                ended.status = "expired"
            else:
                ended.status, ended.completed_at = "completed", now


def _owned(batch: Batch | None, tenant: str, protocol: str) -> Batch | None:
    """The batch, if it is this tenant's and of this protocol (another's is as good as none)."""
    return batch if batch is not None and batch.tenant == tenant and batch.protocol == protocol else None
