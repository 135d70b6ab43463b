"""Files: batch input uploaded through the OpenAI Files API, and the batches' output and error files.

A file's bytes are one blob in DEEPMESH_FILES_DIR, a directory every gateway replica and the
batch runner reach (a shared mount when they are on several machines); its metadata is a row
in the gateway's database. A blob is written under a temporary name and renamed into place,
so a reader never sees half a file.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, Float, Index, String, select, tuple_
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from gateway.jobs import Base

MAX_FILE_BYTES = 200 << 20  # what OpenAI accepts for a batch input file


class FileTooLarge(ValueError):
    pass


class File(Base):
    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant", "tenant", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(256))
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)

    def to_api(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": int(self.created_at),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": int(self.expires_at) if self.expires_at else None,
            "status_details": None,
        }


class FileStore:
    def __init__(self, session: sessionmaker[Session], directory: str | Path):
        self.session = session
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        return self.directory / file_id

    async def upload(self, tenant: str, purpose: str, filename: str, chunks: AsyncIterator[bytes]) -> File:
        """Store an upload as it arrives; FileTooLarge past MAX_FILE_BYTES (nothing is kept then)."""
        file_id = f"file-{uuid.uuid4().hex}"
        partial = self.directory / f".{file_id}.partial"
        size = 0
        try:
            with partial.open("wb") as out:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > MAX_FILE_BYTES:
                        raise FileTooLarge(f"the file is larger than {MAX_FILE_BYTES >> 20} MB")
                    out.write(chunk)
            os.replace(partial, self.path(file_id))
        finally:
            partial.unlink(missing_ok=True)
        return self._add(file_id, tenant, purpose, filename, size)

    def write(self, tenant: str, purpose: str, filename: str, lines: Iterable[bytes]) -> File:
        """A file the gateway writes itself (a batch's output): JSON lines."""
        file_id = f"file-{uuid.uuid4().hex}"
        partial = self.directory / f".{file_id}.partial"
        size = 0
        with partial.open("wb") as out:
            for line in lines:
                out.write(line)
                size += len(line)
        os.replace(partial, self.path(file_id))
        return self._add(file_id, tenant, purpose, filename, size)

    def _add(self, file_id: str, tenant: str, purpose: str, filename: str, size: int) -> File:
        record = File(
            id=file_id, tenant=tenant, purpose=purpose, filename=filename[:256], bytes=size, created_at=time.time()
        )
        with self.session.begin() as s:
            s.add(record)
        return record

    def get(self, tenant: str, file_id: str) -> File | None:
        with self.session() as s:
            record = s.get(File, file_id)
            return record if record is not None and record.tenant == tenant else None

    def list(
        self, tenant: str, purpose: str | None, after: str | None, limit: int, order: str
    ) -> tuple[list[File], bool]:
        """A page of the tenant's files, newest first (order "desc") or oldest first, after the
        file `after`; and whether more follow."""
        with self.session() as s:
            query = select(File).where(File.tenant == tenant)
            if purpose:
                query = query.where(File.purpose == purpose)
            newest_first = order != "asc"
            if after and (cursor := s.get(File, after)) is not None:
                key, at = tuple_(File.created_at, File.id), tuple_(cursor.created_at, cursor.id)
                query = query.where(key < at if newest_first else key > at)
            by = (File.created_at.desc(), File.id.desc()) if newest_first else (File.created_at, File.id)
            rows = list(s.scalars(query.order_by(*by).limit(limit + 1)))
        return rows[:limit], len(rows) > limit

    def delete(self, tenant: str, file_id: str) -> bool:
        with self.session.begin() as s:
            record = s.get(File, file_id)
            if record is None or record.tenant != tenant:
                return False
            s.delete(record)
        self.path(file_id).unlink(missing_ok=True)
        return True
