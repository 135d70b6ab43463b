"""Configuration from the environment (prefix DEEPMESH_), e.g. DEEPMESH_KAFKA_BOOTSTRAP."""

from __future__ import annotations

from typing import Literal

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DEEPMESH_", extra="ignore")

    bus: Literal["memory", "kafka"] = "memory"
    kafka_bootstrap: str = "127.0.0.1:19092"
    topic_prefix: str = "deepmesh."
    topic_partitions: int = 4
    database_url: str = "sqlite:///.cache/deepmesh.db"
    redis_url: str = "redis://127.0.0.1:16379/0"
    cache_url: str = "http://127.0.0.1:8100"
    model: str = ".cache/models/tiny"
    served_model_name: str = "deepmesh-tiny"
    log_level: str = "WARNING"
    log_format: Literal["json", "text"] = "json"
    trace_exporter: str = "jsonl"  # comma-separated: jsonl, console, otlp, none (common/tracing.py)
    trace_file: str = ".cache/traces.jsonl"
    metrics_port: int = 0  # a worker serves /metrics on this port; 0: not at all
    metrics_host: str = "127.0.0.1"
    retention_agent_seconds: float = 3 * 86400  # how long stored prefixes live, by retention class
    retention_chat_seconds: float = 7 * 86400
    retention_overrides: dict[str, dict[str, float]] = {}  # per tenant, JSON: {"acme": {"agent": 86400}}
