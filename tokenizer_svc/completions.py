"""OpenAI's legacy Completions (`POST /v1/completions`): a raw prompt in, its continuation out.

No chat template: the prompt is text, encoded with the checkpoint's own tokenizer, or token
ids, as evaluation harnesses (lm-evaluation-harness) and benchmark clients send it.
deepseek-recipe has no Completions protocol, so this module is all of it: the request's rules,
and the output side that turns generated tokens into text, ends it at a stop sequence, and
reports the legacy `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset),
with `echo` the prompt's own entries first.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from functools import cache
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tokenizers import Tokenizer

from common.api import unknown_model_body
from tokenizer_svc.conversion import Event, Prompt, ProtocolError, compact_json, error_json

MAX_STOP_SEQUENCES = 16  # OpenAI allows 4; evaluation tasks stop at more (vLLM takes any number)
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # usage on every chunk (vLLM's)


class CompletionRequest(BaseModel):
    """The body, as OpenAI's API reference has it. Options the engine cannot honour (several
    choices, penalties, a suffix) are accepted at their neutral value and refused otherwise."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: str | TokenIds | Annotated[list[str | TokenIds], Field(min_length=1)]
    max_tokens: int | None = Field(default=16, ge=0)  # 0 with echo: score the prompt, generate nothing
    max_completion_tokens: int | None = Field(default=None, ge=0)  # the chat name some clients send here too
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = False
    stop: str | list[str] | None = None
    n: int | None = 1
    best_of: int | None = 1
    suffix: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # recorded on the request's trace
    # vLLM's extensions, which benchmark clients send (guidellm: ignore_eos)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    top_k: int | None = Field(default=None, ge=-1)  # 0 or -1: every token

    @property
    def cap(self) -> int:
        """max_tokens, under either name (16 where neither is given, as OpenAI's API has it)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens if self.max_tokens is not None else 16

    def unsupported(self) -> str | None:
        """An option set to something the engine does not do, for a 400 naming it."""
        given = self.model_fields_set
        if {"max_tokens", "max_completion_tokens"} <= given and self.max_tokens != self.max_completion_tokens:
            return "max_tokens and max_completion_tokens differ: send one"
        for name in ("n", "best_of"):
            if getattr(self, name) not in (None, 1):
                return f"{name} is not supported (one completion per request)"
        if self.suffix:
            return "suffix is not supported"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return f"{name} is not supported (only 0)"
        if self.logit_bias:
            return "logit_bias is not supported"
        return None


class Completions:
    """The protocol for one served model: its tokenizer, names and context length."""

    def __init__(
        self, decoder: Tokenizer, served_models: Sequence[str], context_limit: int, stop_ids: set[int], bos: int | None
    ):
        self.decoder = decoder
        self.served_models = list(served_models)
        self.context_limit = context_limit
        self.stop_ids = stop_ids
        self.bos = bos  # prepended to a text prompt when the checkpoint's tokenizer adds it (add_bos_token)

    def request(self, body: dict[str, Any] | bytes | str) -> CompletionRequest:
        """The validated request, or ProtocolError with OpenAI's error body."""
        try:
            if isinstance(body, dict):
                request = CompletionRequest.model_validate(body)
            else:
                request = CompletionRequest.model_validate_json(body)
        except ValidationError as err:
            problem = err.errors()[0]
            where = ".".join(str(part) for part in problem["loc"]) or "body"
            raise _bad(f"{where}: {problem['msg']}") from None
        if problem := request.unsupported():
            raise _bad(problem)
        if request.model not in self.served_models:
            raise ProtocolError(404, json.dumps(unknown_model_body("completions", request.model)))
        if isinstance(request.prompt, list) and isinstance(request.prompt[0], (str, list)) and len(request.prompt) > 1:
            # POST /v1/completions runs each prompt of a list as a job of its own (common/api.py)
            raise _bad("one prompt per job: a list of prompts is taken by POST /v1/completions only")
        stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
        if len(stops) > MAX_STOP_SEQUENCES or not all(stops):
            raise _bad(f"stop: up to {MAX_STOP_SEQUENCES} non-empty strings")
        return request

    def prompt_ids(self, request: CompletionRequest) -> list[int]:
        prompt = request.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a list of one prompt
        if isinstance(prompt, str):
            ids = self.decoder.encode(prompt, add_special_tokens=False).ids
            ids = [self.bos, *ids] if self.bos is not None else ids
            if not ids:
                raise _bad("prompt: the prompt is empty")
            return ids
        vocab = self.decoder.get_vocab_size()
        if bad := [token for token in prompt if token >= vocab]:
            raise _bad(f"prompt: token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        return list(prompt)

    def prompt(self, body: dict[str, Any] | bytes | str) -> Prompt:
        request = self.request(body)
        ids = self.prompt_ids(request)
        wanted = request.cap
        if len(ids) + wanted > self.context_limit:
            raise _bad(
                f"This model's maximum context length is {self.context_limit} tokens, however you requested "
                f"{len(ids) + wanted} tokens ({len(ids)} in your prompt; {wanted} for the completion). "
                "Please reduce your prompt; or completion length."
            )
        if wanted == 0 and not request.echo:
            raise _bad("max_tokens: 0 asks for nothing unless echo is true (to score the prompt)")
        if request.min_tokens > wanted:
            raise _bad(f"min_tokens ({request.min_tokens}) exceeds max_tokens ({wanted})")
        vocab = self.decoder.get_vocab_size()
        if bad := [token for token in request.stop_token_ids or [] if token >= vocab]:
            raise _bad(f"stop_token_ids: token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        return Prompt(
            model=request.model,
            token_ids=ids,
            max_tokens=max(wanted, 1),  # max_tokens 0: one token is computed and not shown
            temperature=request.temperature if request.temperature is not None else 1.0,
            top_p=request.top_p if request.top_p is not None else 1.0,
            seed=request.seed,
            stream=bool(request.stream),
            logprobs=request.logprobs,
            prompt_logprobs=request.logprobs if request.echo else None,
            ignore_eos=request.ignore_eos,
            min_tokens=request.min_tokens,
            stop_token_ids=list(request.stop_token_ids or []),
            top_k=max(request.top_k or 0, 0),
            traced={"user": request.user} if request.user is not None else {},
        )

    def output(self, body: dict[str, Any] | bytes | str, response_id: str) -> CompletionStream:
        request = self.request(body)
        # with ignore_eos the model's stop tokens are generated like any other (and shown as nothing)
        stop_ids = {*self.stop_ids, *(request.stop_token_ids or [])}
        return CompletionStream(request, self.prompt_ids(request), response_id, self.decoder, stop_ids)


def _bad(message: str) -> ProtocolError:
    return ProtocolError(400, error_json("completions", message))


class CompletionStream:
    """Generated tokens in, Completions chunks out, for one response (tokenizer_svc/protocol.py's
    OutputStream, for this protocol)."""

    endpoint = "completions"
    done_data = "[DONE]"

    def __init__(
        self,
        request: CompletionRequest,
        prompt_ids: list[int],
        response_id: str,
        decoder: Tokenizer,
        stop_ids: set[int],
    ):
        self.request = request
        self.prompt_ids = prompt_ids
        self.response_id = response_id
        self.decoder = decoder
        self.stop_ids = stop_ids
        self.created = int(time.time())
        self.stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
        self.hidden = request.cap == 0  # the one token computed is not shown
        self.echo = ""  # the prompt's text, when echoed
        self.text = ""  # the completion's text so far (without a stop sequence and what follows)
        self.sent = 0  # characters of `text` sent in chunks
        self.unsettled: list[int] = []  # the last tokens, if they end inside a UTF-8 character
        self.waiting: list[_Entry] = []  # the logprobs entries of the unsettled tokens
        self.entries: list[_Entry] = []  # logprobs of the echoed prompt, then of the completion's tokens
        self.entries_sent = 0
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stop_sequence = False  # a stop sequence ended the text (the tokens past it are not shown)

    @property
    def complete(self) -> bool:
        return self.finish_reason is not None

    def start(
        self, prompt_tokens: int, cached_tokens: int = 0, prompt_logprobs: Sequence[Any] | None = None
    ) -> list[Event]:
        self.prompt_tokens, self.cached_tokens = prompt_tokens, cached_tokens
        if not self.request.echo:
            return []
        asked = prompt_logprobs is not None and self.request.logprobs is not None
        unsettled: list[int] = []
        waiting: list[_Entry] = []  # the entries of the unsettled tokens
        for index, token in enumerate(self.prompt_ids):
            if asked:
                entry = prompt_logprobs[index] if index < len(prompt_logprobs) else None
                waiting.append(_Entry.of(self.decoder, token, entry, 0))
            unsettled.append(token)
            piece = self.decoder.decode(unsettled, skip_special_tokens=False)
            if not piece.endswith("\ufffd") or index == len(self.prompt_ids) - 1:
                self.entries += _placed(waiting, self.decoder, unsettled, len(self.echo), len(piece), False)
                self.echo += piece
                unsettled, waiting = [], []
        return [self._chunk(self.echo, self._take_entries(len(self.echo), everything=True), None)]

    def tokens(self, token_ids: Sequence[int], logprobs: Sequence[Any] | None = None) -> list[Event]:
        for index, token in enumerate(token_ids):
            if self.complete or self.hidden:
                break
            self.completion_tokens += 1
            if token in self.stop_ids:  # the engine ends here (finish comes next); the token is not text
                continue
            if logprobs is not None and self.request.logprobs is not None:
                self.waiting.append(_Entry.of(self.decoder, token, logprobs[index], 0))
            self.unsettled.append(token)
            piece = self.decoder.decode(self.unsettled)
            if not piece.endswith("\ufffd"):
                self._add(piece)
        # a stop sequence ends the completion here: its finish (and usage) go out now, as finish()
        # sends nothing once the completion is complete
        return self._send(final=self.complete)

    def finish(self, reason: str) -> list[Event]:
        """reason: the engine's ("stop" or "length")."""
        if self.complete:  # a stop sequence ended the text already
            return []
        if self.unsettled:  # the answer ends inside a character: what it has, as the decoder shows it
            self._add(self.decoder.decode(self.unsettled))
        if not self.complete:
            self.finish_reason = "length" if reason == "length" or self.hidden else "stop"
        return self._send(final=True)

    def body(self) -> dict[str, Any]:
        """The complete response, as a non-streamed call answers it."""
        choice = {
            "index": 0,
            "text": self.echo + self.text,
            "logprobs": _legacy(self.entries) if self.request.logprobs is not None else None,
            "finish_reason": self.finish_reason,
        }
        return {**self._head(), "choices": [choice], "usage": self._usage()}

    # -- internals ------------------------------------------------------------------------------

    def _add(self, piece: str) -> None:
        """The settled text of the unsettled tokens: ends the completion at the first stop sequence in it."""
        base = len(self.echo) + len(self.text)
        self.entries += _placed(self.waiting, self.decoder, self.unsettled, base, len(piece), True)
        self.unsettled, self.waiting = [], []
        self.text += piece
        found = [at for stop in self.stops if (at := self.text.find(stop, self.sent)) >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.finish_reason, self.stop_sequence = "stop", True

    def _held(self) -> int:
        """Characters at the end of the text that may be the start of a stop sequence: not sent yet."""
        if self.complete:
            return 0
        return max(
            (n for stop in self.stops for n in range(1, len(stop)) if self.text.endswith(stop[:n])),
            default=0,
        )

    def _send(self, final: bool) -> list[Event]:
        end = len(self.text) - self._held()
        text = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        entries = self._take_entries(len(self.echo) + end, everything=final and not self.stop_sequence)
        events = [self._chunk(text, entries, None)] if text or entries else []
        if final:
            events.append(self._chunk("", [], self.finish_reason))
            if self._include_usage:
                events.append(Event(None, compact_json({**self._head(), "choices": [], "usage": self._usage()})))
        return events

    def _take_entries(self, before: int, everything: bool = False) -> list[_Entry]:
        """The logprobs entries not sent yet of tokens that start before offset `before` of the
        text (all of them, with `everything`: the last tokens may show no text of their own)."""
        end = self.entries_sent
        while end < len(self.entries) and (everything or self.entries[end].offset < before):
            end += 1
        taken, self.entries_sent = self.entries[self.entries_sent : end], end
        return taken

    @property
    def _include_usage(self) -> bool:
        options = self.request.stream_options
        return bool(options and (options.include_usage or options.continuous_usage_stats))

    @property
    def _continuous_usage(self) -> bool:
        return bool(self.request.stream_options and self.request.stream_options.continuous_usage_stats)

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.request.model,
            "system_fingerprint": None,
        }

    def _chunk(self, text: str, entries: list[_Entry], finish_reason: str | None) -> Event:
        logprobs = _legacy(entries) if self.request.logprobs is not None and entries else None
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        chunk = {**self._head(), "choices": [choice]}
        if self._continuous_usage:  # the counts so far (vLLM's continuous_usage_stats)
            chunk["usage"] = {k: v for k, v in self._usage().items() if k != "prompt_tokens_details"}
        elif self._include_usage:
            chunk["usage"] = None
        return Event(None, compact_json(chunk))

    def _usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class _Entry:
    """One token of the legacy logprobs object."""

    __slots__ = ("logprob", "offset", "token", "top")

    def __init__(self, token: str, logprob: float | None, top: dict[str, float] | None, offset: int):
        self.token, self.logprob, self.top, self.offset = token, logprob, top, offset

    @classmethod
    def of(cls, decoder: Tokenizer, token: int, logprobs: Any, offset: int) -> _Entry:
        """`logprobs`: (logprob, [(token id, logprob), ...]), or None (a prompt's first token)."""
        if logprobs is None:
            return cls(token_text(decoder, token), None, None, offset)
        logprob, best = logprobs
        top = {token_text(decoder, other): value for other, value in best}
        return cls(token_text(decoder, token), logprob, top, offset)


def _placed(
    entries: list[_Entry], decoder: Tokenizer, tokens: list[int], base: int, length: int, skip_special: bool
) -> list[_Entry]:
    """The entries of tokens whose text settled together (`length` characters from offset `base`),
    each placed after the characters the tokens before it show on their own."""
    for k, entry in enumerate(entries):
        shown = len(decoder.decode(tokens[:k], skip_special_tokens=skip_special)) if k else 0
        entry.offset = base + min(shown, length)
    return entries


def _legacy(entries: list[_Entry]) -> dict[str, Any]:
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [e.top for e in entries],
        "text_offset": [e.offset for e in entries],
    }


def token_text(decoder: Tokenizer, token: int) -> str:
    """A token as the legacy logprobs name it: its text, or `bytes:\\x..` for a token that is
    part of a UTF-8 character (OpenAI's convention)."""
    raw = token_bytes(decoder, token)
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def token_bytes(decoder: Tokenizer, token: int) -> bytes:
    """A token's bytes: byte-level BPE spells each byte as one printable character (GPT-2's
    table); a special token is its own text."""
    piece = decoder.id_to_token(token) or ""
    table = _byte_of_char()
    if all(char in table for char in piece):
        return bytes(table[char] for char in piece)
    return piece.encode()


@cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-to-character table, reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars
