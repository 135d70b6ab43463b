"""The prefill service: computes each prompt's state, samples the first token, hands the state over."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from cache_svc.prefix import namespace_of
from cache_svc.retention import Retention
from cache_svc.store import StateStore
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
from engine import EngineError, LLMEngine, RequestOutput, SamplingParams, SnapshotError, StateSnapshot


@dataclass
class _Job:
    payload: PrefillPayload
    record: Record
    span: Span  # from the job's arrival to its hand-over
    cached_tokens: int  # prompt tokens loaded from a stored prefix instead of computed


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
    ):
        super().__init__(bus, topic_prefix)
        self.engine = engine
        self.store = store
        self.lease_seconds = lease_seconds
        self.retention = retention or Retention()
        self.jobs: dict[str, _Job] = {}

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
            self.jobs[job_id] = _Job(payload, record, span, cached)
            self.watermarks.hold(record, job_id)
        metrics.RUNNING_JOBS.labels(self.group).set(len(self.jobs))

    def _start(self, job_id: str, payload: PrefillPayload, params: SamplingParams) -> int:
        """Admit a job, from the longest stored prefix of its prompt (its tenant's) if there is one;
        returns how many prompt tokens that prefix saved (0: a full prefill)."""
        prompt = payload.prompt_token_ids
        found = self.store.longest_prefix(namespace_of(self.engine.layout, payload.tenant), prompt, below=len(prompt))
        if found is not None:
            key, _ = found
            with job_span("cache.get_prefix", job_id, kind=SpanKind.CLIENT):
                data = self.store.get(key)
                self.store.renew(key, self.retention.ttl(payload.tenant, payload.retention))  # a hit keeps it
            try:
                snapshot = StateSnapshot.from_bytes(data) if data is not None else None
                if snapshot is not None and self.engine.import_prefix(job_id, snapshot, prompt, params):
                    return snapshot.num_computed
            except SnapshotError as err:  # unusable: a miss, computed from scratch
                log.warning("prefix %s unusable: %s", key, err)
            if job_id in self.engine.seqs:  # queued for a full prefill: no room to load it now
                return 0
        self.engine.add_request(job_id, prompt, params)
        return 0

    def idle(self) -> None:
        if not self.jobs:
            return
        started = time.perf_counter()
        outputs = self.engine.step()
        metrics.ENGINE_STEP_SECONDS.labels(self.group).observe(time.perf_counter() - started)
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None or not out.new_token_ids:
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
                self._store_prefix(job_id, job.payload, out.final_state.to_bytes())
            return
        snapshot = self.engine.export_state(job_id)
        seed = self.engine.seqs[job_id].seed
        self.engine.abort(job_id)
        data = snapshot.to_bytes()
        key = f"{job_id}/prefill"
        with job_span("cache.put", job_id, kind=SpanKind.CLIENT, **{"deepmesh.bytes": len(data)}):
            checksum, expires = self.store.put(key, data, self.lease_seconds)
        metrics.STATE_BYTES.labels("put").inc(len(data))
        self._store_prefix(job_id, job.payload, data)
        kv = KVHandle(
            key=key,
            size=len(data),
            checksum=checksum,
            layout=snapshot.layout,
            num_tokens=snapshot.num_computed,
            lease_expires_at=expires,
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

    def _store_prefix(self, job_id: str, payload: PrefillPayload, data: bytes) -> None:
        """The prompt's state, where a longer prompt that starts with it (the next turn) can resume."""
        namespace = namespace_of(self.engine.layout, payload.tenant)
        ttl = self.retention.ttl(payload.tenant, payload.retention)
        with job_span("cache.put_prefix", job_id, kind=SpanKind.CLIENT, **{"deepmesh.bytes": len(data)}):
            self.store.put_prefix(namespace, payload.prompt_token_ids, data, ttl)
        metrics.STATE_BYTES.labels("put").inc(len(data))

    def _fail(self, job_id: str, reason: str, span: Span) -> None:
        error = {"error": {"message": reason, "type": "invalid_request_error", "param": None, "code": None}}
        result = ResultPayload(done=True, status=400, body=error)
        self.hop(Topic.RESULTS, Envelope(type="result", job_id=job_id, payload=result.model_dump()), span)
