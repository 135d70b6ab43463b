"""A request inside the engine: its tokens, sampling settings and where its state lives."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.state_transfer import StateSnapshot

# A token's logprob and the most likely tokens at its position, (token id, logprob) each. The
# engine's own type: common.messages.TokenLogprobs is the wire type, of the same shape, which
# workers send on as they get it.
TokenLogprobs = tuple[float, list[tuple[int, float]]]


@dataclass
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; top_k 0 and top_p 1 disable those filters."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # no stop token (the model's EOS, unless ignore_eos, and stop_token_ids) before this many
    # tokens: the sampler gives them no chance until then
    min_tokens: int = 0
    # hand back the state at the end (RequestOutput.final_state): where a longer prompt that
    # repeats this conversation, such as its next turn, can resume
    keep_final_state: bool = False
    # requests reuse each other's state in this engine (its resident prefixes) only within one
    # namespace: a tenant's prompts never start from another tenant's state, nor can time it
    prefix_namespace: str = ""
    # 0 runs first; a request of a larger number runs in what those of smaller ones leave free
    # (batch work is 1): it is admitted after them and preempted before them
    priority: int = 0
    # an llguidance grammar (engine/grammar.py) every output token must follow, or None
    grammar: str | None = None
    # with each token, its logprob's `logprobs` most likely alternatives (0 to 20); None: none
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be an integer from 0 to max_tokens, got {self.min_tokens!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20):
            raise InvalidRequestError(f"logprobs must be an integer from 0 to 20, got {self.logprobs!r}")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class ImageSpan:
    """An image's span of a prompt: positions start .. start + len(rows) - 1 read `rows` [n, hidden]."""

    start: int
    rows: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + self.rows.shape[0]


@dataclass(eq=False)  # a sequence is itself: `seq in running` compares identities, not every field
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's seed, or one drawn for it, so sampling never depends on the batch
    arrival: int
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    # Tokens [0, num_computed) are in the state cache; the next step computes the rest.
    num_computed: int = 0
    slot: int | None = None
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # prompt positions (ascending) after which the engine hands back a copy of the state, so a
    # prefix cache can store it; a prefill chunk ends at each of them
    snapshot_at: list[int] = field(default_factory=list)
    matcher: Any = None  # params.grammar's llguidance matcher, at the output so far
    # the final hidden state of the last computed token (a row of the step that computed it)
    last_hidden: torch.Tensor | None = None
    # speculative decoding (engine/drafter.py): the tokens drafted to follow the pending one,
    # which the next step verifies; the drafter's rows cover positions [draft_floor, draft_upto)
    # and it holds the main model's streams of the computed positions after those
    drafts: list[int] = field(default_factory=list)
    draft_floor: int = 0
    draft_upto: int = 0
    draft_streams: torch.Tensor | None = None
    # DSpark's estimate of each draft's probability of being accepted (its confidence head)
    draft_confidence: list[float] = field(default_factory=list)
    # the prompt's images (DeepSeek-V4.1): each span's first position and the encoder's rows for it
    images: list[ImageSpan] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building token_ids (a decode step takes one token a step)."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.token_ids[start:end]

    def image_rows_between(self, start: int, end: int) -> torch.Tensor | None:
        """The encoder's rows of the image positions in [start, end), in order; None if there are none."""
        parts = [
            image.rows[max(start, image.start) - image.start : min(end, image.end) - image.start]
            for image in self.images
            if image.start < end and start < image.end
        ]
        return torch.cat(parts) if parts else None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def num_schedulable(self) -> int:
        """Tokens the next step may compute: the pending ones, up to the next snapshot position."""
        if self.snapshot_at:
            return min(self.num_pending, self.snapshot_at[0] - self.num_computed)
        return self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    num_prompt_tokens: int = 0
    final_state: StateSnapshot | None = None  # with keep_final_state, when the request stops or reaches its length
    prefix_state: StateSnapshot | None = None  # the state at one of the request's snapshot_at positions
    # with SamplingParams.logprobs: per new token, the most likely tokens and their logprobs
    new_top_logprobs: list[list[tuple[int, float]]] | None = None

    def token_logprobs(self) -> list[TokenLogprobs] | None:
        """Per new token, its logprob and the most likely tokens; None unless the request asked."""
        if self.new_top_logprobs is None:
            return None
        return list(zip(self.new_logprobs, self.new_top_logprobs, strict=True))


@dataclass
class CompletionOutput:
    """A finished request, as `LLMEngine.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
