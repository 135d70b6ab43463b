"""The cache's metadata: one row per stored blob, in SQL (SQLite by default, PostgreSQL when
replicas share it), so that what is cached, for whom, until when and how often it was used
survives restarts and is the same for every cache replica that shares the database.

Two kinds of rows: a *block* (the compressed state of one full 128-token block, keyed by the
hash chain up to it, shared by every anchor that extends it) and an *anchor* (the state of one
exact prefix: its window snapshot and partial block, and the list of blocks before it). A
block expires with the last anchor that uses it. The schema belongs to the Alembic migrations
in cache_svc/migrations.

The catalog speaks SQL statements (SQLAlchemy Core) and hands out plain `Record`s, not ORM
objects: a lookup, a load and a store run on every request that reuses or leaves a prefix, beside
its first token, and ORM instances and units of work cost milliseconds of CPU each.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from operator import attrgetter
from pathlib import Path
from typing import Any

from sqlalchemy import JSON, Connection, Float, Integer, String, bindparam, case, delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from common.database import open_database

MIGRATIONS = Path(__file__).parent / "migrations"


class Base(DeclarativeBase):
    pass


class Entry(Base):
    """The table (its schema; the migrations own it)."""

    __tablename__ = "cache_entries"

    key: Mapped[str] = mapped_column(String(80), primary_key=True)
    kind: Mapped[str] = mapped_column(String(8))  # "anchor", "block" or "image"
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


ENTRIES = Entry.__table__
C = ENTRIES.c


@dataclass(frozen=True, slots=True)
class Record:
    """One row of the catalog, as read."""

    key: str
    kind: str
    tenant: str
    link: str
    num_tokens: int
    size: int
    checksum: str
    blocks: list[str]
    tiers: str
    leases: dict[str, float]
    created_at: float
    expires_at: float
    writer: str
    last_hit_at: float | None = None
    hits: int = 0

    def pinned(self, now: float) -> bool:
        return any(until > now for until in self.leases.values())

    def expired(self, now: float) -> bool:
        """Past its expiry and held by no lease: gone for every purpose."""
        return self.expires_at <= now and not self.pinned(now)

    @property
    def tier_names(self) -> list[str]:
        return [t for t in self.tiers.split(",") if t]


RECORD_FIELDS = [field.name for field in fields(Record)]
RECORD_COLUMNS = [C[name] for name in RECORD_FIELDS]

# The statements each request runs, built once (building one costs as much as running it on SQLite).
KEYS = bindparam("keys", expanding=True)
GET = select(*RECORD_COLUMNS).where(C.key.in_(KEYS))
ANCHORS_UNDER = select(C.key, C.num_tokens).where(
    C.kind == "anchor", C.link.in_(bindparam("links", expanding=True)), C.num_tokens <= bindparam("longest")
)
LIVE = select(C.key).where(C.key.in_(KEYS), C.expires_at > bindparam("now"))
LOCK = select(C.key, C.leases).where(C.key.in_(KEYS)).order_by(C.key).with_for_update()
BLOCKS_OF = select(C.blocks).where(C.key == bindparam("key"))
UNTIL = bindparam("until", type_=Float)
EXTEND = (
    update(ENTRIES).where(C.key.in_(KEYS)).values(expires_at=case((C.expires_at < UNTIL, UNTIL), else_=C.expires_at))
)
COUNT_HIT = update(ENTRIES).where(C.key == bindparam("entry")).values(hits=C.hits + 1, last_hit_at=bindparam("now"))
SET_LEASES = update(ENTRIES).where(C.key == bindparam("entry")).values(leases=bindparam("held"))


class Catalog:
    def __init__(self, url: str):
        self.engine, self.session = open_database(url, MIGRATIONS)
        # The reads of one statement on every request's path, outside a transaction: PostgreSQL
        # then takes no BEGIN before the statement and no ROLLBACK when the connection goes back to
        # the pool, two round trips a read. (The snapshot is the statement's either way.)
        self.reader = self.engine.execution_options(isolation_level="AUTOCOMMIT")

    def add(self, anchor: Record, blocks: list[Record]) -> set[str]:
        """Record an anchor and its blocks; returns the keys of those that were not known yet
        (the only ones whose bytes need storing). A known entry keeps its bytes and lives as long
        as its longest-lived anchor; a lease is added to the ones it already has."""
        entries = sorted([anchor, *blocks], key=attrgetter("key"))
        rows = [{name: getattr(entry, name) for name in RECORD_FIELDS} for entry in entries]
        for attempt in range(3):
            try:
                with self.engine.begin() as connection:
                    return _record(connection, rows)
            except IntegrityError:  # another replica recorded one of them meanwhile: update it instead
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def get(self, keys: Iterable[str]) -> dict[str, Record]:
        with self.reader.connect() as connection:
            return {row.key: Record(*row) for row in connection.execute(GET, {"keys": list(keys)})}

    def anchors_under(self, links: list[str], longest: int) -> dict[str, int]:
        """{key: num_tokens} of the anchors of at most `longest` tokens that follow any of these
        chain links (expired ones too: a lookup tells an expired prefix from none)."""
        with self.reader.connect() as connection:
            return {key: n for key, n in connection.execute(ANCHORS_UNDER, {"links": links, "longest": longest})}

    def live(self, keys: list[str], now: float) -> set[str]:
        with self.reader.connect() as connection:
            return set(connection.scalars(LIVE, {"keys": keys, "now": now}))

    def hit(self, key: str, now: float, expires_at: float) -> None:
        """Count a hit and extend the anchor and its blocks to at least `expires_at`."""
        with self.engine.begin() as connection:
            if keys := _locked_with_blocks(connection, key):
                _extend(connection, list(keys), expires_at)
                connection.execute(COUNT_HIT, {"entry": key, "now": now})

    def renew(self, key: str, expires_at: float) -> float | None:
        with self.engine.begin() as connection:
            if not (keys := _locked_with_blocks(connection, key)):
                return None
            _extend(connection, list(keys), expires_at)
            return connection.scalar(select(C.expires_at).where(C.key == key))

    def lease(self, key: str, holder: str, until: float | None) -> bool:
        """Pin an anchor and its blocks for `holder` until then, or release its pin (until None)."""
        with self.engine.begin() as connection:
            held = _locked_with_blocks(connection, key)
            if until is None:
                leases = {entry: {h: t for h, t in current.items() if h != holder} for entry, current in held.items()}
            else:
                leases = {entry: {**current, holder: until} for entry, current in held.items()}
            _set_leases(connection, leases)
            return bool(held)

    def set_tiers(self, key: str, tiers: list[str]) -> None:
        with self.engine.begin() as connection:
            connection.execute(update(ENTRIES).where(C.key == key).values(tiers=",".join(tiers)))

    def remove(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if keys:
            with self.engine.begin() as connection:
                connection.execute(delete(ENTRIES).where(C.key.in_(keys)))

    def expired(self, now: float, limit: int = 1000) -> list[Record]:
        """Entries past their expiry (pinned ones included: the caller skips those)."""
        query = select(*RECORD_COLUMNS).where(C.expires_at <= now).order_by(C.expires_at).limit(limit)
        with self.engine.connect() as connection:
            return [Record(*row) for row in connection.execute(query)]

    def locations(self) -> dict[str, list[str]]:
        """Every key and the tiers recorded as holding it."""
        with self.engine.connect() as connection:
            rows = connection.execute(select(C.key, C.tiers))
            return {key: [t for t in tiers.split(",") if t] for key, tiers in rows}

    def written_by(self, writer: str) -> dict[str, list[str]]:
        """The keys a replica wrote, and the tiers recorded as holding each."""
        with self.engine.connect() as connection:
            rows = connection.execute(select(C.key, C.tiers).where(C.writer == writer))
            return {key: [t for t in tiers.split(",") if t] for key, tiers in rows}

    def anchors_missing_blocks(self) -> list[str]:
        """Anchors that name a block the catalog no longer has (it was evicted)."""
        with self.engine.connect() as connection:
            blocks = set(connection.scalars(select(C.key).where(C.kind == "block")))
            rows = connection.execute(select(C.key, C.blocks).where(C.kind == "anchor"))
            return [key for key, needed in rows if not blocks.issuperset(needed)]

    def pinned_by(self, holder: str) -> list[str]:
        """Keys a holder (a job, for its hand-over) has a lease on, lapsed or not."""
        with self.engine.connect() as connection:
            return [key for key, leases in connection.execute(select(C.key, C.leases)) if holder in leases]

    def summary(self) -> dict[str, Any]:
        """Entries and bytes by kind."""
        totals = select(C.kind, func.count(), func.coalesce(func.sum(C.size), 0)).group_by(C.kind)
        with self.engine.connect() as connection:
            return {kind: {"entries": n, "bytes": int(size)} for kind, n, size in connection.execute(totals)}

    def close(self) -> None:
        self.engine.dispose()


def _record(connection: Connection, rows: list[dict[str, Any]]) -> set[str]:
    """Insert the rows not recorded yet and extend the ones that are; the keys inserted."""
    known = _locked(connection, [row["key"] for row in rows])
    new = [row for row in rows if row["key"] not in known]
    if new:
        connection.execute(insert(ENTRIES), new)
    again = [row for row in rows if row["key"] in known]
    for expires_at in {row["expires_at"] for row in again}:
        _extend(connection, [row["key"] for row in again if row["expires_at"] == expires_at], expires_at)
    _set_leases(connection, {row["key"]: {**known[row["key"]], **row["leases"]} for row in again if row["leases"]})
    return {row["key"] for row in new}


def _locked(connection: Connection, keys: list[str]) -> dict[str, dict[str, float]]:
    """{key: leases} of those of these keys already recorded, locked (PostgreSQL: FOR UPDATE) in key
    order, as every writer locks them, so that concurrent writers wait for each other and never
    deadlock."""
    return {key: leases for key, leases in connection.execute(LOCK, {"keys": sorted(keys)})}


def _locked_with_blocks(connection: Connection, key: str) -> dict[str, dict[str, float]]:
    """An anchor and its blocks, locked as `_locked` locks them ({} when the anchor is gone)."""
    blocks = connection.scalar(BLOCKS_OF, {"key": key})
    return {} if blocks is None else _locked(connection, [key, *blocks])


def _extend(connection: Connection, keys: list[str], expires_at: float) -> None:
    """These entries live until `expires_at` at least (never shorter than they already do)."""
    if keys:
        connection.execute(EXTEND, {"keys": keys, "until": expires_at})


def _set_leases(connection: Connection, leases: dict[str, dict[str, float]]) -> None:
    if leases:
        connection.execute(SET_LEASES, [{"entry": key, "held": held} for key, held in leases.items()])
