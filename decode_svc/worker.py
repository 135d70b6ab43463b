"""The decode service: imports each job's prefilled state and decodes all of them together."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from cache_svc.store import StateStore
from common.bus import Bus, Record
from common.messages import BadMessage, DecodePayload, Envelope, JobStart, TokensPayload, decode, payload_of
from common.topics import Topic
from common.worker import Worker
from engine import EngineError, LLMEngine, SamplingParams, SnapshotError, StateSnapshot

log = logging.getLogger(__name__)


@dataclass
class _Job:
    payload: DecodePayload
    next_seq: int = 1  # seq 0 (the start and the first token) goes out when the job arrives


class DecodeWorker(Worker):
    topics = (Topic.DECODE,)
    group = "decode"

    def __init__(self, bus: Bus, topic_prefix: str, engine: LLMEngine, store: StateStore):
        super().__init__(bus, topic_prefix)
        self.engine = engine
        self.store = store
        self.jobs: dict[str, _Job] = {}
        self.cancelled: set[str] = set()  # cancels that arrived before their job (bounded below)
        self.loaded = self.recomputed = 0

    @property
    def busy(self) -> bool:
        return bool(self.jobs)

    def handle(self, records: list[Record]) -> None:
        for record in records:
            try:
                envelope = decode(record.value)
                if envelope.type == "cancel":
                    self._cancel(envelope.job_id)
                    self.watermarks.seen(record)
                    continue
                if envelope.type != "decode":
                    raise BadMessage(f"envelope type {envelope.type!r} does not belong on the decode topic")
                payload = payload_of(envelope, DecodePayload)
            except BadMessage as err:
                self.dead_letter(record, err)
                continue
            if envelope.job_id in self.jobs or envelope.job_id in self.cancelled:
                self.cancelled.discard(envelope.job_id)
                self.watermarks.seen(record)
                continue
            try:
                self._start(envelope.job_id, payload)
            except EngineError as err:  # input the engine refuses: nothing to decode
                self.dead_letter(record, err)
                continue
            self.watermarks.hold(record, envelope.job_id)

    def _start(self, job_id: str, payload: DecodePayload) -> None:
        sampling = payload.sampling
        params = SamplingParams(
            max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p, seed=payload.seed
        )
        snapshot = self._fetch(payload)
        if snapshot is not None and self.engine.import_state(job_id, snapshot, params):
            self.loaded += 1
        else:
            if snapshot is None:  # missing, corrupt or of another layout: recompute, never guess
                self.engine.resume(job_id, payload.prompt_token_ids, [payload.first_token], params, payload.seed)
            self.recomputed += 1
        self.jobs[job_id] = _Job(payload)
        start = JobStart(
            endpoint=payload.endpoint,
            body=payload.body,
            prompt_tokens=len(payload.prompt_token_ids),
            cached_tokens=payload.cached_tokens,
        )
        self._tokens(job_id, 0, TokensPayload(start=start, token_ids=[payload.first_token]))

    def _cancel(self, job_id: str) -> None:
        """Stop a job now and free its state; a cancel that comes first stops the job on arrival."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            self.cancelled.add(job_id)
            if len(self.cancelled) > 100_000:
                self.cancelled.clear()
            return
        self.engine.abort(job_id)
        if job.payload.kv is not None:
            self.store.delete(job.payload.kv.key)
        tokens = TokensPayload(finished=True, finish_reason="abort")
        self._tokens(job_id, job.next_seq, tokens)
        self.watermarks.release(job_id)

    def _fetch(self, payload: DecodePayload) -> StateSnapshot | None:
        kv = payload.kv
        if kv is None or kv.layout != self.engine.layout:
            return None
        data = self.store.get(kv.key)
        if data is None:
            return None
        try:
            return StateSnapshot.from_bytes(data)
        except SnapshotError as err:
            log.warning("unusable state %s: %s", kv.key, err)
            return None

    def idle(self) -> None:
        if not self.jobs:
            return
        for out in self.engine.step():
            job = self.jobs.get(out.request_id)
            if job is None:
                continue
            tokens = TokensPayload(token_ids=out.new_token_ids, finished=out.finished, finish_reason=out.finish_reason)
            self._tokens(out.request_id, job.next_seq, tokens)
            job.next_seq += 1
            if out.finished:
                if job.payload.kv is not None:
                    self.store.delete(job.payload.kv.key)
                del self.jobs[out.request_id]
                self.watermarks.release(out.request_id)

    def _tokens(self, job_id: str, seq: int, tokens: TokensPayload) -> None:
        message = Envelope(type="tokens", job_id=job_id, seq=seq, payload=tokens.model_dump())
        self.bus.produce(self.topic(Topic.TOKENS), job_id, message.encode())
