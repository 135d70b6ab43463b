"""The decode service: imports each job's prefilled state and decodes all of them together.

A job's state is loaded from the cache on a fetch thread while the engine keeps stepping the
others; the job joins the batch once it has arrived (or, if it is gone, to be recomputed from
its tokens). A finished job's state is stored, as where its conversation's next turn can
resume, on the same threads.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from common import metrics
from common.api import error_body, server_error_kind
from common.bus import Bus, Record
from common.messages import (
    DecodePayload,
    Envelope,
    ResultPayload,
    TokensPayload,
    WarmPayload,
)
from common.moving_average import MovingAverage
from common.replicas import ReplicaTable
from common.retention import Retention
from common.routing import Route, Router
from common.topics import Topic
from common.tracing import Span, SpanKind, context_of, headers_of, start_span, within
from common.worker import EngineWorker
from engine import EngineError, ImageRows, ImageSpan, LLMEngine, SamplingParams, StateSnapshot
from engine.prefix_connector import PrefixConnector
from engine.prefix_store import PrefixStore

log = logging.getLogger(__name__)


@dataclass
class _Job:
    payload: DecodePayload
    span: Span  # from the job's arrival to its last token
    record: Record
    headers: dict[str, bytes] = field(default_factory=dict)  # the span's context, on every tokens message
    sent: int = 1  # tokens sent: the first is prefill's, sent by prefill (or here when the job joins, if it did not)
    fetch: Future[StateSnapshot | None] | None = None  # until its state has been loaded (or found gone)


class DecodeWorker(EngineWorker[_Job, DecodePayload]):
    topics = (Topic.DECODE,)
    group = "decode"
    job_type = "decode"
    payload_type = DecodePayload
    steps_after_first_tokens = True

    def __init__(
        self,
        bus: Bus,
        topic_prefix: str,
        engine: LLMEngine,
        store: PrefixStore,
        retention: Retention | None = None,
        fetch_threads: int = 2,
        replicas: ReplicaTable | None = None,
    ):
        """`replicas`: the load reports by which a job meant for a replica that left goes on."""
        super().__init__(bus, topic_prefix, fetch_threads, replicas)
        self.engine: LLMEngine = engine
        self.cache = PrefixConnector(store, engine.layout, retention)
        self.image_rows = ImageRows(store, engine.weights, retention)
        self.loaded = self.recomputed = 0
        self.step_time = MovingAverage(0.1)  # seconds per engine step, for the load reports
        metrics.export_compile_progress(metrics.DECODE_GRAPHS, self.group, engine.compile_progress)

    @property
    def busy(self) -> bool:
        return bool(self.jobs)

    def arrived(self, record: Record, envelope: Envelope, payload: DecodePayload) -> _Job:
        span = start_span(
            "decode",
            envelope.job_id,
            context_of(record.headers),
            SpanKind.CONSUMER,
            **{"deepmesh.replica": self.replica},
        )
        return _Job(payload, span, record, headers_of(span))

    def passed_over(self, job_id: str, payload: DecodePayload) -> None:
        """A replay of a job here (a prefill did it twice), or one cancelled before it came: free
        the state prefill left for it."""
        self._release(job_id, payload)

    def _fetch(self, job_id: str, job: _Job) -> tuple[StateSnapshot | None, list[ImageSpan]]:
        """On a fetch thread: the prompt's state prefill stored, as this job's (None: recompute),
        and its images' rows (a recompute reads them; the engine keeps them for one)."""
        payload = job.payload
        with within(job.span, job_id):
            images = [
                ImageSpan(ref.start, rows)
                for ref in payload.images
                if (rows := self.image_rows.load(payload.tenant, payload.retention, ref.digest, ref.num_tokens))
                is not None
            ]
        return self._handed_over(job_id, job), images

    def _handed_over(self, job_id: str, job: _Job) -> StateSnapshot | None:
        payload, kv = job.payload, job.payload.kv
        if kv is None:
            return None
        with within(job.span, job_id):
            snapshot = self.cache.load_handoff(job_id, kv.key, kv.layout, kv.size, payload.prompt_token_ids)
        if snapshot is not None:
            # an anchor holds the state of its tokens alone: this job continues it from its first token
            prompt = payload.prompt_token_ids
            snapshot.token_ids, snapshot.prompt_len, snapshot.seed = (
                [*prompt, payload.first_token],
                len(prompt),
                payload.seed,
            )
        return snapshot

    def _admit(self, job_id: str, job: _Job) -> None:
        """Start a job whose state has arrived (or is gone: recomputed from its tokens)."""
        assert job.fetch is not None
        try:
            snapshot, images = job.fetch.result()
        except Exception:  # a cache that fails means recomputing, never a lost job
            log.exception("loading the state of %s failed", job_id)
            snapshot, images = None, []
        job.fetch = None
        payload = job.payload
        sampling = payload.sampling
        params = SamplingParams(
            **sampling.engine_params(payload.tenant, payload.priority, payload.seed),
            # stored below as where the conversation's next turn can resume; a batch request has none
            # to come, and the copy and the store would cost interactive traffic its cores
            keep_final_state=payload.priority == "interactive",
        )
        try:
            with within(job.span, job_id):
                if snapshot is not None and self.engine.import_state(job_id, snapshot, params, images):
                    self.loaded += 1
                    outcome = "loaded"
                else:
                    if snapshot is None:  # missing, corrupt or of another layout: recompute, never guess
                        self.engine.resume(
                            job_id, payload.prompt_token_ids, [payload.first_token], params, payload.seed, images
                        )
                    self.recomputed += 1
                    outcome = "recomputed"
        except EngineError as err:  # input the engine refuses: nothing to decode
            del self.jobs[job_id]
            self.dead_letter(job.record, err)
            # prefill took it, so this engine differs from prefill's (a smaller context, no
            # tokenizer for a grammar): the client gets the reason now, not a timeout
            endpoint = payload.endpoint
            failed = ResultPayload(
                done=True,
                status=500,
                body=error_body(endpoint, f"decode refused the job: {err}", server_error_kind(endpoint)),
            )
            self.hop(Topic.RESULTS, Envelope(type="result", job_id=job_id, payload=failed.model_dump()), job.span)
            job.span.end()
            self.end_here(job_id)
            self.watermarks.release(job_id)
            return
        job.span.set_attribute("deepmesh.state", outcome)
        metrics.STATE_HANDOFFS.labels(outcome).inc()
        if payload.first_sent:
            return
        seq0 = TokensPayload(
            prompt_tokens=len(payload.prompt_token_ids),
            cached_tokens=payload.cached_tokens,
            token_ids=[payload.first_token],
            logprobs=[payload.first_logprobs] if payload.first_logprobs is not None else None,
            prompt_logprobs=payload.prompt_logprobs,
        )
        self.hop(Topic.TOKENS, Envelope(type="tokens", job_id=job_id, payload=seq0.model_dump()), job.span)

    def cancel_started(self, job_id: str, job: _Job) -> bool:
        """A job decoding (its first token has gone out): it ends with a last tokens message. One
        still loading is dropped: nobody has seen a token of it."""
        del self.jobs[job_id]
        self.engine.abort(job_id)
        tokens = TokensPayload(finished=True, finish_reason="abort")
        self.send(Topic.TOKENS, self._tokens_message(job, job_id, tokens), job.headers)
        self._finish(job_id, job, "cancelled")
        return True

    def _release(self, job_id: str, payload: DecodePayload) -> None:
        """Unpin the prompt's entry prefill leased to this job: it will not be loaded."""
        if payload.kv is not None:
            self.cache.release(job_id, payload.kv.key)

    @property
    def urgent(self) -> bool:
        """An interactive job's state is being loaded: its first token goes out once it is admitted."""
        return any(job.fetch is not None and job.payload.priority == "interactive" for job in self.jobs.values())

    def idle(self) -> None:
        if not self.jobs:
            return
        self.admit_fetched()
        if not self.engine.has_unfinished_requests():
            metrics.RUNNING_JOBS.labels(self.group).set(len(self.jobs))
            return
        if self.yields_step():
            return
        started = time.perf_counter()
        outputs = self.step_engine()
        elapsed = time.perf_counter() - started
        metrics.ENGINE_STEP_SECONDS.labels(self.group).observe(elapsed)
        self.step_time.observe(elapsed)
        if self.engine.last_step_drafted:
            method = self.engine.speculative_method
            metrics.SPEC_DRAFT_TOKENS.labels(method).inc(self.engine.last_step_drafted)
            metrics.SPEC_ACCEPTED_TOKENS.labels(method).inc(self.engine.last_step_accepted)
        step: list[tuple[Envelope, dict[str, bytes]]] = []
        finished: list[tuple[str, _Job, str, StateSnapshot | None]] = []
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None or job.fetch is not None:  # not (yet) in the engine: the output of one dropped before
                continue
            metrics.GENERATED_TOKENS.labels(self.group).inc(len(out.new_token_ids))
            tokens = TokensPayload(
                token_ids=out.new_token_ids,
                logprobs=out.token_logprobs(),
                finished=out.finished,
                finish_reason=out.finish_reason,
            )
            step.append((self._tokens_message(job, out.request_id, tokens), job.headers))
            if out.finished:
                finished.append((out.request_id, job, out.finish_reason or "stop", out.final_state))
        self.send_batch(Topic.TOKENS, step)  # every job's tokens of this step, in one batch
        for job_id, job, reason, final_state in finished:  # only once their last tokens are stored
            del self.jobs[job_id]
            self._finish(job_id, job, reason, final_state)
        metrics.RUNNING_JOBS.labels(self.group).set(len(self.jobs))

    def route_again(self, router: Router, job_id: str, payload: DecodePayload) -> Route:
        return router.decode(job_id, len(payload.prompt_token_ids) + payload.sampling.max_tokens, rerouted=True)

    def speeds(self) -> dict[str, float]:
        return {"step_seconds": self.step_time.value}

    def _finish(self, job_id: str, job: _Job, outcome: str, final_state: StateSnapshot | None = None) -> None:
        """Close the job's span, let its record be committed, and store its final state as a
        prefix anchor (on a fetch thread: nothing waits for it)."""
        with within(job.span, job_id, end=True):
            job.span.set_attribute("deepmesh.finish", outcome)
            job.span.set_attribute("deepmesh.tokens", job.sent)
        self.watermarks.release(job_id)
        if final_state is not None:
            payload = job.payload
            stored = self.save_later(job_id, job.span, payload.tenant, payload.retention, final_state)
            stored.add_done_callback(lambda done: self._warm_prefill(job_id, job, final_state, done))

    def _warm_prefill(self, job_id: str, job: _Job, state: StateSnapshot, stored: Future) -> None:
        """Once a finished conversation's state is stored, ask the prefill replica that prefilled
        it to hold it (WarmPayload): the conversation's next turn is routed back there. On the
        fetch thread that stored it; a replica out of rotation is not asked."""
        if stored.cancelled() or stored.exception() is not None or stored.result() is None:
            return
        payload = job.payload
        if self.replicas is None or payload.prefilled_by is None:
            return
        holder = next((r for r in self.replicas.live("prefill") if r.replica == payload.prefilled_by), None)
        if holder is None:
            return
        warm = WarmPayload(
            token_ids=state.token_ids[: state.num_computed], tenant=payload.tenant, retention=payload.retention
        )
        try:
            message = Envelope(type="warm", job_id=job_id, payload=warm.model_dump())
            self.send(Topic.PREFILL, message, job.headers, holder.partitions[0])  # in the job's trace
        except Exception:  # the next turn loads it from the cache service instead
            log.warning("asking %s to hold %s failed", holder.replica, job_id, exc_info=True)

    def _tokens_message(self, job: _Job, job_id: str, tokens: TokensPayload) -> Envelope:
        """The job's next tokens message: its seq is the index of its first token (common/job_streams.py)."""
        message = Envelope(type="tokens", job_id=job_id, seq=job.sent, payload=tokens.model_dump())
        job.sent += len(tokens.token_ids)
        return message
