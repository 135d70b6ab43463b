"""Topic names. Every message of a job is keyed by its job id, so a job's messages stay ordered."""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.bus import Bus


class Topic(StrEnum):
    REQUESTS = "requests"  # accepted API requests; a public interface
    ENCODE = "encode"  # requests with images, on their way to prefill through the image encoder
    PREFILL = "prefill"
    DECODE = "decode"
    TOKENS = "tokens"
    RESULTS = "results"  # a public interface
    DEAD_LETTER = "dead-letter"
    REPLICAS = "replicas"  # load reports of prefill and decode replicas (common/replicas.py), keyed by replica


def topic_name(topic: Topic, prefix: str) -> str:
    return f"{prefix}{topic.value}"


def all_topic_names(prefix: str) -> list[str]:
    return [topic_name(t, prefix) for t in Topic]


def create_all(bus: Bus, prefix: str, partitions: int) -> None:
    """Every topic the mesh uses: the jobs' with `partitions` each, the reports' short-lived."""
    bus.create_topics([topic_name(t, prefix) for t in Topic if t is not Topic.REPLICAS], partitions)
    bus.create_topics([topic_name(Topic.REPLICAS, prefix)], 1, short_lived=True)
