"""The usage ledger: per tenant, model, day and priority, requests and tokens as DeepSeek bills
them (input served from the cache, input computed, output).

One row per answered job, written by the job recorder from the job's last results message
(`ResultPayload.usage`), whichever gateway replica reads it; a replayed message writes the
same row again, so nothing is counted twice. Reports add the rows up.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from sqlalchemy import BigInteger, Index, String, func, select
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from common.messages import Usage
from gateway.jobs import Base


class UsageEvent(Base):
    __tablename__ = "usage_events"
    __table_args__ = (Index("ix_usage_events_tenant_day", "tenant", "day"),)

    job_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(128))
    day: Mapped[str] = mapped_column(String(10))  # YYYY-MM-DD, UTC
    priority: Mapped[str] = mapped_column(String(16))
    cached_input_tokens: Mapped[int] = mapped_column(BigInteger)
    uncached_input_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)


def day_of(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d")


class Ledger:
    def __init__(self, session: sessionmaker[Session]):
        self.session = session

    def record(self, answered: list[tuple[str, Usage]], at: float | None = None) -> None:
        """Each answered job's usage, on the day it ended (idempotent per job)."""
        if not answered:
            return
        day = day_of(at if at is not None else time.time())
        with self.session.begin() as s:
            for job_id, usage in answered:
                s.merge(UsageEvent(job_id=job_id, day=day, **usage.model_dump()))

    def report(self, start: str, end: str, tenant: str | None = None) -> list[dict]:
        """Per tenant, model, day and priority from day `start` to day `end` (inclusive)."""
        columns = (UsageEvent.tenant, UsageEvent.model, UsageEvent.day, UsageEvent.priority)
        query = (
            select(
                *columns,
                func.count(),
                func.sum(UsageEvent.cached_input_tokens),
                func.sum(UsageEvent.uncached_input_tokens),
                func.sum(UsageEvent.output_tokens),
            )
            .where(UsageEvent.day >= start, UsageEvent.day <= end)
            .group_by(*columns)
            .order_by(*columns)
        )
        if tenant is not None:
            query = query.where(UsageEvent.tenant == tenant)
        with self.session() as s:
            rows = s.execute(query).all()
        names = ("tenant", "model", "day", "priority", "requests", "cached_input_tokens")
        names += ("uncached_input_tokens", "output_tokens")
        return [dict(zip(names, (*row[:4], *(int(v) for v in row[4:])), strict=True)) for row in rows]
