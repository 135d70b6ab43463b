"""Prometheus metrics of every service, in one registry per process.

The gateway and the cache service serve them at GET /metrics; a worker process serves them
on its own port when given `--metrics-port` (DEEPMESH_METRICS_PORT). In the embedded mode
every service shares the gateway's /metrics.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

# gateway
REQUESTS = Counter("deepmesh_requests", "API requests answered, by endpoint and HTTP status", ["endpoint", "status"])
REQUEST_SECONDS = Histogram(
    "deepmesh_request_seconds", "Time from request to the answer's last byte", ["endpoint"], buckets=LATENCY_BUCKETS
)
TTFT_SECONDS = Histogram(
    "deepmesh_time_to_first_token_seconds",
    "Time from request to the first streamed event",
    ["endpoint"],
    buckets=LATENCY_BUCKETS,
)
IN_FLIGHT = Gauge("deepmesh_requests_in_flight", "API requests being answered", ["endpoint"])
JOBS_SUBMITTED = Counter("deepmesh_jobs_submitted", "Async jobs accepted", ["endpoint"])

# every worker
CONSUMED = Counter("deepmesh_messages_consumed", "Records polled from a topic", ["service", "topic"])
PRODUCED = Counter("deepmesh_messages_produced", "Records produced to a topic", ["service", "topic"])
DEAD_LETTERS = Counter("deepmesh_dead_letters", "Records sent to the dead-letter topic", ["service", "topic"])
WORKER_ERRORS = Counter("deepmesh_worker_errors", "Worker steps that failed and were retried", ["service"])

# engines (prefill and decode)
ENGINE_STEP_SECONDS = Histogram("deepmesh_engine_step_seconds", "Engine step time", ["service"], buckets=STEP_BUCKETS)
PROMPT_TOKENS = Counter("deepmesh_prompt_tokens", "Prompt tokens prefilled", ["service"])
GENERATED_TOKENS = Counter("deepmesh_generated_tokens", "Tokens sampled", ["service"])
SPEC_DRAFT_TOKENS = Counter("deepmesh_spec_draft_tokens", "Drafted tokens a decode step verified", ["method"])
SPEC_ACCEPTED_TOKENS = Counter("deepmesh_spec_accepted_tokens", "Drafted tokens the target accepted", ["method"])
RUNNING_JOBS = Gauge("deepmesh_running_jobs", "Jobs held by a worker", ["service"])
DECODE_GRAPHS = Gauge(
    "deepmesh_decode_graphs",
    "Compiled decode graphs, one per batch-size bucket: planned, and ready (that bucket's steps run "
    "compiled; the others run eager while the rest compile in the background)",
    ["service", "state"],
)
PREFILL_GRAPHS = Gauge(
    "deepmesh_prefill_graphs",
    "Token buckets of the compiled prefill pieces: planned, and ready (a step whose "
    "buckets are all ready runs compiled, the others eager while the rest compile in the background)",
    ["service", "state"],
)
STATE_HANDOFFS = Counter(
    "deepmesh_state_handoffs", "Decode starts, by how the state arrived (loaded or recomputed)", ["outcome"]
)
IMAGES_ENCODED = Counter("deepmesh_images_encoded", "Images the image encoder computed the rows of")
IMAGES_CACHED = Counter(
    "deepmesh_images_cached", "Images of requests whose rows the KV cache held already (not encoded again)"
)
PREFIX_TOKENS = Counter(
    "deepmesh_prefix_cache_tokens",
    "Prompt tokens served from the engine's own memory (resident), loaded from the cache service (hit) "
    "or computed (miss)",
    ["outcome"],
)
STATE_BYTES = Counter("deepmesh_state_bytes", "Bytes of state moved through the cache service", ["direction"])

# the KV cache (cache_svc): tiers are memory, disk, and a shared directory or Redis
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
CACHE_MISSES = Counter(
    "deepmesh_cache_misses",
    "Prefix lookups and loads that found no usable state, by reason "
    "(no_prefix, shorter_than_block, expired, evicted, corrupt, lease_lost, too_slow)",
    ["reason"],
)
CACHE_TIER_BYTES = Gauge("deepmesh_cache_tier_bytes", "Bytes held in a cache tier (this replica's view)", ["tier"])
CACHE_TIER_ENTRIES = Gauge("deepmesh_cache_tier_entries", "Blobs held in a cache tier (this replica's view)", ["tier"])
CACHE_LOAD_SECONDS = Histogram(
    "deepmesh_cache_load_seconds", "Time to read one blob from a tier", ["tier"], buckets=LOAD_BUCKETS
)
CACHE_EVICTIONS = Counter("deepmesh_cache_evictions", "Blobs dropped from the last tier for room", ["tier"])
CACHE_DEMOTIONS = Counter("deepmesh_cache_demotions", "Blobs moved down a tier for room", ["tier"])
CACHE_PROMOTIONS = Counter("deepmesh_cache_promotions", "Blobs copied up to memory on a hit", ["tier"])
CACHE_EXPIRED = Counter("deepmesh_cache_expired", "Blobs removed from every tier at their expiry")

# routing (common/routing.py): the routers' decisions, and the load each replica reports
ROUTE_DECISIONS = Counter(
    "deepmesh_route_decisions",
    "Jobs routed, by stage and why that replica (prefix, load, only_choice, rerouted, no_replica)",
    ["stage", "reason"],
)
ROUTE_DECISION_SECONDS = Histogram(
    "deepmesh_route_decision_seconds",
    "Time a router takes to choose a replica",
    ["stage"],
    buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01),
)
ROUTED_JOBS = Counter("deepmesh_routed_jobs", "Jobs a router sent to a replica", ["stage", "replica"])
REPORTED_LOAD = Gauge(
    "deepmesh_replica_load",
    "What this replica last reported (queued_jobs, running_jobs, queued_tokens, free_blocks, free_slots)",
    ["service", "measure"],
)


def export_compile_progress(gauge: Gauge, service: str, progress: Callable[[], tuple[int, int]]) -> None:
    """`gauge` (DECODE_GRAPHS or PREFILL_GRAPHS) read from `progress()`, (buckets ready, planned),
    at each scrape."""
    for index, state in enumerate(("ready", "planned")):
        gauge.labels(service, state).set_function(lambda index=index: progress()[index])
