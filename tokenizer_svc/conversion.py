"""What converting a request gives: the engine's prompt, the client's events, or the protocol's error.

Shared by the protocols deepseek-recipe converts (tokenizer_svc/protocol.py) and the one it
does not (tokenizer_svc/completions.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from common.api import error_body
from tokenizer_svc.images import PlacedImage


class ProtocolError(Exception):
    """A request the protocol rejects: carries the HTTP status and the protocol's own error body."""

    def __init__(self, status_code: int, body: str):
        super().__init__(body)
        self.status_code = status_code
        self.body = body


@dataclass(frozen=True)
class Prompt:
    """What the engine needs for one request."""

    model: str
    token_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stream: bool
    grammar: str | None = None  # the output constraint the engine enforces (tokenizer_svc/constraints.py)
    logprobs: int | None = None  # each token's logprob and this many alternatives (0 to 20); None: none
    prompt_logprobs: int | None = None  # the same for each prompt token (Completions' echo); None: none
    ignore_eos: bool = False  # generate past the model's end-of-sequence tokens
    min_tokens: int = 0  # no stop token before this many tokens
    stop_token_ids: list[int] = field(default_factory=list)  # the request's own stop tokens
    top_k: int = 0  # 0: every token
    traced: dict[str, str] = field(default_factory=dict)  # fields recorded on the request's trace only
    # the prompt's images (V4.1), in the order of their spans in token_ids (common/images.py)
    images: list[PlacedImage] = field(default_factory=list)
    # positions where the conversation's next turn leaves this prompt: the state there is worth
    # storing (the end of the last user input and its assistant tag; see Codec.next_turn_anchor)
    anchors: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Event:
    """One protocol stream event: its SSE event name (None for unnamed data) and JSON data."""

    name: str | None
    data: str


def compact_json(value: object) -> str:
    """An event's data as the protocols send it: UTF-8 as is, no spaces."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def error_json(endpoint: str, message: str) -> str:
    """An error body in the endpoint's own format, as JSON text."""
    return json.dumps(error_body(endpoint, message))
