"""The prefill service: computes each prompt's state, samples the first token, hands the state over."""

from __future__ import annotations

from dataclasses import dataclass

from cache_svc.store import StateStore
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
from common.worker import Worker
from engine import EngineError, LLMEngine, SamplingParams


@dataclass
class _Job:
    payload: PrefillPayload
    record: Record


class PrefillWorker(Worker):
    topics = (Topic.PREFILL,)
    group = "prefill"

    def __init__(self, bus: Bus, topic_prefix: str, engine: LLMEngine, store: StateStore, lease_seconds: float = 600):
        super().__init__(bus, topic_prefix)
        self.engine = engine
        self.store = store
        self.lease_seconds = lease_seconds
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
            )
            try:
                self.engine.add_request(job_id, payload.prompt_token_ids, params)
            except EngineError as err:
                self._fail(job_id, str(err))
                self.watermarks.seen(record)
                continue
            self.jobs[job_id] = _Job(payload, record)
            self.watermarks.hold(record, job_id)

    def idle(self) -> None:
        if not self.jobs:
            return
        for out in self.engine.step():
            job = self.jobs.get(out.request_id)
            if job is None or not out.new_token_ids:
                continue
            first = out.new_token_ids[0]
            prompt = job.payload.prompt_token_ids
            if out.finished:  # done at the first token: no decode needed
                start = JobStart(endpoint=job.payload.endpoint, body=job.payload.body, prompt_tokens=len(prompt))
                tokens = TokensPayload(start=start, token_ids=[first], finished=True, finish_reason=out.finish_reason)
                self._send(Topic.TOKENS, Envelope(type="tokens", job_id=out.request_id, payload=tokens.model_dump()))
            else:
                snapshot = self.engine.export_state(out.request_id)
                seed = self.engine.seqs[out.request_id].seed
                self.engine.abort(out.request_id)
                data = snapshot.to_bytes()
                key = f"{out.request_id}/prefill"
                checksum, expires = self.store.put(key, data, self.lease_seconds)
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
                )
                self._send(Topic.DECODE, Envelope(type="decode", job_id=out.request_id, payload=handoff.model_dump()))
            del self.jobs[out.request_id]
            self.watermarks.release(out.request_id)

    def _send(self, topic: Topic, envelope: Envelope) -> None:
        self.bus.produce(self.topic(topic), envelope.job_id, envelope.encode())

    def _fail(self, job_id: str, reason: str) -> None:
        error = {"error": {"message": reason, "type": "invalid_request_error", "param": None, "code": None}}
        result = ResultPayload(done=True, status=400, body=error)
        self._send(Topic.RESULTS, Envelope(type="result", job_id=job_id, payload=result.model_dump()))
