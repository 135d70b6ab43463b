"""Putting a job on the mesh and calling it off: what the HTTP handlers and the batch runner both do."""

from __future__ import annotations

from typing import Any

from common.bus import Bus, produce_everywhere
from common.messages import Envelope, RequestPayload
from common.topics import Topic, topic_name
from common.tracing import Span, SpanKind, headers_of, job_span


class Dispatcher:
    def __init__(self, bus: Bus, topic_prefix: str):
        self.bus = bus
        self.requests_topic = topic_name(Topic.REQUESTS, topic_prefix)
        self.stage_topics = [topic_name(t, topic_prefix) for t in (Topic.ENCODE, Topic.PREFILL, Topic.DECODE)]

    def send(self, job_id: str, endpoint: str, body: dict[str, Any], options: dict[str, Any], parent=None) -> None:
        """Produce the request to `requests` (blocking); raises what the bus raises when the broker
        does not take it. `options`: RequestPayload's tenant, retention and priority."""
        self.produce(job_id, self.request(job_id, endpoint, body, options), parent)

    @staticmethod
    def request(job_id: str, endpoint: str, body: dict[str, Any], options: dict[str, Any]) -> bytes:
        """The request's record."""
        payload = RequestPayload(endpoint=endpoint, body=body, **options).model_dump()
        return Envelope(type="request", job_id=job_id, payload=payload).encode()

    def produce(self, job_id: str, request: bytes, parent=None) -> None:
        """Produce an encoded request (`request`) to `requests` (blocking where the bus waits)."""
        with job_span("send requests", job_id, parent, SpanKind.PRODUCER) as span:
            self.bus.produce(self.requests_topic, job_id, request, headers_of(span))

    def cancel(self, job_id: str, parent: Span | None = None) -> None:
        """Tell the encoder, prefill and decode to drop a job and free its state, wherever it is: queued (a
        cancel that comes first is remembered), prefilling or decoding. Blocking."""
        cancel = Envelope(type="cancel", job_id=job_id).encode()
        with job_span("cancel job", job_id, parent) as span:
            headers = headers_of(span)
            for topic in self.stage_topics:  # every replica: a router chose one
                produce_everywhere(self.bus, topic, job_id, cancel, headers)
