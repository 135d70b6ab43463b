"""The tokenizer service: `requests` -> `prefill` on the way in, `tokens` -> `results` on the way out.

On the way in, a request becomes two records: its start (endpoint and API body) on `tokens`,
then its token ids on `prefill`. Prefill and decode never see the body; the output side finds
the start ahead of the job's tokens in their partition (both are keyed by the job id) and
holds it, uncommitted, until the job ends there: finished, or a `cancel` from the stage where
it ended without finishing.
"""

from __future__ import annotations

import base64
import json
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from pydantic import ValidationError

from common.api import DEFAULT_RETENTION, error_body, response_id, server_error_kind, usage_counts
from common.bus import Bus, Record
from common.job_streams import StreamCursor
from common.messages import (
    BadMessage,
    EncodePayload,
    Envelope,
    ImageBytes,
    ImageRef,
    JobStart,
    PrefillPayload,
    RequestPayload,
    ResultPayload,
    Sampling,
    StreamEvent,
    TokensPayload,
    Usage,
    decode,
    payload_of,
)
from common.replicas import ReplicaTable
from common.routing import Router
from common.topics import Topic
from common.tracing import Span, SpanKind, context_of, headers_of, job_span, start_span, within
from common.worker import EarlyCancels, OnTheirWay, Worker
from tokenizer_svc.completions import CompletionStream
from tokenizer_svc.conversion import Prompt
from tokenizer_svc.images import image_parts
from tokenizer_svc.protocol import Codec, Event, OutputStream, ProtocolError


@dataclass
class _Job:
    output: OutputStream | CompletionStream
    span: Span  # the job's output conversion, from its start to its last tokens
    headers: dict[str, bytes] = field(default_factory=dict)  # the span's context, on every results message
    tokens: StreamCursor[TokensPayload] = field(default_factory=StreamCursor)  # the token ids taken so far
    events_sent: int = 0  # events in the results messages so far: the next one's seq
    started: bool = False  # the response's opening events are out (with the prompt's token counts)
    tenant: str = "default"
    priority: str = "interactive"
    # a batch job's events so far: nobody reads its answer before it ends, so it goes out as one
    # results message (not one per poll for the job recorder to store, beside interactive work)
    held: list[Event] = field(default_factory=list)


@dataclass
class _Resolving:
    """A request whose images are being fetched and resized, off the worker's thread."""

    envelope: Envelope
    request: RequestPayload
    span: Span
    prompt: Future[Prompt | ProtocolError]


RESOLVE_THREADS = 4  # requests with images prepared at once
# While requests wait for their images, how long the worker waits for one to be ready before it
# polls again: a worker that is busy only waiting polls without waiting (the in-process bus) or
# for 2 ms (Kafka), and would otherwise spin through an image's whole download
RESOLVE_WAIT_SECONDS = 0.005


class TokenizerWorker(Worker):
    topics = (Topic.REQUESTS, Topic.TOKENS)
    group = "tokenizer"

    def __init__(self, bus: Bus, topic_prefix: str, codec: Codec, replicas: ReplicaTable | None = None):
        """`replicas`: the load reports this worker routes prefill jobs by (None: by job id)."""
        super().__init__(bus, topic_prefix)
        self.codec = codec
        self.prefill_router = Router(replicas, "prefill") if replicas is not None else None
        self.encoder_router = Router(replicas, "encoder") if replicas is not None else None
        self.jobs: dict[str, _Job] = {}
        self.resolving: dict[str, _Resolving] = {}  # requests with images, until their prompt is ready
        self.resolver = ThreadPoolExecutor(RESOLVE_THREADS, thread_name_prefix="tokenizer-images")
        self.cancelled = EarlyCancels()  # jobs that ended before their start came
        # interactive jobs sent to prefill whose first tokens have not come back: while there are
        # any, engines in this process step no batch work (common/worker.run_workers)
        self.on_their_way = OnTheirWay()

    @property
    def urgent(self) -> bool:
        return bool(self.on_their_way)

    def handle(self, records: list[Record]) -> None:
        # a job's tokens messages from one poll become one results message: when the worker
        # falls behind, it catches up in fewer, larger messages instead of falling further behind
        pending: dict[str, list[Event]] = {}
        finished: dict[str, list[Event]] = {}
        failed: dict[str, ResultPayload] = {}
        requests = self.topic(Topic.REQUESTS)
        # new prompts first: a prompt waits for no answer's conversion (a job's tokens always come
        # after its request, and each topic keeps its order)
        for record in sorted(records, key=lambda r: r.topic != requests):
            try:
                if record.topic == requests:
                    self._on_request(record)
                else:
                    self._on_tokens(record, pending, finished)
            except BadMessage as err:
                self.dead_letter(record, err)
            except OutputFailed as failure:  # this job's answer ends in an error; the poll goes on
                self.on_their_way.discard(failure.job_id)
                pending.pop(failure.job_id, None)
                failed[failure.job_id] = failure.result
                finished[failure.job_id] = []  # ended: its later records in this poll are skipped
        results = []
        for job_id, events in pending.items():
            job = self.jobs.get(job_id)
            if job is not None and job.priority == "batch":
                job.held += events
            elif events:
                results.append(self._result(job_id, events, done=False))
        results += [
            self._result(job_id, events, done=True) for job_id, events in finished.items() if job_id not in failed
        ]
        results += [self._error(job_id, result) for job_id, result in failed.items()]
        self.send_batch(Topic.RESULTS, results)
        for job_id in finished:  # only now that its last results are stored may its records be committed
            job = self.jobs.pop(job_id, None)
            if job is not None:
                job.span.set_attribute("deepmesh.events", job.events_sent)
                job.span.end()
            self.watermarks.release(job_id)

    def drop(self, job_id: str) -> bool:
        self.on_their_way.discard(job_id)
        if (resolving := self.resolving.pop(job_id, None)) is not None:  # its prompt is dropped when ready
            resolving.span.end()
        job = self.jobs.pop(job_id, None)
        if job is not None:
            job.span.end()
        return job is not None

    def _on_request(self, record: Record) -> None:
        envelope = decode(record.value, "request")
        request = payload_of(envelope, RequestPayload)
        if self.codec.images is not None and image_parts(request.body):
            # fetching and resizing images takes a while (a URL up to its time limit): on a thread,
            # the record held until the prompt is ready, so that no other request waits for it
            span = start_span("tokenizer.prompt", envelope.job_id, context_of(record.headers), SpanKind.CONSUMER)
            prompted = self.resolver.submit(self._prompted, request)
            self.resolving[envelope.job_id] = _Resolving(envelope, request, span, prompted)
            self.watermarks.hold(record, envelope.job_id)
            return
        with job_span("tokenizer.prompt", envelope.job_id, context_of(record.headers), SpanKind.CONSUMER) as span:
            self._prompt(envelope, request, span, self._prompted(request))
        self.watermarks.seen(record)

    def idle(self) -> None:
        """Send on the requests whose images are resolved, waiting a moment for one first."""
        if self.resolving:
            wait([r.prompt for r in self.resolving.values()], RESOLVE_WAIT_SECONDS, FIRST_COMPLETED)
        for job_id, resolving in [(j, r) for j, r in self.resolving.items() if r.prompt.done()]:
            del self.resolving[job_id]
            with within(resolving.span, job_id, end=True):
                self._prompt(resolving.envelope, resolving.request, resolving.span, resolving.prompt.result())
            self.watermarks.release(job_id)

    @property
    def busy(self) -> bool:
        return bool(self.resolving)

    def _prompted(self, request: RequestPayload) -> Prompt | ProtocolError:
        try:
            return self.codec.prompt(request.endpoint, request.body)
        except ProtocolError as err:
            return err

    def _prompt(self, envelope: Envelope, request: RequestPayload, span: Span, prompt: Prompt | ProtocolError) -> None:
        """Send the request on to prefill, or its error to results: a request can only fail itself."""
        try:
            if isinstance(prompt, ProtocolError):
                raise prompt
            prefill = PrefillPayload(
                endpoint=request.endpoint,
                prompt_token_ids=prompt.token_ids,
                sampling=Sampling(
                    max_tokens=prompt.max_tokens,
                    temperature=prompt.temperature,
                    top_p=prompt.top_p,
                    seed=prompt.seed,
                    grammar=prompt.grammar,
                    logprobs=prompt.logprobs,
                    prompt_logprobs=prompt.prompt_logprobs,
                    ignore_eos=prompt.ignore_eos,
                    min_tokens=prompt.min_tokens,
                    stop_token_ids=prompt.stop_token_ids,
                    top_k=prompt.top_k,
                ),
                tenant=request.tenant,
                retention=request.retention or DEFAULT_RETENTION[request.endpoint],
                priority=request.priority,
                images=[
                    ImageRef(digest=p.image.digest, start=p.start, num_tokens=p.image.num_tokens) for p in prompt.images
                ],
                anchors=prompt.anchors,
            )
        except ProtocolError as err:
            self._refuse(envelope.job_id, err.status_code, json.loads(err.body), span)
            return
        except ValidationError as err:  # a sampling value the protocol let through but no engine takes
            self._refuse(envelope.job_id, 400, error_body(request.endpoint, str(err)), span)
            return
        span.set_attribute("deepmesh.prompt_tokens", len(prompt.token_ids))
        for name, value in prompt.traced.items():  # the client's names for the request (user, metadata, ...)
            span.set_attribute(f"deepmesh.request.{name}", value)
        if request.count_only:  # the whole answer: nothing runs for it
            counted = ResultPayload(done=True, status=200, body={"input_tokens": len(prompt.token_ids)})
            self.hop(Topic.RESULTS, Envelope(type="result", job_id=envelope.job_id, payload=counted.model_dump()), span)
            return
        start = JobStart(endpoint=request.endpoint, body=request.body, tenant=request.tenant, priority=request.priority)
        # first the start, then the job: its tokens, which come after the prefill, find it there
        self.hop(Topic.TOKENS, Envelope(type="start", job_id=envelope.job_id, payload=start.model_dump()), span)
        if request.priority == "interactive":
            self.on_their_way.add(envelope.job_id)
        if prompt.images:  # through the image encoder first
            self._encode(envelope.job_id, prefill, prompt, span)
            return
        message = Envelope(type="prefill", job_id=envelope.job_id, payload=prefill.model_dump())
        if self.prefill_router is None:
            self.hop(Topic.PREFILL, message, span)
            return
        route = self.prefill_router.prefill(envelope.job_id, prefill.tenant, prefill.prompt_token_ids)
        self.dispatch(Topic.PREFILL, message, span, self.prefill_router, route)

    def _encode(self, job_id: str, prefill: PrefillPayload, prompt: Prompt, span: Span) -> None:
        """A prompt with images goes to the image encoder, with the images' bytes (each once)."""
        images = {p.image.digest: p.image.data for p in prompt.images}
        payload = EncodePayload(
            prefill=prefill,
            images=[ImageBytes(digest=d, data=base64.b64encode(data).decode()) for d, data in images.items()],
        )
        message = Envelope(type="encode", job_id=job_id, payload=payload.model_dump())
        if self.encoder_router is None:
            self.hop(Topic.ENCODE, message, span)
            return
        self.dispatch(
            Topic.ENCODE, message, span, self.encoder_router, self.encoder_router.encoder(job_id, len(images))
        )

    def _refuse(self, job_id: str, status: int, body: dict, span: Span) -> None:
        """A request that cannot be run: its error is its whole answer."""
        span.set_attribute("deepmesh.error_status", status)
        error = ResultPayload(done=True, status=status, body=body)
        self.hop(Topic.RESULTS, Envelope(type="result", job_id=job_id, payload=error.model_dump()), span)

    def _on_tokens(self, record: Record, pending: dict[str, list[Event]], finished: dict[str, list[Event]]) -> None:
        envelope = decode(record.value)
        job_id = envelope.job_id
        if envelope.type == "start":
            self._on_start(record, envelope, finished)
            return
        if envelope.type == "cancel":  # the job ended upstream, unfinished: nothing more will come
            self.watermarks.seen(record)
            if job_id in finished:  # its end is being sent already
                return
            if self.drop(job_id):
                pending.pop(job_id, None)
                self.watermarks.release(job_id)
            else:
                self.cancelled.add(job_id)
            return
        if envelope.type != "tokens":
            raise BadMessage(f"envelope type {envelope.type!r} does not belong on the tokens topic")
        tokens = payload_of(envelope, TokensPayload)
        job = None if job_id in finished else self.jobs.get(job_id)  # ended earlier in this poll: nothing to add
        if job is None:  # the job ended here already: this is a replay
            self.watermarks.seen(record)
            return
        events: list[Event] = []
        self.watermarks.hold(record, job_id)
        try:
            # a replay repeats tokens (skipped) and a message past a gap waits for the ones before it
            for message, taken in job.tokens.take(envelope.seq, len(tokens.token_ids), tokens):
                if not job.started:  # the stream's first message: prefill's, with the prompt's counts
                    events += job.output.start(
                        message.prompt_tokens or 0, message.cached_tokens, message.prompt_logprobs
                    )
                    job.started = True
                if message.token_ids or message.finished:  # its first token is here
                    self.on_their_way.discard(job_id)
                logprobs = message.logprobs[taken:] if message.logprobs is not None else None
                events += job.output.tokens(message.token_ids[taken:], logprobs)
                if message.finished or job.output.complete:
                    if not message.finished:  # a stop sequence ended the answer: decoding the rest is waste
                        self.cancel_everywhere(Topic.DECODE, job_id, job.headers)
                    events += job.output.finish(message.finish_reason or "stop")
                    finished[job_id] = job.held + pending.pop(job_id, []) + events
                    return
        except Exception as err:  # the recipe could not convert this output: it ends this job alone
            self.cancel_everywhere(Topic.DECODE, job_id, job.headers)
            raise OutputFailed(job_id, job.output.endpoint, err) from err
        pending.setdefault(job_id, []).extend(events)

    def _on_start(self, record: Record, envelope: Envelope, finished: dict[str, list[Event]]) -> None:
        """A job's start: what its response is built from, held until the job ends."""
        job_id = envelope.job_id
        if job_id in self.jobs:  # sent again (the request was replayed): held with the first
            self.watermarks.hold(record, job_id)
            return
        start = payload_of(envelope, JobStart)
        if job_id in finished or self.cancelled.take(job_id):  # it ended already
            self.watermarks.seen(record)
            return
        span = start_span("tokenizer.output", job_id, context_of(record.headers), SpanKind.CONSUMER)
        try:
            output = self.codec.output(start.endpoint, start.body, response_id(start.endpoint, job_id))
        except Exception as err:  # its answer cannot be built: it ends now, and nothing runs for it
            span.end()
            self.watermarks.seen(record)
            for topic in (Topic.ENCODE, Topic.PREFILL, Topic.DECODE):
                self.cancel_everywhere(topic, job_id)
            raise OutputFailed(job_id, start.endpoint, err) from err
        self.jobs[job_id] = _Job(output, span, headers_of(span), tenant=start.tenant, priority=start.priority)
        self.watermarks.hold(record, job_id)

    def _result(self, job_id: str, events: list[Event], done: bool) -> tuple[Envelope, dict[str, bytes]]:
        """The job's next results message, carrying these events: its seq is the index of the first."""
        job = self.jobs[job_id]
        body = job.output.body() if done else None
        result = ResultPayload(
            events=[StreamEvent(name=e.name, data=e.data) for e in events],
            done=done,
            body=body,
            done_data=job.output.done_data if done else None,
            usage=self._usage(job, body) if body is not None else None,
        )
        message = Envelope(type="result", job_id=job_id, seq=job.events_sent, payload=result.model_dump())
        job.events_sent += len(events)
        return message, job.headers

    @staticmethod
    def _usage(job: _Job, body: dict) -> Usage:
        cached, uncached, output = usage_counts(job.output.endpoint, body)
        return Usage(
            tenant=job.tenant,
            model=str(body.get("model", "")),
            priority=job.priority,
            cached_input_tokens=cached,
            uncached_input_tokens=uncached,
            output_tokens=output,
        )

    def _error(self, job_id: str, result: ResultPayload) -> tuple[Envelope, dict[str, bytes]]:
        """The last results message of a job whose output failed: after the events it has sent
        (none, if it failed at its start)."""
        job = self.jobs.get(job_id)
        seq = job.events_sent if job is not None else 0
        message = Envelope(type="result", job_id=job_id, seq=seq, payload=result.model_dump())
        return message, job.headers if job is not None else {}


class OutputFailed(Exception):
    """A job's output could not be converted: the job ends with a server error, alone."""

    def __init__(self, job_id: str, endpoint: str, cause: Exception):
        super().__init__(f"{job_id}: {cause!r}")
        self.job_id = job_id
        body = error_body(endpoint, f"the model's output could not be converted: {cause}", server_error_kind(endpoint))
        self.result = ResultPayload(done=True, status=500, body=body)
