"""API keys: who is calling, which tenant that makes them, and their rate limits.

A key is `dm-` and 43 random URL-safe characters (256 bits), shown once when created; the
database keeps its sha256 only (a key that random needs no slow hash), its id (`key_...`,
safe to show and to name in `deepmesh keys revoke`), its tenant and its limits. The gateway
remembers a looked-up key for a few seconds, so a revocation takes effect within that long.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time

from sqlalchemy import Float, Integer, String, select
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from gateway.jobs import Base

REMEMBER_SECONDS = 5.0


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    secret_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    tenant: Mapped[str] = mapped_column(String(64))
    rpm: Mapped[int | None] = mapped_column(Integer, nullable=True)  # requests per minute; None: no limit
    tpm: Mapped[int | None] = mapped_column(Integer, nullable=True)  # tokens per minute (input + output)
    created_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyStore:
    def __init__(self, session: sessionmaker[Session]):
        self.session = session
        self._remembered: dict[str, tuple[float, ApiKey | None]] = {}
        self._lock = threading.Lock()

    def create(self, tenant: str, rpm: int | None = None, tpm: int | None = None) -> tuple[ApiKey, str]:
        """A new key for `tenant`: its row and its secret (which is not stored)."""
        secret = f"dm-{secrets.token_urlsafe(32)}"
        key = ApiKey(
            id=f"key_{secrets.token_hex(8)}",
            secret_sha256=_digest(secret),
            tenant=tenant,
            rpm=rpm,
            tpm=tpm,
            created_at=time.time(),
        )
        with self.session.begin() as s:
            s.add(key)
        return key, secret

    def list(self) -> list[ApiKey]:
        with self.session() as s:
            return list(s.scalars(select(ApiKey).order_by(ApiKey.tenant, ApiKey.created_at)))

    def revoke(self, key_id: str) -> ApiKey | None:
        with self.session.begin() as s:
            key = s.get(ApiKey, key_id)
            if key is not None and key.revoked_at is None:
                key.revoked_at = time.time()
            return key

    def lookup(self, secret: str) -> ApiKey | None:
        """The key with this secret (revoked ones too: the caller tells them apart), or None."""
        digest = _digest(secret)
        now = time.monotonic()
        with self._lock:
            remembered = self._remembered.get(digest)
        if remembered is not None and now - remembered[0] < REMEMBER_SECONDS:
            return remembered[1]
        with self.session() as s:
            key = s.scalars(select(ApiKey).where(ApiKey.secret_sha256 == digest)).first()
        with self._lock:
            if len(self._remembered) > 10_000:
                self._remembered.clear()
            self._remembered[digest] = (now, key)
        return key
