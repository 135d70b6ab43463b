"""Topic names. Every message of a job is keyed by its job id, so a job's messages stay ordered."""

from __future__ import annotations

from enum import StrEnum


class Topic(StrEnum):
    REQUESTS = "requests"  # accepted API requests; a public interface
    PREFILL = "prefill"
    DECODE = "decode"
    TOKENS = "tokens"
    RESULTS = "results"  # a public interface
    DEAD_LETTER = "dead-letter"


def topic_name(topic: Topic, prefix: str) -> str:
    return f"{prefix}{topic.value}"


def all_topic_names(prefix: str) -> list[str]:
    return [topic_name(t, prefix) for t in Topic]
