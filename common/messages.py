"""Versioned message envelopes: what every record on a deepmesh topic carries.

A record's value is one JSON `Envelope`; its key is the job id; W3C trace context travels
in the record headers, not in the body. `seq` numbers a job's messages of one `type`, so
(job_id, type, seq) names an effect and a consumer that sees it twice can tell.
"""

from __future__ import annotations

import base64
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SCHEMA_VERSION = 1


class BadMessage(ValueError):
    """A record that cannot be understood; it goes to the dead-letter topic with this reason."""


class Envelope(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = SCHEMA_VERSION
    type: str = Field(min_length=1)
    job_id: str = Field(min_length=1)
    seq: int = Field(default=0, ge=0)
    sent_at: float = Field(default_factory=time.time)
    payload: dict[str, Any] = Field(default_factory=dict)

    def encode(self) -> bytes:
        return self.model_dump_json().encode()


def decode(raw: bytes, expected_type: str | None = None) -> Envelope:
    """Parse a record value, or raise BadMessage saying what is wrong with it."""
    try:
        envelope = Envelope.model_validate_json(raw)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in err.errors())
        raise BadMessage(f"not a deepmesh envelope: {problems}") from err
    if envelope.version != SCHEMA_VERSION:
        raise BadMessage(f"envelope version {envelope.version} is not supported (this build reads {SCHEMA_VERSION})")
    if expected_type is not None and envelope.type != expected_type:
        raise BadMessage(f"envelope type {envelope.type!r} does not belong on this topic ({expected_type!r})")
    return envelope


class DeadLetter(BaseModel):
    """What the dead-letter topic holds for a record no worker could use."""

    topic: str
    partition: int
    offset: int
    key: str
    value_base64: str
    reason: str
    consumer_group: str
    failed_at: float = Field(default_factory=time.time)

    @classmethod
    def of(cls, record, reason: str, consumer_group: str) -> DeadLetter:
        return cls(
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            key=record.key,
            value_base64=base64.b64encode(record.value).decode(),
            reason=reason,
            consumer_group=consumer_group,
        )
