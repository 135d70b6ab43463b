"""The prefill service: computes each prompt's state, samples the first token, hands the state over.

A prompt starts from the longest stored prefix of it (unless loading that would take longer
than computing it), and its state is stored at the anchors a later prompt may start from: the
end of the prompt (which is also the hand-over to decode, pinned by a lease), every
`anchor_interval` tokens inside it, and the block boundary where it leaves the blocks other
prompts stored (where conversations with a shared start, such as a system prompt, diverge).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from cache_svc.prefix import namespace_of
from cache_svc.retention import Retention
from cache_svc.store import PrefixMatch, StateStore, Stored
from common import metrics
from common.bus import Bus, Record
from common.messages import (
    BadMessage,
    DecodePayload,
    Envelope,
    JobStart,
    KVHandle,
    PrefillPayload,
    ResultPayload,
    TokensPayload,
    decode,
    payload_of,
)
from common.topics import Topic
from common.tracing import Span, SpanKind, context_of, job_span, start_span, within
from common.worker import Worker
from engine import EngineError, LLMEngine, RequestOutput, SamplingParams, SnapshotError


@dataclass
class _Job:
    payload: PrefillPayload
    record: Record
    span: Span  # from the job's arrival to its hand-over
    cached_tokens: int  # prompt tokens loaded from a stored prefix instead of computed
    namespace: str  # where its prefixes are stored: the engine's layout and the tenant
    ttl: float  # how long they live: the retention class's


log = logging.getLogger(__name__)


class PrefillWorker(Worker):
    topics = (Topic.PREFILL,)
    group = "prefill"

    def __init__(
        self,
        bus: Bus,
        topic_prefix: str,
        engine: LLMEngine,
        store: StateStore,
        lease_seconds: float = 600,
        retention: Retention | None = None,
        anchor_interval: int = 1024,
    ):
        super().__init__(bus, topic_prefix)
        self.engine = engine
        self.store = store
        self.lease_seconds = lease_seconds
        self.retention = retention or Retention()
        self.anchor_interval = anchor_interval  # tokens; a multiple of the block size
        self.jobs: dict[str, _Job] = {}
        self.tokens_per_second = 0.0  # measured prefill speed, against which a load is weighed

    @property
    def busy(self) -> bool:
        return bool(self.jobs)

    def handle(self, records: list[Record]) -> None:
        for record in records:
            try:
                envelope = decode(record.value, "prefill")
                payload = payload_of(envelope, PrefillPayload)
            except BadMessage as err:
                self.dead_letter(record, err)
                continue
            job_id = envelope.job_id
            if job_id in self.jobs:
                self.watermarks.seen(record)
                continue
            sampling = payload.sampling
            params = SamplingParams(
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                seed=sampling.seed,
                keep_final_state=True,  # a job done at its first token still leaves its prompt's state
            )
            prompt_tokens = len(payload.prompt_token_ids)
            parent = context_of(record.headers)
            span = start_span("prefill", job_id, parent, SpanKind.CONSUMER, **{"deepmesh.prompt_tokens": prompt_tokens})
            try:
                with within(span, job_id):
                    cached = self._start(job_id, payload, params)
            except EngineError as err:
                with within(span, job_id, end=True):
                    self._fail(job_id, str(err), span)
                self.watermarks.seen(record)
                continue
            span.set_attribute("deepmesh.cached_tokens", cached)
            metrics.PROMPT_TOKENS.labels(self.group).inc(prompt_tokens)
            metrics.PREFIX_TOKENS.labels("hit").inc(cached)
            metrics.PREFIX_TOKENS.labels("miss").inc(prompt_tokens - cached)
            namespace = namespace_of(self.engine.layout, payload.tenant)
            ttl = self.retention.ttl(payload.tenant, payload.retention)
            self.jobs[job_id] = _Job(payload, record, span, cached, namespace, ttl)
            self.watermarks.hold(record, job_id)
        metrics.RUNNING_JOBS.labels(self.group).set(len(self.jobs))

    def _start(self, job_id: str, payload: PrefillPayload, params: SamplingParams) -> int:
        """Admit a job, from the longest stored prefix of its prompt (its tenant's) if there is one
        worth loading; returns how many prompt tokens that prefix saved (0: a full prefill)."""
        prompt = payload.prompt_token_ids
        namespace = namespace_of(self.engine.layout, payload.tenant)
        with job_span("cache.lookup", job_id, kind=SpanKind.CLIENT):
            match = self.store.lookup(namespace, prompt, below=len(prompt))
        anchors = anchor_positions(len(prompt), match, self.anchor_interval)
        miss = match.miss_reason
        if match.key is not None and self._too_slow_to_load(match):
            miss = "too_slow"
        elif match.key is not None:
            ttl = self.retention.ttl(payload.tenant, payload.retention)
            with job_span("cache.load", job_id, kind=SpanKind.CLIENT, **{"deepmesh.bytes": match.size}):
                snapshot, miss = self.store.load(match.key, renew_seconds=ttl)  # a hit keeps it longer
            if snapshot is not None:
                metrics.STATE_BYTES.labels("get").inc(match.size)
                try:
                    if self.engine.import_prefix(job_id, snapshot, prompt, params, anchors):
                        return snapshot.num_computed
                except SnapshotError as err:  # unusable: a miss, computed from scratch
                    log.warning("prefix %s unusable: %s", match.key, err)
                    metrics.CACHE_MISSES.labels("corrupt").inc()
                if job_id in self.engine.seqs:  # queued for a full prefill: no room to load it now
                    return 0
        if miss == "too_slow":  # the store counts the other reasons
            metrics.CACHE_MISSES.labels(miss).inc()
        self.engine.add_request(job_id, prompt, params, anchors)
        return 0

    def _too_slow_to_load(self, match: PrefixMatch) -> bool:
        """Load or recompute: skip a prefix whose load would take longer than computing its tokens
        at the speed this worker measured (unmeasured yet: load)."""
        if self.tokens_per_second <= 0:
            return False
        return match.load_seconds > match.num_tokens / self.tokens_per_second

    def idle(self) -> None:
        if not self.jobs:
            return
        started = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - started
        metrics.ENGINE_STEP_SECONDS.labels(self.group).observe(elapsed)
        if self.engine.last_step_tokens > 1 and elapsed > 0:
            speed = self.engine.last_step_tokens / elapsed
            self.tokens_per_second = speed if not self.tokens_per_second else 0.9 * self.tokens_per_second + 0.1 * speed
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None:
                continue
            if out.prefix_state is not None:  # an anchor inside the prompt
                with within(job.span, out.request_id):
                    self._store_prefix(out.request_id, job, out.prefix_state.to_bytes())
            if not out.new_token_ids:
                continue
            metrics.GENERATED_TOKENS.labels(self.group).inc()
            with within(job.span, out.request_id, end=True):
                self._hand_over(out, job)
            del self.jobs[out.request_id]
            self.watermarks.release(out.request_id)
        metrics.RUNNING_JOBS.labels(self.group).set(len(self.jobs))

    def _hand_over(self, out: RequestOutput, job: _Job) -> None:
        """Send the first token on: with the state to decode, or straight out when it is also the last."""
        job_id, first, prompt = out.request_id, out.new_token_ids[0], job.payload.prompt_token_ids
        if out.finished:  # done at the first token: no decode needed
            start = JobStart(
                endpoint=job.payload.endpoint,
                body=job.payload.body,
                prompt_tokens=len(prompt),
                cached_tokens=job.cached_tokens,
            )
            tokens = TokensPayload(start=start, token_ids=[first], finished=True, finish_reason=out.finish_reason)
            self.hop(Topic.TOKENS, Envelope(type="tokens", job_id=job_id, payload=tokens.model_dump()), job.span)
            if out.final_state is not None:
                self._store_prefix(job_id, job, out.final_state.to_bytes())
            return
        snapshot = self.engine.export_state(job_id)
        seed = self.engine.seqs[job_id].seed
        self.engine.abort(job_id)
        # The prompt's anchor is also the hand-over: leased to this job until decode has loaded it.
        stored = self._store_prefix(job_id, job, snapshot.to_bytes(), lease=True)
        kv = None
        if stored is not None:
            kv = KVHandle(
                key=stored.key,
                size=stored.size,
                checksum=stored.checksum,
                layout=snapshot.layout,
                num_tokens=stored.num_tokens,
                lease_expires_at=time.time() + self.lease_seconds,
            )
        handoff = DecodePayload(
            endpoint=job.payload.endpoint,
            body=job.payload.body,
            prompt_token_ids=prompt,
            first_token=first,
            seed=seed,
            sampling=job.payload.sampling,
            kv=kv,
            cached_tokens=job.cached_tokens,
            tenant=job.payload.tenant,
            retention=job.payload.retention,
        )
        self.hop(Topic.DECODE, Envelope(type="decode", job_id=job_id, payload=handoff.model_dump()), job.span)

    def _store_prefix(self, job_id: str, job: _Job, data: bytes, lease: bool = False) -> Stored | None:
        """Store a state of the prompt where a longer prompt that starts with it can resume."""
        with job_span("cache.put_prefix", job_id, kind=SpanKind.CLIENT, **{"deepmesh.bytes": len(data)}):
            holder, seconds = (job_id, self.lease_seconds) if lease else (None, 0.0)
            stored = self.store.put_prefix(job.namespace, data, job.ttl, holder, seconds)
        metrics.STATE_BYTES.labels("put").inc(len(data))
        return stored

    def _fail(self, job_id: str, reason: str, span: Span) -> None:
        error = {"error": {"message": reason, "type": "invalid_request_error", "param": None, "code": None}}
        result = ResultPayload(done=True, status=400, body=error)
        self.hop(Topic.RESULTS, Envelope(type="result", job_id=job_id, payload=result.model_dump()), span)


def anchor_positions(prompt_len: int, match: PrefixMatch, interval: int) -> list[int]:
    """Where inside a prompt to store its state, beyond the prefix it starts from: every
    `interval` tokens, and the end of the blocks it shares with prompts stored before it."""
    start = match.num_tokens
    positions = set(range(interval, prompt_len, interval)) if interval > 0 else set()
    positions.add(match.shared_tokens)
    return sorted(p for p in positions if start < p < prompt_len)
