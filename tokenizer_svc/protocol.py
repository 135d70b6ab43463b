"""Protocol requests to token ids and model tokens back to protocol events, with deepseek-recipe.

The input side converts an OpenAI Chat Completions, OpenAI Responses or Anthropic Messages
request into a conversation, renders and encodes it with the DeepSeek-V4 encoding and
resolves max_tokens against the engine's context. The output side turns the generated
token ids into the protocol's stream events (reasoning, tool calls, stop sequences,
finish reason, usage with cached-token counts) and the final response body.

Everything here is a pure function of the request body and the tokens, so a restarted
worker rebuilds an output stream by converting the request again and replaying the tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepseek_recipe as recipe
from tokenizers import Tokenizer

ENDPOINTS = {
    "chat.completions": (recipe.ChatCompletionRequest, recipe.ChatCompletionResponse, "chatcmpl"),
    "responses": (recipe.ResponsesRequest, recipe.ResponsesResponse, "resp"),
    "messages": (recipe.MessagesRequest, recipe.MessagesResponse, "msg"),
}


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


@dataclass(frozen=True)
class Event:
    """One protocol stream event: its SSE event name (None for unnamed data) and JSON data."""

    name: str | None
    data: str


class Codec:
    """Conversion for one served model: its names, tokenizer and context length."""

    def __init__(
        self, tokenizer_file: str | Path, served_models: Sequence[str], context_limit: int, stop_ids: set[int]
    ):
        self.tokenizer = recipe.Tokenizer.from_file(str(tokenizer_file))
        self.decoder = Tokenizer.from_file(str(tokenizer_file))  # bytes of tokens: see OutputStream.tokens
        self.encoding = recipe.DeepseekV4Encoding().with_tokenizer(self.tokenizer)
        options = recipe.ConversionOptions()
        for name in served_models:
            options = options.with_model_alias(name, recipe.ModelVersion.DeepseekV4Pro)
        # accept only the names this deployment serves
        self.options = options.with_model_versions_by_name(
            {name: recipe.ModelVersion.DeepseekV4Pro for name in served_models}
        )
        self.served_models = list(served_models)
        self.context_limit = context_limit
        self.stop_ids = set(stop_ids)

    @classmethod
    def for_model(cls, model_path: str | Path, served_model: str) -> Codec:
        """A codec for a checkpoint directory: its tokenizer, context length and EOS tokens."""
        from engine.config import ModelConfig

        config = ModelConfig.from_pretrained(model_path)
        return cls(
            Path(model_path) / "tokenizer.json",
            [served_model],
            context_limit=config.max_position_embeddings,
            stop_ids=set(config.eos_token_ids),
        )

    def convert(self, endpoint: str, body: dict[str, Any] | bytes | str) -> tuple[Any, str]:
        """(ConversationRequest, model name), or ProtocolError with the protocol's error body."""
        if endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {endpoint!r}")
        request_type = ENDPOINTS[endpoint][0]
        try:
            request = request_type(body)
            model = request.model
            return request.convert(self.options), model
        except recipe.ConversionError as err:
            raise ProtocolError(err.status_code, err.body) from err
        except (TypeError, ValueError) as err:  # not a JSON object at all
            raise ProtocolError(400, _error_body(endpoint, str(err))) from err

    def prompt(self, endpoint: str, body: dict[str, Any] | bytes | str) -> Prompt:
        conversation_request, model = self.convert(endpoint, body)
        token_ids = self.encoding.encode(conversation_request.conversation)
        try:
            max_tokens = conversation_request.resolve_max_tokens(len(token_ids), self.context_limit)
        except recipe.ConversionError as err:
            raise ProtocolError(err.status_code, err.body) from err
        options = conversation_request.inference_options
        return Prompt(
            model=model,
            token_ids=list(token_ids),
            max_tokens=max_tokens,
            temperature=options.temperature if options.temperature is not None else 1.0,
            top_p=options.top_p if options.top_p is not None else 1.0,
            seed=options.seed,
            stream=conversation_request.stream,
        )

    def output(self, endpoint: str, body: dict[str, Any] | bytes | str, response_id: str) -> OutputStream:
        conversation_request, model = self.convert(endpoint, body)
        request_type, response_type, _ = ENDPOINTS[endpoint]
        parsing = conversation_request.parsing_options
        generator = request_type.chunk_generator(conversation_request, response_id, model)
        processor = recipe.StreamProcessor(generator, parsing, self.tokenizer)
        return OutputStream(processor, response_type, response_id, model, self.stop_ids, self.decoder)


class OutputStream:
    """Generated tokens in, protocol events out, for one response."""

    def __init__(
        self,
        processor: Any,
        response_type: Any,
        response_id: str,
        model: str,
        stop_ids: set[int],
        decoder: Tokenizer,
    ):
        self.processor = processor
        self.decoder = decoder
        self.unsettled: list[int] = []  # the last tokens, if they end inside a UTF-8 character
        self.response_type = response_type
        self.response_id = response_id
        self.model = model
        self.stop_ids = stop_ids
        self.response: Any = None
        self.done_data = response_type.sse_done_data()

    def start(self, prompt_tokens: int, cached_tokens: int = 0) -> list[Event]:
        self.response = self.response_type(self.response_id, self.model, int(time.time()), prompt_tokens, cached_tokens)
        usage = recipe.PromptUsage(prompt_tokens=prompt_tokens, prompt_cache_hit_tokens=cached_tokens)
        return self._events(self.processor.push(recipe.InferenceChunk.ready(prompt_usage=usage)))

    @property
    def complete(self) -> bool:
        """True once the output has ended, possibly before the engine finished (a stop sequence):
        the caller should then stop generating."""
        return self.processor.finished

    def tokens(self, token_ids: Sequence[int]) -> list[Event]:
        """Feed generated tokens; the engine's stop tokens end the output and are not shown.

        One token per push: the recipe's processor does not always give the same output for
        tokens pushed together as for the same tokens pushed one by one (a group holding a
        partial UTF-8 character can vanish), and how tokens are grouped into messages depends
        on timing. One at a time, an answer is the same however it arrived.
        """
        events: list[Event] = []
        for token in token_ids:
            if self.complete:
                break
            if token not in self.stop_ids:
                events += self._events(self.processor.push(recipe.InferenceChunk.tokens([token])))
                self.unsettled.append(token)
                if not self.decoder.decode(self.unsettled).endswith("\ufffd"):
                    self.unsettled.clear()
        return events

    def finish(self, reason: str) -> list[Event]:
        """reason: the engine's finish reason ("stop" or "length")."""
        backend_reason = (
            recipe.InferenceFinishReason.Length if reason == "length" else recipe.InferenceFinishReason.Stop
        )
        if self.complete:  # a stop sequence already ended the output
            return []
        events: list[Event] = []
        if self.unsettled:
            # The answer ends inside a character: the processor holds those tokens back and would
            # leave them out of the usage. They were generated, so they count.
            events += self._events(self.processor.push(recipe.InferenceChunk.text("", len(self.unsettled))))
        events += self._events(self.processor.push(recipe.InferenceChunk.finish(backend_reason)))
        return events + self._events(self.processor.finish())

    def body(self) -> dict[str, Any]:
        """The complete (non-streamed) response accumulated from every event so far."""
        return json.loads(self.response.to_json())

    def _events(self, chunks: list[Any]) -> list[Event]:
        events = []
        for chunk in chunks:
            events.append(Event(self.response_type.sse_event_name(chunk), chunk.to_json()))
            self.response.accumulate(chunk)
        return events


def _error_body(endpoint: str, message: str) -> str:
    """A 400 body in the endpoint's own error format, for input the recipe could not even read."""
    if endpoint == "messages":
        return json.dumps({"type": "error", "error": {"type": "invalid_request_error", "message": message}})
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}})
