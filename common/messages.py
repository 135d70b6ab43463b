"""Versioned message envelopes: what every record on a deepmesh topic carries.

A record's value is one JSON `Envelope`; its key is the job id; W3C trace context travels
in the record headers, not in the body. On `tokens` and `results`, which carry a job's
stream of token ids or protocol events, `seq` is the index of the message's first item in
that stream: a consumer skips what it has and sees a gap, however a replay regroups the
stream (common/job_streams.py). Elsewhere a job has one message of a type and seq is 0.
"""

from __future__ import annotations

import base64
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SCHEMA_VERSION = 1


class BadMessage(ValueError):
    """A record that cannot be understood; it goes to the dead-letter topic with this reason."""


class Envelope(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = SCHEMA_VERSION
    type: str = Field(min_length=1)
    job_id: str = Field(min_length=1)
    seq: int = Field(default=0, ge=0)
    sent_at: float = Field(default_factory=time.time)
    payload: dict[str, Any] = Field(default_factory=dict)

    def encode(self) -> bytes:
        return self.model_dump_json().encode()


def decode(raw: bytes, expected_type: str | None = None) -> Envelope:
    """Parse a record value, or raise BadMessage saying what is wrong with it."""
    try:
        envelope = Envelope.model_validate_json(raw)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in err.errors())
        raise BadMessage(f"not a deepmesh envelope: {problems}") from err
    if envelope.type == "claim":  # the bus hands over what a claim names: this one's bytes are gone or altered
        raise BadMessage(f"the bytes of claim check {envelope.payload.get('sha256')} are missing or corrupt")
    if envelope.version != SCHEMA_VERSION:
        raise BadMessage(f"envelope version {envelope.version} is not supported (this build reads {SCHEMA_VERSION})")
    if expected_type is not None and envelope.type != expected_type:
        raise BadMessage(f"envelope type {envelope.type!r} does not belong on this topic ({expected_type!r})")
    return envelope


class DeadLetter(BaseModel):
    """What the dead-letter topic holds for a record no worker could use."""

    topic: str
    partition: int
    offset: int
    key: str
    value_base64: str
    reason: str
    consumer_group: str
    failed_at: float = Field(default_factory=time.time)

    @classmethod
    def of(cls, record, reason: str, consumer_group: str) -> DeadLetter:
        return cls(
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            key=record.key,
            value_base64=base64.b64encode(record.value).decode(),
            reason=reason,
            consumer_group=consumer_group,
        )


def payload_of(envelope: Envelope, model: type[BaseModel]):
    """The envelope's payload as `model`, or BadMessage saying why it is not one."""
    try:
        return model.model_validate(envelope.payload)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise BadMessage(f"bad {envelope.type} payload: {problems}") from err


# -- payloads, one per topic (see docs/architecture.md, "Topics and messages") --------------------------------

Endpoint = Literal["chat.completions", "responses", "messages", "completions"]
RetentionClass = Literal["agent", "chat"]
Priority = Literal["interactive", "batch"]
ENGINE_PRIORITY = {"interactive": 0, "batch": 1}  # SamplingParams.priority
TenantId = Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")]


class RequestPayload(BaseModel):
    """`requests`: an accepted API request, as the client sent it."""

    endpoint: Endpoint
    body: dict[str, Any]
    tenant: TenantId = "default"  # whose stored prefixes the request may use
    retention: RetentionClass | None = None  # how long its prefixes are kept; None: the endpoint's default
    priority: Priority = "interactive"  # batch work runs in what interactive work leaves free
    # only count the prompt's tokens (Anthropic's count_tokens): the answer is {"input_tokens": N}
    count_only: bool = False


# a token's logprob, and the most likely tokens at its position as (token id, logprob)
TokenLogprobs = tuple[float, list[tuple[int, float]]]


class Sampling(BaseModel):
    max_tokens: int = Field(ge=1)
    temperature: float = Field(ge=0)
    top_p: float = Field(gt=0, le=1)
    seed: int | None = None
    # the llguidance grammar every output token must follow (engine/grammar.py): the request's
    # output constraint, compiled by the tokenizer service (tokenizer_svc/constraints.py)
    grammar: str | None = None
    # each token's logprob and its `logprobs` most likely alternatives (0 to 20); None: none
    logprobs: int | None = Field(default=None, ge=0, le=20)
    # each prompt token's logprob and its `prompt_logprobs` most likely alternatives (the
    # legacy Completions' `echo` with `logprobs`); None: none
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    ignore_eos: bool = False  # generate past the model's end-of-sequence tokens
    min_tokens: int = Field(default=0, ge=0)  # no stop token before this many tokens
    stop_token_ids: list[int] = []  # the request's own stop tokens
    top_k: int = Field(default=0, ge=0)  # 0: every token

    def engine_params(self, tenant: str, priority: Priority, seed: int | None) -> dict[str, Any]:
        """The engine's SamplingParams for a job with this sampling, as keyword arguments: prefill
        and decode both start the job's sequence from them (decode with the seed prefill drew)."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": seed,
            "grammar": self.grammar,
            "logprobs": self.logprobs,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "stop_token_ids": self.stop_token_ids,
            "top_k": self.top_k,
            "prefix_namespace": tenant,  # a tenant's prompts start only from its own states
            "priority": ENGINE_PRIORITY[priority],
        }


class ImageRef(BaseModel):
    """An image's span of a prompt (common/images.py): where its positions are and the content
    its encoder rows are kept under in the KV cache (engine/image_rows.py). Never its pixels."""

    digest: str = Field(pattern=r"^[0-9a-f]{64}$")  # sha256 of the image's bytes
    start: int = Field(ge=0)
    num_tokens: int = Field(ge=1)


class PrefillPayload(BaseModel):
    """`prefill`: a tokenized request, ready for the engine. (Its API body went to `tokens`
    ahead of it, in a JobStart: prefill and decode never need it.)"""

    endpoint: Endpoint  # the shape of an error prefill answers itself
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: Sampling
    tenant: TenantId = "default"
    retention: RetentionClass = "chat"
    priority: Priority = "interactive"
    images: list[ImageRef] = []  # encoded already: their rows are in the KV cache
    # prompt positions whose state the conversation's next turn may start from (besides the end,
    # the intervals and where the prompt leaves the stored blocks): prefill stores it there
    anchors: list[int] = []


class ImageBytes(BaseModel):
    """An image to encode: its bytes as deepseek-recipe preprocessed them (WebP, base64)."""

    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    data: str = Field(min_length=1)


class EncodePayload(BaseModel):
    """`encode`: a tokenized request with images. The encoder stores each image's rows in the KV
    cache (unless they are there already) and sends `prefill` on; the images' bytes ride here,
    as a claim check once the message is large (common/claims.py), never further."""

    prefill: PrefillPayload
    images: list[ImageBytes] = Field(min_length=1)


class KVHandle(BaseModel):
    """Names state held by the cache service: Kafka carries this, never the state itself."""

    key: str  # the prompt's entry (its anchor key)
    size: int  # bytes of the whole entry: its head and its blocks
    checksum: str  # sha256 of the entry's head blob
    layout: str  # engine state layout; a consumer refuses one it does not understand
    num_tokens: int
    lease_expires_at: float


class DecodePayload(BaseModel):
    """`decode`: a prefilled request, its first token, and where its state is."""

    endpoint: Endpoint
    prompt_token_ids: list[int] = Field(min_length=1)
    first_token: int
    first_logprobs: TokenLogprobs | None = None  # when the request asked (Sampling.logprobs)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # when the request asked (Sampling.prompt_logprobs)
    seed: int
    sampling: Sampling
    kv: KVHandle | None = None  # None or unusable: decode recomputes from the tokens
    cached_tokens: int = 0
    tenant: TenantId = "default"
    retention: RetentionClass = "chat"
    priority: Priority = "interactive"
    prefilled_by: str | None = None  # the prefill replica: it may hold the finished conversation for its next turn
    images: list[ImageRef] = []  # the prompt's images, whose rows a recompute of the prompt reads
    # prefill sent the first token on `tokens` itself (seq 0, with the prompt's counts): decode
    # sends the ones after it; False, decode sends it too
    first_sent: bool = False


class WarmPayload(BaseModel):
    """`prefill`, type `warm`, to one replica: a finished conversation whose state decode has
    stored, for the prefill replica that prefilled it to take into its own memory (tier 0), so
    that the next turn, routed back there, starts from it with no load. One that is lost costs
    a load later, nothing else."""

    token_ids: list[int] = Field(min_length=1)
    tenant: TenantId = "default"
    retention: RetentionClass = "chat"


class JobStart(BaseModel):
    """`tokens`, type `start`: what the output side needs to build a job's response, sent by
    the tokenizer ahead of the job's prefill, so that the job's tokens find it in their
    partition (the same: both are keyed by the job id) and the body travels once."""

    endpoint: Endpoint
    body: dict[str, Any]
    tenant: TenantId = "default"  # whose usage the answer counts to
    priority: Priority = "interactive"


class TokensPayload(BaseModel):
    """`tokens`: generated token ids of one job, the envelope's seq being the index of the first;
    seq 0 carries prefill's token and the prompt's token counts. Every job that has a `start`
    on this topic ends on it: with a message that is `finished`, or a `cancel` from the stage
    where it ended without one (cancelled or refused in prefill or decode)."""

    prompt_tokens: int | None = None  # seq 0
    cached_tokens: int = 0  # seq 0: prompt tokens served from the KV cache
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asked (Sampling.logprobs)
    # seq 0, when the request asked (Sampling.prompt_logprobs): one per prompt token, None for the first
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finished: bool = False
    finish_reason: Literal["stop", "length", "abort"] | None = None


class StreamEvent(BaseModel):
    name: str | None  # SSE event name; None for an unnamed data event
    data: str  # JSON


class Usage(BaseModel):
    """An answered job's usage as DeepSeek bills it: input from the cache, input computed, output."""

    tenant: TenantId = "default"
    model: str
    priority: Priority = "interactive"
    cached_input_tokens: int = Field(ge=0)
    uncached_input_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)


class ResultPayload(BaseModel):
    """`results`: protocol events of one job, the envelope's seq being the index of the first; the
    last message has done=True and the complete response body (or the error status and body)."""

    events: list[StreamEvent] = Field(default_factory=list)
    done: bool = False
    status: int = 200
    body: dict[str, Any] | None = None
    done_data: str | None = None  # the protocol's final SSE data (Chat Completions' [DONE])
    usage: Usage | None = None  # the last message of an answered job: what it counts to (the usage ledger)
