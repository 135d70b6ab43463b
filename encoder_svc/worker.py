"""The image encoder service: `encode` -> `prefill`, for prompts with images (DeepSeek-V4.1).

A job arrives with its tokenized prompt and its images' bytes (deepseek-recipe's WebP, resized
for the model). Each image's rows (engine/model/vision.py) are kept in the KV cache under the
image's content (engine/image_rows.py): on a fetch thread the worker asks the cache which of the
job's images it holds (renewing those it does), encodes the others here, stores them (a fetch
thread again), and then sends the job on to a prefill replica, naming the images by content.
An image seen before is not encoded again; prefill reads rows, never pixels, and nothing large
travels further than this topic.

A job fails here only on bytes that are not the image they claim to be (its digest) or that do
not decode: the tokenizer resolved them, so that is a sender's bug, answered 400 like prefill's
refusals. A cache that fails to store rows costs the job nothing here: prefill then misses
them and answers 503 (the rows are re-encoded on a retry).
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from common import metrics
from common.api import error_body
from common.bus import Bus, Record
from common.messages import BadMessage, EncodePayload, Envelope, ResultPayload, payload_of
from common.moving_average import MovingAverage
from common.replicas import LoadReport, ReplicaTable
from common.retention import Retention
from common.routing import Router
from common.topics import Topic
from common.tracing import Span, SpanKind, context_of, start_span, within
from common.worker import EarlyCancels, ReplicaWorker
from engine import ImageRows, VisionEncoder
from engine.prefix_store import PrefixStore

log = logging.getLogger(__name__)


@dataclass
class _Job:
    payload: EncodePayload
    span: Span
    check: Future[set[str]] | None = None  # the digests whose rows the cache does not hold
    stored: Future[None] | None = None  # once encoded: the new rows being stored
    encoded: list[str] = field(default_factory=list)


class EncoderWorker(ReplicaWorker):
    topics = (Topic.ENCODE,)
    group = "encoder"

    def __init__(
        self,
        bus: Bus,
        topic_prefix: str,
        encoder: VisionEncoder,
        store: PrefixStore,
        weights: str,
        retention: Retention | None = None,
        replicas: ReplicaTable | None = None,
        fetch_threads: int = 2,
    ):
        """`weights`: the checkpoint's (engine.checkpoint.weights_id), whose rows these are.
        `replicas`: the load reports this worker routes prefill jobs by (None: by job id)."""
        super().__init__(bus, topic_prefix)
        self.encoder = encoder
        self.rows = ImageRows(store, weights, retention)
        self.prefill_router = Router(replicas, "prefill") if replicas is not None else None
        self.replicas = replicas
        self.jobs: dict[str, _Job] = {}
        self.cancelled = EarlyCancels()
        self.fetcher = ThreadPoolExecutor(fetch_threads, thread_name_prefix="encoder-fetch")
        self.images_per_second = MovingAverage(0.2)
        self.encoded = self.reused = 0  # images encoded here, and images whose rows the cache held

    @property
    def busy(self) -> bool:
        return bool(self.jobs)

    @property
    def urgent(self) -> bool:
        return any(job.payload.prefill.priority == "interactive" for job in self.jobs.values())

    def handle(self, records: list[Record]) -> None:
        for record in records:
            try:
                envelope = self.job_message(record, "encode")
                if envelope is None:
                    continue
                payload = payload_of(envelope, EncodePayload)
                _check_digests(payload)
            except BadMessage as err:
                self.dead_letter(record, err)
                continue
            job_id = envelope.job_id
            if job_id in self.jobs:  # a replay
                self.watermarks.seen(record)
                continue
            if self.cancelled.take(job_id):
                self.end_here(job_id)
                self.watermarks.seen(record)
                continue
            span = start_span(
                "encode",
                job_id,
                context_of(record.headers),
                SpanKind.CONSUMER,
                **{"deepmesh.images": len(payload.images), "deepmesh.replica": self.replica},
            )
            job = self.jobs[job_id] = _Job(payload, span)
            job.check = self.fetcher.submit(self._missing, job_id, job)
            self.watermarks.hold(record, job_id)

    def _missing(self, job_id: str, job: _Job) -> set[str]:
        """On a fetch thread: the job's images whose rows the cache does not hold (those it holds
        are kept another retention period)."""
        prefill = job.payload.prefill
        with within(job.span, job_id):
            return {
                image.digest
                for image in job.payload.images
                if not self.rows.renew(prefill.tenant, prefill.retention, image.digest)
            }

    def idle(self) -> None:
        for job_id, job in list(self.jobs.items()):
            if job.check is not None and job.check.done():
                self._encode(job_id, job)
            if job_id in self.jobs and job.stored is not None and job.stored.done():
                self._send_prefill(job_id, job)

    def _encode(self, job_id: str, job: _Job) -> None:
        """Encode the images the cache lacks (here: the worker's thread computes), then store them."""
        try:
            missing = job.check.result() if job.check is not None else set()
        except Exception:  # a cache that fails is a miss
            log.exception("checking the cache for %s's images failed", job_id)
            missing = {image.digest for image in job.payload.images}
        job.check = None
        prefill = job.payload.prefill
        spans = {ref.digest: ref.num_tokens for ref in prefill.images}
        encoded: dict[str, torch.Tensor] = {}
        started = time.perf_counter()
        try:
            with within(job.span, job_id):
                for image in job.payload.images:
                    if image.digest in missing:
                        encoded[image.digest] = self._rows(image.data, spans.get(image.digest))
        except ValueError as err:
            with within(job.span, job_id, end=True):
                self._fail(job_id, job, f"an image cannot be encoded: {err}")
            return
        if encoded:
            self.images_per_second.observe(len(encoded) / max(time.perf_counter() - started, 1e-6))
            metrics.IMAGES_ENCODED.inc(len(encoded))
        metrics.IMAGES_CACHED.inc(len(job.payload.images) - len(encoded))
        self.encoded += len(encoded)
        self.reused += len(job.payload.images) - len(encoded)
        job.span.set_attribute("deepmesh.images_encoded", len(encoded))
        job.encoded = list(encoded)

        def store() -> None:
            with within(job.span, job_id):
                for digest, rows in encoded.items():
                    self.rows.save(prefill.tenant, prefill.retention, digest, rows)

        job.stored = self.fetcher.submit(store)

    def _rows(self, data: str, num_tokens: int | None) -> torch.Tensor:
        """An image's rows, from its bytes; ValueError if they are not an image of its span."""
        try:
            with Image.open(io.BytesIO(base64.b64decode(data, validate=True))) as image:
                pixels = torch.from_numpy(_rgb(image)).contiguous()
        except (OSError, ValueError, Image.DecompressionBombError) as err:
            raise ValueError(f"its bytes do not decode ({err})") from err
        rows = self.encoder.span_rows(pixels)
        if num_tokens is None or rows.shape[0] != num_tokens:
            raise ValueError(f"it fills {rows.shape[0]} positions, its span in the prompt has {num_tokens}")
        return rows

    def _send_prefill(self, job_id: str, job: _Job) -> None:
        assert job.stored is not None
        try:
            job.stored.result()
        except Exception:  # not stored: prefill misses them and says so
            log.exception("storing the rows of %s's images failed", job_id)
        prefill = job.payload.prefill
        envelope = Envelope(type="prefill", job_id=job_id, payload=prefill.model_dump())
        with within(job.span, job_id, end=True):
            if self.prefill_router is None:
                self.hop(Topic.PREFILL, envelope, job.span)
            else:
                route = self.prefill_router.prefill(job_id, prefill.tenant, prefill.prompt_token_ids)
                self.dispatch(Topic.PREFILL, envelope, job.span, self.prefill_router, route)
        self._done(job_id)

    def _fail(self, job_id: str, job: _Job, reason: str) -> None:
        result = ResultPayload(done=True, status=400, body=error_body(job.payload.prefill.endpoint, reason))
        self.hop(Topic.RESULTS, Envelope(type="result", job_id=job_id, payload=result.model_dump()), job.span)
        self.end_here(job_id)
        self._done(job_id)

    def end_here(self, job_id: str) -> None:
        """The job ends here without tokens: the output side, holding its start, lets it go."""
        self.send(Topic.TOKENS, Envelope(type="cancel", job_id=job_id))

    def _done(self, job_id: str) -> None:
        del self.jobs[job_id]
        self.watermarks.release(job_id)

    def cancel(self, job_id: str) -> None:
        if not self.drop(job_id):
            self.cancelled.add(job_id)
            return
        self.end_here(job_id)
        self.watermarks.release(job_id)

    def drop(self, job_id: str) -> bool:
        job = self.jobs.pop(job_id, None)
        if job is None:
            return False
        with within(job.span, job_id, end=True):
            job.span.set_attribute("deepmesh.finish", "dropped")
        return True

    def load_report(self) -> LoadReport:
        """What this replica holds: its jobs, and in `queued_tokens` the images they bring."""
        topic = self.topic(Topic.ENCODE)
        return LoadReport(
            replica=self.replica,
            stage="encoder",
            partitions=sorted(part for t, part in self._owned if t == topic),
            consumed=self.watermarks.taken(topic),
            queued_jobs=len(self.jobs),
            queued_tokens=sum(len(job.payload.images) for job in self.jobs.values()),
            tokens_per_second=self.images_per_second.value,
        )


def _rgb(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.uint8).copy()


def _check_digests(payload: EncodePayload) -> None:
    """Every image the prompt names has bytes here, under the digest of those bytes."""
    named = {ref.digest for ref in payload.prefill.images}
    carried = {image.digest for image in payload.images}
    if named != carried:
        raise BadMessage(f"the prompt names {len(named)} images, the message carries {len(carried)} others")
    for image in payload.images:
        try:
            data = base64.b64decode(image.data, validate=True)
        except ValueError as err:
            raise BadMessage(f"image {image.digest[:12]}: its bytes are not base64 ({err})") from err
        if hashlib.sha256(data).hexdigest() != image.digest:
            raise BadMessage(f"image {image.digest[:12]}: its bytes are not the image the digest names")
