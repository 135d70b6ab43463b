"""The prefill service: computes each prompt's state, samples the first token, hands the state over.

A prompt starts from the longest stored prefix of it (unless loading that would take longer
than computing it). Its state is stored at the anchors a later prompt may start from: the end
of the prompt (which is also the hand-over to decode, pinned by a lease), every
`anchor_interval` tokens inside it, and the block boundary where it leaves the blocks other
prompts stored (where conversations with a shared start, such as a system prompt, diverge); for
V4.1, also where the prompt's always-computed last tokens begin.

Every cache call (lookup, load, store) runs on a fetch thread, so the engine keeps stepping
the other jobs meanwhile: a job joins the engine once its prefix has arrived, and goes on to
decode once its hand-over is stored (decode must find it under the key it is sent).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from common import metrics
from common.api import error_body
from common.blocks import BLOCK_SIZE
from common.bus import Bus, Record
from common.cache_entries import PrefixMatch, Stored
from common.messages import (
    DecodePayload,
    Envelope,
    ImageRef,
    KVHandle,
    PrefillPayload,
    ResultPayload,
    TokenLogprobs,
    TokensPayload,
    WarmPayload,
    payload_of,
)
from common.moving_average import MovingAverage
from common.replicas import ReplicaTable
from common.retention import Retention
from common.routing import Route, Router
from common.topics import Topic
from common.tracing import Span, SpanKind, context_of, sender_span, start_span, within
from common.worker import EngineWorker
from engine import (
    EngineError,
    ImageRows,
    ImageSpan,
    LLMEngine,
    RequestOutput,
    SamplingParams,
    SnapshotError,
    StateSnapshot,
)
from engine.prefix_connector import PrefixConnector
from engine.prefix_store import PrefixStore


@dataclass
class _Fetched:
    """What a fetch thread found for a job: the stored prefix to start from (None: none loaded)
    and the lookup's answer (where the prompt leaves the blocks stored before it)."""

    snapshot: StateSnapshot | None
    match: PrefixMatch
    images: list[ImageSpan] = field(default_factory=list)  # the prompt's images' rows
    missing_images: int = 0  # images whose rows the cache did not have


@dataclass
class _HandOver:
    """A prefilled job on its way to decode: its state is being stored (out of the engine)."""

    first_token: int
    first_logprobs: TokenLogprobs | None
    prompt_logprobs: list[TokenLogprobs | None] | None
    seed: int
    layout: str
    stored: Future[Stored | None]


@dataclass
class _Job:
    payload: PrefillPayload
    params: SamplingParams
    record: Record
    span: Span  # from the job's arrival to its hand-over
    fetch: Future[_Fetched] | None = None  # until its prefix has been looked up and loaded
    cached_tokens: int = 0  # prompt tokens loaded from a stored prefix instead of computed
    resident_tokens: int = 0  # of its prompt, held in the engine's own memory when it came (tier 0)
    hand_over: _HandOver | None = None  # once prefilled, until decode has been sent it


@dataclass
class _Warming:
    """A finished conversation's state being loaded to be held (WarmPayload)."""

    tenant: str
    load: Future[StateSnapshot | None]
    loaded_at: float = 0.0  # time.monotonic() when the load ended (0: not yet)

    def ended(self, _: Future[StateSnapshot | None]) -> None:
        self.loaded_at = time.monotonic()


log = logging.getLogger(__name__)
WARM_BACKLOG = 4
# a loaded state waits at most this long to be held while jobs are on their way to a first token
WARM_WAIT_SECONDS = 0.5


class PrefillWorker(EngineWorker[_Job, PrefillPayload]):
    topics = (Topic.PREFILL,)
    group = "prefill"
    job_type = "prefill"
    payload_type = PrefillPayload
    other_types = ("warm",)

    def __init__(
        self,
        bus: Bus,
        topic_prefix: str,
        engine: LLMEngine,
        store: PrefixStore,
        lease_seconds: float = 600,
        retention: Retention | None = None,
        anchor_interval: int = 1024,
        fetch_threads: int = 2,
        replicas: ReplicaTable | None = None,
    ):
        """`replicas`: the load reports this worker routes decode jobs by (None: by job id)."""
        super().__init__(bus, topic_prefix, fetch_threads, replicas)
        self.decode_router = Router(replicas, "decode") if replicas is not None else None
        self.engine: LLMEngine = engine
        self.cache = PrefixConnector(store, engine.layout, retention)
        self.image_rows = ImageRows(store, engine.weights, retention)
        self.lease_seconds = lease_seconds
        metrics.export_compile_progress(metrics.PREFILL_GRAPHS, self.group, lambda: engine.compile_progress("prefill"))
        self.anchor_interval = anchor_interval  # tokens; a multiple of the block size
        # warm loads (finished conversations to hold, WarmPayload) run on a thread of their own,
        # never ahead of a job's own prefix load, and at most WARM_BACKLOG wait: each one is only
        # a saving for a later turn
        self.warmer = ThreadPoolExecutor(1, thread_name_prefix="prefill-warm")
        self.warming: list[_Warming] = []
        self.compute_speed = MovingAverage(0.1)  # prefill tokens per second, against which a load is weighed
        self.load_speed = MovingAverage(0.1)  # tokens per second of prefix loads from the cache service

    @property
    def busy(self) -> bool:
        return bool(self.jobs or self.warming)

    def arrived(self, record: Record, envelope: Envelope, payload: PrefillPayload) -> _Job:
        sampling = payload.sampling
        params = SamplingParams(
            **sampling.engine_params(payload.tenant, payload.priority, sampling.seed),
            keep_final_state=True,  # a job done at its first token still leaves its prompt's state
        )
        prompt_tokens = len(payload.prompt_token_ids)
        span = start_span(
            "prefill",
            envelope.job_id,
            context_of(record.headers),
            SpanKind.CONSUMER,
            **{"deepmesh.prompt_tokens": prompt_tokens, "deepmesh.replica": self.replica},
        )
        job = _Job(payload, params, record, span)
        job.resident_tokens = self.engine.resident_tokens(payload.tenant, payload.prompt_token_ids)
        return job

    def other_message(self, record: Record, envelope: Envelope) -> None:
        """A warm message: a finished conversation's state to hold (`_warm`)."""
        self._warm(envelope.job_id, payload_of(envelope, WarmPayload), record.headers)

    def _warm(self, job_id: str, warm: WarmPayload, headers: dict[str, bytes]) -> None:
        """Load a finished conversation's state on a fetch thread (in its job's trace), to hold it
        in the engine's own memory (`_keep_warmed`) unless it holds it already."""
        if len(self.warming) >= WARM_BACKLOG:
            return
        held = self.engine.resident_tokens(warm.tenant, warm.token_ids)

        def load() -> StateSnapshot | None:
            with within(sender_span(headers), job_id):
                snapshot, _ = self.cache.fetch_prefix(job_id, warm.tenant, warm.retention, warm.token_ids, held=held)
            return snapshot

        warming = _Warming(warm.tenant, self.warmer.submit(load))
        warming.load.add_done_callback(warming.ended)
        self.warming.append(warming)

    def _keep_warmed(self) -> None:
        """Hold the states loaded for finished conversations. Holding one is engine work (milliseconds
        of copies): while a job here is on its way to its first token, or a worker beside this one on
        the engine's thread holds one (`hold`), it waits, at most WARM_WAIT_SECONDS."""
        waiting = any(job.hand_over is None for job in self.jobs.values()) or (self.hold is not None and self.hold())
        stale = time.monotonic() - WARM_WAIT_SECONDS
        for warming in [w for w in self.warming if w.loaded_at and (not waiting or w.loaded_at < stale)]:
            self.warming.remove(warming)
            try:
                snapshot = warming.load.result()
                if snapshot is not None:
                    self.engine.keep_resident(warming.tenant, snapshot)
            except Exception:  # a state not held is a load later, nothing more
                log.exception("holding a finished conversation's state failed")

    def drop(self, job_id: str) -> bool:
        job = self.jobs.get(job_id)
        if job is not None and job.hand_over is not None:  # its state, once stored, is nobody's to load
            job.hand_over.stored.add_done_callback(lambda done: self._release(job_id, done))
        return super().drop(job_id)

    def _release(self, job_id: str, stored: Future[Stored | None]) -> None:
        if not stored.cancelled() and stored.exception() is None and (entry := stored.result()) is not None:
            self.cache.release(job_id, entry.key)

    def _fetch(self, job_id: str, job: _Job) -> _Fetched:
        """On a fetch thread: the longest stored prefix of the job's prompt (its tenant's), loaded
        if it is worth loading: longer than what the engine holds itself, and quicker to load
        than to compute. No engine work here: the engine has one thread."""
        prompt, payload = job.payload.prompt_token_ids, job.payload
        started = time.perf_counter()
        with within(job.span, job_id):
            held = job.resident_tokens
            snapshot, match = self.cache.fetch_prefix(
                job_id,
                payload.tenant,
                payload.retention,
                prompt,
                lambda m: self._too_slow_to_load(m, held),
                held,
                self.engine.reusable_prefix(len(prompt)),
            )
        if snapshot is not None:  # what routers weigh a load from the cache service by
            self.load_speed.observe(snapshot.num_computed / max(time.perf_counter() - started, 1e-6))
        with within(job.span, job_id):
            images = [self._image(payload, ref) for ref in payload.images]
        found = [image for image in images if image is not None]
        return _Fetched(snapshot, match, found, len(images) - len(found))

    def _image(self, payload: PrefillPayload, ref: ImageRef) -> ImageSpan | None:
        """An image's rows from the cache (the encoder stored them), or None."""
        rows = self.image_rows.load(payload.tenant, payload.retention, ref.digest, ref.num_tokens)
        return ImageSpan(ref.start, rows) if rows is not None else None

    def _admit(self, job_id: str, job: _Job) -> None:
        """Start a job whose fetch is done: from its prefix if it has one, else from scratch."""
        assert job.fetch is not None
        try:
            fetched = job.fetch.result()
        except Exception:  # a cache that fails is a miss, never a failed job
            log.exception("prefix lookup for %s failed", job_id)
            fetched = _Fetched(None, PrefixMatch())
        job.fetch = None
        prompt = job.payload.prompt_token_ids
        if fetched.missing_images:  # evicted since the encoder stored them, or never stored
            with within(job.span, job_id, end=True):
                reason = f"{fetched.missing_images} of the request's images are not in the KV cache; send it again"
                self._fail(job_id, reason, job.span, status=503)
                self.end_here(job_id)
            del self.jobs[job_id]
            self.watermarks.release(job_id)
            return
        try:
            with within(job.span, job_id):
                job.cached_tokens, source = self._start(job_id, prompt, job.params, fetched, job.payload.anchors)
        except EngineError as err:
            with within(job.span, job_id, end=True):
                self._fail(job_id, str(err), job.span)
                self.end_here(job_id)
            del self.jobs[job_id]
            self.watermarks.release(job_id)
            return
        job.span.set_attribute("deepmesh.cached_tokens", job.cached_tokens)
        job.span.set_attribute("deepmesh.prefix_source", source)
        metrics.PROMPT_TOKENS.labels(self.group).inc(len(prompt))
        metrics.PREFIX_TOKENS.labels(source).inc(job.cached_tokens)
        metrics.PREFIX_TOKENS.labels("miss").inc(len(prompt) - job.cached_tokens)

    def _start(
        self, job_id: str, prompt: list[int], params: SamplingParams, fetched: _Fetched, requested: list[int]
    ) -> tuple[int, str]:
        """Add a job to the engine, from the longest prefix of its prompt at hand: loaded from the
        cache service, or held in the engine's own memory. Returns how many prompt tokens that
        saved (0: a full prefill) and where they came from (hit, resident, or miss). `requested`:
        more positions to store the prompt's state at (where the next turn leaves it)."""
        reusable = self.engine.reusable_prefix(len(prompt))
        anchors = anchor_positions(len(prompt), fetched.match.shared_tokens, self.anchor_interval, reusable)
        anchors = sorted({*anchors, *(p for p in requested if 0 < p < len(prompt))})
        images = fetched.images
        if fetched.snapshot is not None:
            try:
                if self.engine.import_prefix(job_id, fetched.snapshot, prompt, params, anchors, images):
                    return fetched.snapshot.num_computed, "hit"
            except SnapshotError as err:  # unusable: a miss, computed from scratch
                log.warning("stored prefix unusable: %s", err)
                metrics.CACHE_MISSES.labels("corrupt").inc()
            if self.engine.has_request(job_id):  # queued for a full prefill: no room to load it now
                return 0, "miss"
        if cached := self.engine.import_resident(job_id, prompt, params, anchors, images):
            return cached, "resident"
        self.engine.add_request(job_id, prompt, params, anchors, images)
        return 0, "miss"

    def _too_slow_to_load(self, match: PrefixMatch, held: int = 0) -> bool:
        """Load or recompute: skip a prefix whose load would take longer than computing the tokens
        it adds to the `held` ones the engine has in its own memory, at the speed this worker
        measured (unmeasured yet: load)."""
        if self.compute_speed.value <= 0:
            return False
        return match.load_seconds > (match.num_tokens - held) / self.compute_speed.value

    @property
    def urgent(self) -> bool:
        """An interactive job is here: every job here is on its way to its first token."""
        return any(job.payload.priority == "interactive" for job in self.jobs.values())

    def idle(self) -> None:
        self._keep_warmed()
        if not self.jobs:
            return
        self.admit_fetched()
        self._send_stored()
        if not self.engine.has_unfinished_requests():
            return
        started = time.perf_counter()
        outputs = self.step_engine()
        elapsed = time.perf_counter() - started
        metrics.ENGINE_STEP_SECONDS.labels(self.group).observe(elapsed)
        if self.engine.last_step_tokens > 1 and elapsed > 0:
            self.compute_speed.observe(self.engine.last_step_tokens / elapsed)
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None:
                continue
            if out.prefix_state is not None:  # an anchor inside the prompt
                self._store_prefix(out.request_id, job, out.prefix_state)
            if not out.new_token_ids:
                continue
            metrics.GENERATED_TOKENS.labels(self.group).inc()
            self._prefilled(out, job)
        metrics.RUNNING_JOBS.labels(self.group).set(len(self.jobs))

    def _prefilled(self, out: RequestOutput, job: _Job) -> None:
        """A job has its first token: it goes out now. Done at it, the job ends here; else its
        state is stored for decode (the job goes on once it is stored: `_send_stored`), and the
        hand-over (the copy out of the engine, the store, the bus, decode's load) overlaps with
        the first token instead of standing before it: decode sends the tokens after it."""
        job_id, first, prompt = out.request_id, out.new_token_ids[0], job.payload.prompt_token_ids
        # The prompt's logprobs go with the first token and take one more pass over the prompt,
        # for which the job's own state must have left the engine first. Otherwise the first token
        # waits for no copy (~1 ms of the engine thread on the tiny preset).
        leaving = None
        if not out.finished and job.payload.sampling.prompt_logprobs is not None:
            leaving = self._leave_engine(job_id, job)
        logprobs = out.token_logprobs()
        tokens = TokensPayload(
            prompt_tokens=len(prompt),
            cached_tokens=job.cached_tokens,
            token_ids=[first],
            logprobs=logprobs,
            prompt_logprobs=self._prompt_logprobs(job),
            finished=out.finished,
            finish_reason=out.finish_reason,
        )
        with within(job.span, job_id, end=out.finished):
            self.hop(Topic.TOKENS, Envelope(type="tokens", job_id=job_id, payload=tokens.model_dump()), job.span)
        if out.finished:
            if out.final_state is not None:
                self._store_prefix(job_id, job, out.final_state)
            self._done(job_id)
            return
        seed, layout, stored = leaving or self._leave_engine(job_id, job)
        first_logprobs = logprobs[0] if logprobs else None
        job.hand_over = _HandOver(first, first_logprobs, tokens.prompt_logprobs, seed, layout, stored)

    def _leave_engine(self, job_id: str, job: _Job) -> tuple[int, str, Future[Stored | None]]:
        """Take a prefilled job's state out of the engine and store it for decode: its sampling
        seed, its state's layout and the store under way."""
        snapshot = self.engine.export_state(job_id)
        seed = self.engine.request_seed(job_id)
        self.engine.abort(job_id)  # its state is in the snapshot: the engine's room is free now
        # The prompt's anchor is also the hand-over: leased to this job until decode has loaded it.
        return seed, snapshot.layout, self._store_prefix(job_id, job, snapshot, lease=True)

    def _prompt_logprobs(self, job: _Job) -> list[TokenLogprobs | None] | None:
        """The prompt tokens' logprobs, when the job asks: one more pass over the whole prompt
        (cached or not), run once the job's own state has left the engine, which leaves room for it."""
        top = job.payload.sampling.prompt_logprobs
        return None if top is None else self.engine.prompt_logprobs(job.payload.prompt_token_ids, top)

    def _send_stored(self) -> None:
        """Send every job whose hand-over is stored (or failed to be: decode then recomputes it)
        on to decode; with nothing else for the engine to do, wait a moment for one first."""
        storing = [job.hand_over.stored for job in self.jobs.values() if job.hand_over is not None]
        if storing and not self.engine.has_unfinished_requests():
            wait(storing, timeout=0.005, return_when=FIRST_COMPLETED)
        for job_id, job in list(self.jobs.items()):
            if job.hand_over is not None and job.hand_over.stored.done():
                with within(job.span, job_id, end=True):
                    self._send_decode(job_id, job, job.hand_over)
                self._done(job_id)

    def _send_decode(self, job_id: str, job: _Job, hand_over: _HandOver) -> None:
        try:
            stored = hand_over.stored.result()
        except Exception:  # the connector answers failures with None; anything else is a miss too
            log.exception("storing the hand-over of %s failed", job_id)
            stored = None
        kv = None
        if stored is not None:
            kv = KVHandle(
                key=stored.key,
                size=stored.size,
                checksum=stored.checksum,
                layout=hand_over.layout,
                num_tokens=stored.num_tokens,
                lease_expires_at=time.time() + self.lease_seconds,
            )
        handoff = DecodePayload(
            endpoint=job.payload.endpoint,
            prompt_token_ids=job.payload.prompt_token_ids,
            first_token=hand_over.first_token,
            first_logprobs=hand_over.first_logprobs,
            prompt_logprobs=hand_over.prompt_logprobs,
            seed=hand_over.seed,
            sampling=job.payload.sampling,
            kv=kv,
            cached_tokens=job.cached_tokens,
            tenant=job.payload.tenant,
            retention=job.payload.retention,
            priority=job.payload.priority,
            prefilled_by=self.replica,
            images=job.payload.images,
            first_sent=True,
        )
        envelope = Envelope(type="decode", job_id=job_id, payload=handoff.model_dump())
        if self.decode_router is None:
            self.hop(Topic.DECODE, envelope, job.span)
            return
        route = self.decode_router.decode(job_id, len(handoff.prompt_token_ids) + handoff.sampling.max_tokens)
        self.dispatch(Topic.DECODE, envelope, job.span, self.decode_router, route)

    def route_again(self, router: Router, job_id: str, payload: PrefillPayload) -> Route:
        return router.prefill(job_id, payload.tenant, payload.prompt_token_ids, rerouted=True)

    def queued_tokens(self) -> int:
        waiting = 0
        for job_id, job in self.jobs.items():
            left = self.engine.prompt_tokens_left(job_id)
            if left is not None:
                waiting += left
            elif job.hand_over is None:  # its prefix is being looked up and loaded
                waiting += len(job.payload.prompt_token_ids) - job.resident_tokens
        return waiting

    def speeds(self) -> dict[str, float]:
        return {"tokens_per_second": self.compute_speed.value, "load_tokens_per_second": self.load_speed.value}

    def _done(self, job_id: str) -> None:
        """The job has left this stage: its record may be committed."""
        del self.jobs[job_id]
        self.watermarks.release(job_id)

    def _store_prefix(
        self, job_id: str, job: _Job, snapshot: StateSnapshot, lease: bool = False
    ) -> Future[Stored | None]:
        """Store a state of the prompt where a longer prompt that starts with it can resume; with
        `lease`, pinned for this job's decode (its hand-over)."""
        payload, lease_seconds = job.payload, self.lease_seconds if lease else 0
        return self.save_later(
            job_id, job.span, payload.tenant, payload.retention, snapshot, lease_seconds, payload.priority
        )

    def _fail(self, job_id: str, reason: str, span: Span, status: int = 400) -> None:
        result = ResultPayload(done=True, status=status, body=error_body(self.jobs[job_id].payload.endpoint, reason))
        self.hop(Topic.RESULTS, Envelope(type="result", job_id=job_id, payload=result.model_dump()), span)


def anchor_positions(prompt_len: int, shared_tokens: int, interval: int, reusable: int | None = None) -> list[int]:
    """Where inside a prompt to store its state: every `interval` tokens, and the end of the
    blocks it shares with prompts stored before it (the engine skips those inside the prefix
    it starts from). For a model that always computes a prompt's last tokens itself (V4.1's
    bounded replay: only the first `reusable` tokens of a prompt may come from stored state),
    also that point, where a repeat of this prompt or its next turn starts from, once it is a
    block in: each anchor splits the prompt's computation, a step more for a shorter saving."""
    positions = set(range(interval, prompt_len, interval)) if interval > 0 else set()
    positions.add(shared_tokens)
    if reusable is not None and BLOCK_SIZE <= reusable < prompt_len:
        positions.add(reusable)
    return sorted(p for p in positions if 0 < p < prompt_len)
