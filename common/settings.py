"""Configuration from the environment (prefix DEEPMESH_), e.g. DEEPMESH_KAFKA_BOOTSTRAP."""

from __future__ import annotations

from typing import Literal

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DEEPMESH_", extra="ignore")

    bus: Literal["memory", "kafka"] = "memory"
    kafka_bootstrap: str = "127.0.0.1:19092"
    # how long a worker that stopped answering keeps its partitions (at least the broker's
    # group.min.session.timeout.ms, 6 s by default): failover time against spurious rebalances
    kafka_session_timeout_ms: int = 10_000
    topic_prefix: str = "deepmesh."
    topic_partitions: int = 4
    database_url: str = "sqlite:///.cache/deepmesh.db"
    # values above claim_threshold_bytes travel as claim checks: their bytes in claim_dir, a
    # directory every service reaches (common/claims.py)
    claim_dir: str = ".cache/claims"
    claim_threshold_bytes: int = 256 << 10
    claim_ttl_seconds: float = 7 * 86400
    redis_url: str = "redis://127.0.0.1:16379/0"
    cache_url: str = "http://127.0.0.1:8100"
    model: str = ".cache/models/tiny"
    # decode steps as compiled graphs (engine/compiled_decode.py): compiled behind the first time,
    # decode running eager meanwhile (about two minutes a batch-size bucket for the tiny preset on
    # two cores), loaded from .cache/torchinductor after
    compile_decode: bool = True
    # prefill steps as compiled pieces around the eager attention cores (engine/compiled_prefill.py),
    # compiled after the decode graphs, likewise behind (prefill workers and `serve`); about 25 s a
    # token bucket for the small preset on two cores the first time
    compile_prefill: bool = True
    # torch's intra-op threads in a process that runs an engine (serve, prefill, decode, encoder);
    # 0: one less than the process's cores (at least one), unless OMP_NUM_THREADS is set. A team of
    # threads on every core waits at each operator's barrier for whichever of its threads the
    # process's other threads (HTTP, tokenizer, bus) or another process took the core from: under
    # a load generator on 2 cores, decode took 281 ms a token with 2 threads and 15 ms with 1
    # (docs/benchmarks.md). Several engine processes on one machine: give each its share.
    torch_threads: int = 0
    # speculative decoding in decode steps (engine/speculation.py): auto, off, mtp (V4's
    # multi-token-prediction module) or dspark (V4.1's draft model); auto drafts where the checkpoint has a drafter
    # and while its drafts are accepted often enough to pay. speculative_tokens drafts a step;
    # no speculation in a step of more than speculative_max_batch sequences
    speculative: Literal["auto", "off", "mtp", "dspark"] = "auto"
    speculative_tokens: int = 3
    speculative_max_batch: int = 4
    # DSpark: verify a sequence's drafts only while its confidence head's estimate that they are
    # all accepted (the product of their confidences) is at least this; 0: verify every draft
    speculative_min_confidence: float = 0.0
    served_model_name: str = "deepmesh-tiny"
    # whether a chat request that does not say (thinking, reasoning_effort, chat_template_kwargs)
    # reasons before its answer: off, as vLLM and SGLang serve DeepSeek's models, so that clients
    # that know nothing of reasoning find the answer in `content`, not a max_tokens spent on thought
    default_thinking: bool = False
    drain_seconds: float = 5.0  # on SIGTERM: how long answers in flight may take to finish before the exit
    log_level: str = "WARNING"
    log_format: Literal["json", "text"] = "json"
    trace_exporter: str = "jsonl"  # comma-separated: jsonl, console, otlp, none (common/tracing.py)
    trace_file: str = ".cache/traces.jsonl"
    metrics_port: int = 0  # a worker serves /metrics on this port; 0: not at all
    metrics_host: str = "127.0.0.1"
    retention_agent_seconds: float = 3 * 86400  # how long stored prefixes live, by retention class
    retention_chat_seconds: float = 7 * 86400
    retention_overrides: dict[str, dict[str, float]] = {}  # per tenant, JSON: {"acme": {"agent": 86400}}
    # the KV cache (cache_svc): tiers, anchors, maintenance
    cache_dir: str = ".cache/kv"  # T2, this replica's local disk
    cache_replica: str = ""  # this cache replica's name, stable across restarts; "": host name and cache_dir
    cache_memory_bytes: int = 1 << 30  # T1 capacity
    cache_disk_bytes: int = 20 << 30  # T2 capacity
    cache_shared_dir: str = ""  # T3 as a POSIX directory shared by all replicas (3FS, NFS, Lustre mount)
    cache_shared_redis_url: str = ""  # T3 as a Redis server (when no shared directory is set)
    cache_shared_bytes: int = 0  # T3 capacity; 0: unbounded
    cache_anchor_interval: int = 1024  # tokens between the anchors stored inside a long prompt; 0: none
    cache_maintenance_seconds: float = 2.0  # how often write-behind, expiry, rebalancing and GC run
    # tier 0: prefix states an engine keeps in its own blocks (engine/resident_prefixes.py); the
    # bytes of their slot copies (window rings, open windows); 0: none kept
    resident_prefix_bytes: int = 256 << 20
    # admission control: a call no prefill replica could start within this many seconds is
    # answered 429 with Retry-After (async jobs wait in the queue instead); 0: never refused
    admission_wait_seconds: float = 30.0
    # API keys (gateway/keys.py) are required when the gateway listens beyond loopback, or with this set
    require_keys: bool = False
    # batches (gateway/batch_runner.py): where uploaded and output files live (shared by every
    # gateway replica and the batch runner), how many batch requests run at once across all
    # batches, and how often the runner takes a round
    files_dir: str = ".cache/files"
    batch_in_flight: int = 64
    batch_round_seconds: float = 1.0
    # distributed, a request left `sending` this long is taken as lost with the runner that was
    # producing it, and sent again (gateway/batch_runner.py)
    batch_resend_after_seconds: float = 30.0
    # images in requests (V4.1 with a vision tower; tokenizer_svc/images.py): how many a request
    # may have, and how image URLs are fetched (public addresses only, but for the networks
    # listed here, such as an internal image store: CIDRs, JSON)
    image_max_per_request: int = 16
    image_max_bytes: int = 20 << 20
    image_fetch_connect_seconds: float = 5.0
    image_fetch_seconds: float = 20.0
    image_fetch_allowed_networks: list[str] = []
    # how long a stored response (Responses' `store`, the default) is kept for GET and previous_response_id
    responses_keep_seconds: float = 30 * 86400
