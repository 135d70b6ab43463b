"""Claim checks: a record too large for Kafka travels as a reference to bytes stored beside it.

Kafka's limits stay at their defaults (1 MB per record): a value above `threshold` bytes (a
long prompt's body, its token list, a long answer) is written to a directory every service
reaches (a shared mount such as 3FS, NFS or Lustre in a cluster; a local directory on one
machine), named by its sha256, and the record carries a small envelope of type "claim" in its
place:

    {"version": 1, "type": "claim", "job_id": <the record's key>, "seq": 0, "sent_at": ...,
     "payload": {"sha256": ..., "size": ..., "path": "ab/abcd...", "expires_at": ...}}

The bus does this on both sides (common/bus.py): services produce and consume whole values.
A claimed value lives `ttl_seconds` (Kafka's default retention, so a replayed record still
finds it); equal values share one file, and writing one again extends its life.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

from common.settings import Settings

log = logging.getLogger(__name__)

SWEEP_EVERY_SECONDS = 600.0


class ClaimStore:
    def __init__(self, root: str | Path, threshold: int = 256 << 10, ttl_seconds: float = 7 * 86400):
        self.root = Path(root)
        self.threshold = threshold
        self.ttl_seconds = ttl_seconds
        self._swept_at = 0.0
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> ClaimStore:
        return cls(settings.claim_dir, settings.claim_threshold_bytes, settings.claim_ttl_seconds)

    def check_in(self, key: str, value: bytes) -> bytes:
        """The value to put on the bus: `value` itself, or a claim for it if it is too large."""
        if len(value) <= self.threshold:
            return value
        digest = hashlib.sha256(value).hexdigest()
        path = self.root / digest[:2] / digest
        if path.exists():
            os.utime(path)  # claimed again: it lives as long as its newest claim
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as out:  # whole or not at all
                out.write(value)
            os.replace(out.name, path)
        self._sweep_now_and_then()
        claim = {
            "sha256": digest,
            "size": len(value),
            "path": f"{digest[:2]}/{digest}",
            "expires_at": time.time() + self.ttl_seconds,
        }
        envelope = {"version": 1, "type": "claim", "job_id": key, "seq": 0, "sent_at": time.time(), "payload": claim}
        return json.dumps(envelope, separators=(",", ":")).encode()

    def check_out(self, value: bytes) -> bytes:
        """The value a record stands for: `value` itself, or the bytes its claim names. A claim
        whose bytes are gone or altered is returned as it is: decoding it then fails with the
        reason (common/messages.py), and the record goes to the dead-letter topic."""
        if len(value) > 2048 or b'"claim"' not in value:
            return value
        try:
            envelope = json.loads(value)
        except ValueError:
            return value
        if not isinstance(envelope, dict) or envelope.get("type") != "claim":  # a small value that says "claim"
            return value
        try:
            claim = envelope["payload"]
            data = (self.root / claim["sha256"][:2] / claim["sha256"]).read_bytes()
        except (ValueError, KeyError, TypeError, OSError) as err:
            log.warning("claim check unreadable: %r", err)
            return value
        if len(data) != claim.get("size") or hashlib.sha256(data).hexdigest() != claim["sha256"]:
            log.warning("claimed bytes %s fail their checksum", claim["sha256"])
            return value
        return data

    def sweep(self) -> int:
        """Remove claimed bytes past their lifetime; returns how many."""
        cutoff = time.time() - self.ttl_seconds
        removed = 0
        for path in self.root.glob("??/*"):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:  # another service swept it first
                pass
        return removed

    def _sweep_now_and_then(self) -> None:
        with self._lock:
            if time.monotonic() - self._swept_at < SWEEP_EVERY_SECONDS:
                return
            self._swept_at = time.monotonic()
        self.sweep()
