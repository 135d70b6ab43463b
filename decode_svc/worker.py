"""The decode service: imports each job's prefilled state and decodes all of them together."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from cache_svc.prefix import namespace_of
from cache_svc.retention import Retention
from cache_svc.store import StateStore
from common import metrics
from common.bus import Bus, Record
from common.messages import BadMessage, DecodePayload, Envelope, JobStart, TokensPayload, payload_of
from common.topics import Topic
from common.tracing import Span, SpanKind, context_of, headers_of, job_span, start_span, within
from common.worker import EarlyCancels, EngineWorker
from engine import EngineError, LLMEngine, SamplingParams, StateSnapshot

log = logging.getLogger(__name__)


@dataclass
class _Job:
    payload: DecodePayload
    span: Span  # from the job's arrival to its last token
    headers: dict[str, bytes] = field(default_factory=dict)  # the span's context, on every tokens message
    sent: int = 1  # tokens sent: the first (prefill's) goes out with the start when the job arrives


class DecodeWorker(EngineWorker):
    topics = (Topic.DECODE,)
    group = "decode"

    def __init__(
        self, bus: Bus, topic_prefix: str, engine: LLMEngine, store: StateStore, retention: Retention | None = None
    ):
        super().__init__(bus, topic_prefix)
        self.engine = engine
        self.store = store
        self.retention = retention or Retention()
        self.jobs: dict[str, _Job] = {}
        self.cancelled = EarlyCancels()
        self.loaded = self.recomputed = 0

    @property
    def busy(self) -> bool:
        return bool(self.jobs)

    def handle(self, records: list[Record]) -> None:
        for record in records:
            try:
                envelope = self.job_message(record, "decode")
                if envelope is None:
                    continue
                payload = payload_of(envelope, DecodePayload)
            except BadMessage as err:
                self.dead_letter(record, err)
                continue
            if envelope.job_id in self.jobs:  # a replay of a job already running here (a prefill did it twice)
                self._release(envelope.job_id, payload)
                self.watermarks.seen(record)
                continue
            if self.cancelled.take(envelope.job_id):  # never started: free the state prefill left for it
                self._release(envelope.job_id, payload)
                self.watermarks.seen(record)
                continue
            span = start_span("decode", envelope.job_id, context_of(record.headers), SpanKind.CONSUMER)
            try:
                with within(span, envelope.job_id):
                    self._start(envelope.job_id, payload, span)
            except EngineError as err:  # input the engine refuses: nothing to decode
                span.end()
                self.dead_letter(record, err)
                continue
            self.watermarks.hold(record, envelope.job_id)
        metrics.RUNNING_JOBS.labels(self.group).set(len(self.jobs))

    def _start(self, job_id: str, payload: DecodePayload, span: Span) -> None:
        sampling = payload.sampling
        params = SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=payload.seed,
            keep_final_state=True,  # stored below as where the conversation's next turn can resume
        )
        with job_span("cache.load", job_id, kind=SpanKind.CLIENT):
            snapshot = self._fetch(job_id, payload)
        if snapshot is not None and self.engine.import_state(job_id, snapshot, params):
            self.loaded += 1
            outcome = "loaded"
        else:
            if snapshot is None:  # missing, corrupt or of another layout: recompute, never guess
                self.engine.resume(job_id, payload.prompt_token_ids, [payload.first_token], params, payload.seed)
            self.recomputed += 1
            outcome = "recomputed"
        span.set_attribute("deepmesh.state", outcome)
        metrics.STATE_HANDOFFS.labels(outcome).inc()
        self.jobs[job_id] = _Job(payload, span, headers_of(span))
        start = JobStart(
            endpoint=payload.endpoint,
            body=payload.body,
            prompt_tokens=len(payload.prompt_token_ids),
            cached_tokens=payload.cached_tokens,
        )
        seq0 = TokensPayload(start=start, token_ids=[payload.first_token])
        self.hop(Topic.TOKENS, Envelope(type="tokens", job_id=job_id, payload=seq0.model_dump()), span)

    def cancel(self, job_id: str) -> None:
        """Stop a job now and free its state; a cancel that comes first stops the job on arrival."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            self.cancelled.add(job_id)
            return
        self.engine.abort(job_id)
        tokens = TokensPayload(finished=True, finish_reason="abort")
        self.send(Topic.TOKENS, self._tokens_message(job, job_id, tokens), job.headers)
        self._finish(job_id, job, "cancelled")

    def _release(self, job_id: str, payload: DecodePayload) -> None:
        """Unpin the prompt's entry prefill leased to this job: it will not be loaded."""
        if payload.kv is not None:
            try:
                self.store.release(payload.kv.key, job_id)
            except Exception:  # a lease that cannot be released lapses on its own
                log.exception("releasing %s for %s failed", payload.kv.key, job_id)

    def _fetch(self, job_id: str, payload: DecodePayload) -> StateSnapshot | None:
        """The prompt's state prefill stored, as this job's: or None (recompute) when it is gone."""
        kv = payload.kv
        if kv is None:
            return None
        try:
            if kv.layout != self.engine.layout:
                log.warning("state %s has layout %s, not this engine's %s", kv.key, kv.layout, self.engine.layout)
                self._release(job_id, payload)
                return None
            snapshot, _ = self.store.load(kv.key, release=job_id)  # loaded (or gone): the pin is done
        except Exception:  # a cache that fails means recomputing, never a lost job
            log.exception("loading %s failed", kv.key)
            return None
        if snapshot is None:
            return None
        prompt = payload.prompt_token_ids
        if snapshot.num_computed != len(prompt) or snapshot.token_ids[: len(prompt)] != prompt:
            log.warning("state %s is not of this job's prompt", kv.key)
            return None
        metrics.STATE_BYTES.labels("get").inc(kv.size)
        # an anchor holds the state of its tokens alone: this job continues it from its first token
        snapshot.token_ids, snapshot.prompt_len, snapshot.seed = (
            [*prompt, payload.first_token],
            len(prompt),
            payload.seed,
        )
        return snapshot

    def idle(self) -> None:
        if not self.jobs:
            return
        started = time.perf_counter()
        outputs = self.engine.step()
        metrics.ENGINE_STEP_SECONDS.labels(self.group).observe(time.perf_counter() - started)
        step: list[tuple[Envelope, dict[str, bytes]]] = []
        finished: list[tuple[str, _Job, str, StateSnapshot | None]] = []
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None:
                continue
            metrics.GENERATED_TOKENS.labels(self.group).inc(len(out.new_token_ids))
            tokens = TokensPayload(token_ids=out.new_token_ids, finished=out.finished, finish_reason=out.finish_reason)
            step.append((self._tokens_message(job, out.request_id, tokens), job.headers))
            if out.finished:
                finished.append((out.request_id, job, out.finish_reason or "stop", out.final_state))
        self.send_batch(Topic.TOKENS, step)  # every job's tokens of this step, in one batch
        for job_id, job, reason, final_state in finished:  # only once their last tokens are stored
            del self.jobs[job_id]
            self._finish(job_id, job, reason, final_state)
        metrics.RUNNING_JOBS.labels(self.group).set(len(self.jobs))

    def _finish(self, job_id: str, job: _Job, outcome: str, final_state: StateSnapshot | None = None) -> None:
        """Store the job's final state as a prefix anchor, close its span and let its record be committed."""
        with within(job.span, job_id, end=True):
            job.span.set_attribute("deepmesh.finish", outcome)
            job.span.set_attribute("deepmesh.tokens", job.sent)
            if final_state is not None:
                data = final_state.to_bytes()
                with job_span("cache.put_prefix", job_id, kind=SpanKind.CLIENT, **{"deepmesh.bytes": len(data)}):
                    namespace = namespace_of(self.engine.layout, job.payload.tenant)
                    ttl = self.retention.ttl(job.payload.tenant, job.payload.retention)
                    try:
                        self.store.put_prefix(namespace, data, ttl)
                    except Exception:  # a cache that fails is a later miss, never a lost job
                        log.exception("storing the final state of %s failed", job_id)
                metrics.STATE_BYTES.labels("put").inc(len(data))
        self.watermarks.release(job_id)

    def _tokens_message(self, job: _Job, job_id: str, tokens: TokensPayload) -> Envelope:
        """The job's next tokens message: its seq is the index of its first token (common/job_streams.py)."""
        message = Envelope(type="tokens", job_id=job_id, seq=job.sent, payload=tokens.model_dump())
        job.sent += len(tokens.token_ids)
        return message
