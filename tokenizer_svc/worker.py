"""The tokenizer service: `requests` -> `prefill` on the way in, `tokens` -> `results` on the way out."""

from __future__ import annotations

import json
from dataclasses import dataclass

from common.bus import Bus, Record
from common.messages import (
    BadMessage,
    Envelope,
    PrefillPayload,
    RequestPayload,
    ResultPayload,
    Sampling,
    StreamEvent,
    TokensPayload,
    decode,
    payload_of,
)
from common.topics import Topic
from common.worker import Worker
from tokenizer_svc.protocol import Codec, Event, OutputStream, ProtocolError


@dataclass
class _Job:
    output: OutputStream
    next_tokens_seq: int = 0  # the next `tokens` seq this job expects; lower ones are replays
    next_result_seq: int = 0


class TokenizerWorker(Worker):
    topics = (Topic.REQUESTS, Topic.TOKENS)
    group = "tokenizer"

    def __init__(self, bus: Bus, topic_prefix: str, codec: Codec):
        super().__init__(bus, topic_prefix)
        self.codec = codec
        self.jobs: dict[str, _Job] = {}

    def handle(self, records: list[Record]) -> None:
        # a job's tokens messages from one poll become one results message: when the worker
        # falls behind, it catches up in fewer, larger messages instead of falling further behind
        pending: dict[str, list[Event]] = {}
        for record in records:
            try:
                if record.topic == self.topic(Topic.REQUESTS):
                    self._on_request(record)
                else:
                    self._on_tokens(record, pending)
            except BadMessage as err:
                self.dead_letter(record, err)
        for job_id, events in pending.items():
            self._emit(job_id, events, done=False)

    def _on_request(self, record: Record) -> None:
        envelope = decode(record.value, "request")
        request = payload_of(envelope, RequestPayload)
        try:
            prompt = self.codec.prompt(request.endpoint, request.body)
        except ProtocolError as err:
            error = ResultPayload(done=True, status=err.status_code, body=json.loads(err.body))
            self._result(envelope.job_id, 0, error)
        else:
            prefill = PrefillPayload(
                endpoint=request.endpoint,
                body=request.body,
                prompt_token_ids=prompt.token_ids,
                sampling=Sampling(
                    max_tokens=prompt.max_tokens, temperature=prompt.temperature, top_p=prompt.top_p, seed=prompt.seed
                ),
            )
            message = Envelope(type="prefill", job_id=envelope.job_id, payload=prefill.model_dump())
            self.bus.produce(self.topic(Topic.PREFILL), envelope.job_id, message.encode())
        self.watermarks.seen(record)

    def _on_tokens(self, record: Record, pending: dict[str, list[Event]]) -> None:
        envelope = decode(record.value, "tokens")
        tokens = payload_of(envelope, TokensPayload)
        job_id = envelope.job_id
        job = self.jobs.get(job_id)
        if job is None:
            if envelope.seq != 0 or tokens.start is None:
                # the job finished here already (this is a replay), or its start was never seen
                self.watermarks.seen(record)
                return
            output = self.codec.output(tokens.start.endpoint, tokens.start.body, _response_id(tokens.start, job_id))
            job = self.jobs[job_id] = _Job(output)
            events = output.start(tokens.start.prompt_tokens, tokens.start.cached_tokens)
        elif envelope.seq < job.next_tokens_seq:
            self.watermarks.seen(record)  # a replayed message: already shown
            return
        else:
            events = []
        job.next_tokens_seq = envelope.seq + 1
        events += job.output.tokens(tokens.token_ids)
        self.watermarks.hold(record, job_id)
        if tokens.finished or job.output.complete:
            events += job.output.finish(tokens.finish_reason or "stop")
            self._emit(job_id, pending.pop(job_id, []) + events, done=True)
        else:
            pending.setdefault(job_id, []).extend(events)

    def _emit(self, job_id: str, events: list[Event], done: bool) -> None:
        job = self.jobs[job_id]
        result = ResultPayload(
            events=[StreamEvent(name=e.name, data=e.data) for e in events],
            done=done,
            body=job.output.body() if done else None,
            done_data=job.output.done_data if done else None,
        )
        self._result(job_id, job.next_result_seq, result)
        job.next_result_seq += 1
        if done:
            del self.jobs[job_id]
            self.watermarks.release(job_id)

    def _result(self, job_id: str, seq: int, result: ResultPayload) -> None:
        message = Envelope(type="result", job_id=job_id, seq=seq, payload=result.model_dump())
        self.bus.produce(self.topic(Topic.RESULTS), job_id, message.encode())


def _response_id(start, job_id: str) -> str:
    prefix = {"chat.completions": "chatcmpl", "responses": "resp", "messages": "msg"}[start.endpoint]
    return f"{prefix}-{job_id}"
