"""The cache's metadata: one row per stored blob, in SQL (SQLite by default, PostgreSQL when
replicas share it), so that what is cached, for whom, until when and how often it was used
survives restarts and is the same for every cache replica that shares the database.

Two kinds of rows: a *block* (the compressed state of one full 128-token block, keyed by the
hash chain up to it, shared by every anchor that extends it) and an *anchor* (the state of one
exact prefix: its window snapshot and partial block, and the list of blocks before it). A
block expires with the last anchor that uses it. The schema belongs to the Alembic migrations
in cache_svc/migrations.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sqlalchemy import JSON, Float, Integer, String, delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from common.database import open_database

MIGRATIONS = Path(__file__).parent / "migrations"


class Base(DeclarativeBase):
    pass


class Entry(Base):
    __tablename__ = "cache_entries"

    key: Mapped[str] = mapped_column(String(80), primary_key=True)
    kind: Mapped[str] = mapped_column(String(8))  # "anchor" or "block"
    tenant: Mapped[str] = mapped_column(String(64))
    link: Mapped[str] = mapped_column(String(64), index=True)  # hash chain link of the full blocks it follows
    num_tokens: Mapped[int] = mapped_column(Integer)
    size: Mapped[int] = mapped_column(Integer)
    checksum: Mapped[str] = mapped_column(String(64))
    blocks: Mapped[list[str]] = mapped_column(JSON)  # an anchor's block keys, in order
    tiers: Mapped[str] = mapped_column(String(128))  # comma-separated names of the tiers holding it
    leases: Mapped[dict[str, float]] = mapped_column(JSON)  # holder -> until: pinned while any is live
    created_at: Mapped[float] = mapped_column(Float)
    last_hit_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    expires_at: Mapped[float] = mapped_column(Float, index=True)
    hits: Mapped[int] = mapped_column(Integer, default=0)
    # the cache replica that wrote it: until write-behind, its bytes are in that replica's memory alone
    writer: Mapped[str] = mapped_column(String(200), default="", index=True)

    def pinned(self, now: float) -> bool:
        return any(until > now for until in self.leases.values())

    def expired(self, now: float) -> bool:
        """Past its expiry and held by no lease: gone for every purpose."""
        return self.expires_at <= now and not self.pinned(now)

    @property
    def tier_names(self) -> list[str]:
        return [t for t in self.tiers.split(",") if t]


class Catalog:
    def __init__(self, url: str):
        self.engine, self.session = open_database(url, MIGRATIONS)

    def add(self, anchor: Entry, blocks: list[Entry]) -> set[str]:
        """Record an anchor and its blocks; returns the keys of those that were not known yet
        (the only ones whose bytes need storing). A known entry keeps its bytes and lives as long
        as its longest-lived anchor; a lease is added to the ones it already has."""
        entries = sorted([anchor, *blocks], key=lambda e: e.key)
        for attempt in range(3):
            try:
                with self.session.begin() as s:
                    known = {e.key: e for e in _lock(s, [e.key for e in entries])}
                    for entry in entries:
                        old = known.get(entry.key)
                        if old is None:
                            s.add(_copy(entry))
                            continue
                        old.expires_at = max(old.expires_at, entry.expires_at)
                        if entry.leases:
                            old.leases = {**old.leases, **entry.leases}
                return {e.key for e in entries} - set(known)
            except IntegrityError:  # another replica recorded one of them meanwhile: update it instead
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def get(self, keys: Iterable[str]) -> dict[str, Entry]:
        with self.session() as s:
            return {e.key: e for e in s.scalars(select(Entry).where(Entry.key.in_(list(keys))))}

    def anchors_under(self, links: list[str], longest: int) -> dict[str, int]:
        """{key: num_tokens} of the anchors of at most `longest` tokens that follow any of these
        chain links (expired ones too: a lookup tells an expired prefix from none)."""
        query = select(Entry.key, Entry.num_tokens).where(
            Entry.kind == "anchor", Entry.link.in_(links), Entry.num_tokens <= longest
        )
        with self.session() as s:
            return {key: n for key, n in s.execute(query)}

    def live(self, keys: list[str], now: float) -> set[str]:
        with self.session() as s:
            return set(s.scalars(select(Entry.key).where(Entry.key.in_(keys), Entry.expires_at > now)))

    def hit(self, key: str, now: float, expires_at: float) -> None:
        """Count a hit and extend the anchor and its blocks to at least `expires_at`."""
        with self.session.begin() as s:
            for entry in self._locked_with_blocks(s, key):
                if entry.key == key:
                    entry.hits += 1
                    entry.last_hit_at = now
                entry.expires_at = max(entry.expires_at, expires_at)

    def renew(self, key: str, expires_at: float) -> float | None:
        with self.session.begin() as s:
            entries = self._locked_with_blocks(s, key)
            for entry in entries:
                entry.expires_at = max(entry.expires_at, expires_at)
            return next((e.expires_at for e in entries if e.key == key), None)

    def lease(self, key: str, holder: str, until: float | None) -> bool:
        """Pin an anchor and its blocks for `holder` until then, or release its pin (until None)."""
        with self.session.begin() as s:
            entries = self._locked_with_blocks(s, key)
            for entry in entries:
                leases = dict(entry.leases)
                if until is None:
                    leases.pop(holder, None)
                else:
                    leases[holder] = until
                entry.leases = leases
            return bool(entries)

    def _locked_with_blocks(self, s: Session, key: str) -> list[Entry]:
        """An anchor and its blocks, locked (PostgreSQL: FOR UPDATE) in key order, as every
        writer locks them, so that concurrent writers wait for each other and never deadlock."""
        anchor = s.get(Entry, key)
        return [] if anchor is None else _lock(s, [key, *anchor.blocks])

    def set_tiers(self, key: str, tiers: list[str]) -> None:
        with self.session.begin() as s:
            entry = s.get(Entry, key)
            if entry is not None:
                entry.tiers = ",".join(tiers)

    def remove(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if keys:
            with self.session.begin() as s:
                s.execute(delete(Entry).where(Entry.key.in_(keys)))

    def expired(self, now: float, limit: int = 1000) -> list[Entry]:
        """Entries past their expiry (pinned ones included: the caller skips those)."""
        with self.session() as s:
            query = select(Entry).where(Entry.expires_at <= now).order_by(Entry.expires_at).limit(limit)
            return list(s.scalars(query))

    def locations(self) -> dict[str, list[str]]:
        """Every key and the tiers recorded as holding it."""
        with self.session() as s:
            return {key: [t for t in tiers.split(",") if t] for key, tiers in s.execute(select(Entry.key, Entry.tiers))}

    def written_by(self, writer: str) -> dict[str, list[str]]:
        """The keys a replica wrote, and the tiers recorded as holding each."""
        with self.session() as s:
            rows = s.execute(select(Entry.key, Entry.tiers).where(Entry.writer == writer))
            return {key: [t for t in tiers.split(",") if t] for key, tiers in rows}

    def anchors_missing_blocks(self) -> list[str]:
        """Anchors that name a block the catalog no longer has (it was evicted)."""
        with self.session() as s:
            blocks = set(s.scalars(select(Entry.key).where(Entry.kind == "block")))
            rows = s.execute(select(Entry.key, Entry.blocks).where(Entry.kind == "anchor"))
            return [key for key, needed in rows if not blocks.issuperset(needed)]

    def pinned_by(self, holder: str) -> list[str]:
        """Keys a holder (a job, for its hand-over) has a lease on, lapsed or not."""
        with self.session() as s:
            return [key for key, leases in s.execute(select(Entry.key, Entry.leases)) if holder in leases]

    def summary(self) -> dict[str, Any]:
        """Entries and bytes by kind."""
        with self.session() as s:
            totals = select(Entry.kind, func.count(), func.coalesce(func.sum(Entry.size), 0)).group_by(Entry.kind)
            rows = s.execute(totals)
            return {kind: {"entries": n, "bytes": int(size)} for kind, n, size in rows}

    def close(self) -> None:
        self.engine.dispose()


def _lock(s: Session, keys: list[str]) -> list[Entry]:
    query = select(Entry).where(Entry.key.in_(sorted(keys))).order_by(Entry.key).with_for_update()
    return list(s.scalars(query))


def _copy(entry: Entry) -> Entry:
    """A fresh instance to add (a retried transaction must not reuse one its failed session held)."""
    return Entry(**{column.key: getattr(entry, column.key) for column in Entry.__table__.columns})
