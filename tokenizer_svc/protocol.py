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
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import deepseek_recipe as recipe
from tokenizers import Tokenizer

from common.api import protocol_problem, unknown_model_body
from common.responses import RESPONSE_EVENTS
from tokenizer_svc import request_fields
from tokenizer_svc.completions import Completions, CompletionStream
from tokenizer_svc.constraints import ConstraintError, Markup, output_grammar, schemas_for_the_recipe
from tokenizer_svc.conversion import Event, Prompt, ProtocolError, compact_json, error_json
from tokenizer_svc.images import (
    ImagePolicy,
    ImageRequestError,
    ImageResolver,
    ResolvedImage,
    image_parts,
    placed,
)
from tokenizer_svc.request_fields import Extras

ENDPOINTS = {  # endpoint -> (request type, response type); response ids: common.api.response_id
    "chat.completions": (recipe.ChatCompletionRequest, recipe.ChatCompletionResponse),
    "responses": (recipe.ResponsesRequest, recipe.ResponsesResponse),
    "messages": (recipe.MessagesRequest, recipe.MessagesResponse),
}


class Codec:
    """Conversion for one served model: its names, tokenizer and context length."""

    def __init__(
        self,
        tokenizer_file: str | Path,
        served_models: Sequence[str],
        context_limit: int,
        stop_ids: set[int],
        add_bos: bool = False,
        default_thinking: bool = False,
        model_type: str = "deepseek_v4",
        images: ImageResolver | None = None,
    ):
        """`add_bos`: the tokenizer starts a raw text with its BOS token (Completions' prompts;
        a chat template writes its own). `default_thinking`: whether a request that does not say
        reasons before its answer (clients that know nothing of reasoning would otherwise see a
        small max_tokens spent on it and an empty answer). `model_type`: the checkpoint's, which picks
        the prompt encoding whatever name the model is served under (V4.1 writes `<｜System｜>`
        and a reasoning-effort line V4 does not). `images`: how a model that reads images (V4.1 with
        a vision tower) resolves a request's; None: requests with images are refused."""
        self.tokenizer = recipe.Tokenizer.from_file(str(tokenizer_file))
        self.decoder = Tokenizer.from_file(str(tokenizer_file))  # bytes of tokens: see OutputStream.tokens
        v41 = model_type == "deepseek_v41"
        encoding = recipe.DeepseekV41Encoding() if v41 else recipe.DeepseekV4Encoding()
        version = recipe.ModelVersion.DeepseekV41Flash if v41 else recipe.ModelVersion.DeepseekV4Pro
        self.encoding = encoding.with_tokenizer(self.tokenizer)
        options = recipe.ConversionOptions().with_default_thinking_mode(default_thinking)
        for name in served_models:
            options = options.with_model_alias(name, version)
        # accept only the names this deployment serves
        self.options = options.with_model_versions_by_name(dict.fromkeys(served_models, version))
        self.served_models = list(served_models)
        self.context_limit = context_limit
        self.stop_ids = set(stop_ids)
        self.think_start = self.decoder.token_to_id("<think>")
        self.think_end = self.decoder.token_to_id("</think>")
        self.markup = Markup(think_end=self.think_end, dsml=self.decoder.token_to_id("｜DSML｜"))
        bos = self.decoder.token_to_id("<｜begin▁of▁sentence｜>") if add_bos else None
        self.completions = Completions(self.decoder, served_models, context_limit, self.stop_ids, bos)
        self.assistant = self.decoder.token_to_id(recipe.SpecialToken.Assistant.default_str())
        self.images = images
        self.image_placeholder = self.decoder.token_to_id(recipe.SpecialToken.Image.default_str())
        self.developer_role = "system"  # read off the recipe below (the renders on the way send no developer message)
        self.history_opener = self._history_opener()
        self.developer_role = self._developer_role()

    @classmethod
    def for_model(
        cls,
        model_path: str | Path,
        served_model: str,
        default_thinking: bool = False,
        image_policy: ImagePolicy | None = None,
    ) -> Codec:
        """A codec for a checkpoint directory: its tokenizer, context length and EOS tokens, and
        the geometry of its vision tower, if it has one (images fetched by `image_policy`)."""
        from engine.families import read_config

        config = read_config(model_path)
        vision = getattr(config, "vision_config", None)
        images = None
        if vision:
            images = ImageResolver(
                image_policy or ImagePolicy(), int(vision.get("patch_size", 14)), int(vision.get("downsample_ratio", 3))
            )
        tokenizer_config = Path(model_path) / "tokenizer_config.json"
        settings = json.loads(tokenizer_config.read_text()) if tokenizer_config.exists() else {}
        return cls(
            Path(model_path) / "tokenizer.json",
            [served_model],
            context_limit=config.max_position_embeddings,
            stop_ids=set(config.eos_token_ids),
            add_bos=settings.get("add_bos_token") is True,
            default_thinking=default_thinking,
            model_type=config.model_type,
            images=images,
        )

    def convert(self, endpoint: str, body: dict[str, Any] | bytes | str) -> tuple[Any, str, Extras]:
        """(ConversationRequest, model name, what the recipe does not read), or ProtocolError with
        the protocol's error body."""
        if endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {endpoint!r}")
        if isinstance(body, (bytes, str)):
            try:
                body = json.loads(body)
            except ValueError as err:
                raise ProtocolError(400, error_json(endpoint, f"invalid JSON body: {err}")) from err
        if not isinstance(body, dict):
            raise ProtocolError(400, error_json(endpoint, "the request body must be a JSON object"))
        if problem := protocol_problem(endpoint, body):
            raise ProtocolError(400, error_json(endpoint, problem))
        if isinstance(model := body.get("model"), str) and self.served_models and model not in self.served_models:
            raise ProtocolError(404, json.dumps(unknown_model_body(endpoint, model)))
        if self.images is None and image_parts(body):
            problem = f"model {body.get('model')!r} does not read images (it has no vision encoder)"
            raise ProtocolError(400, error_json(endpoint, problem))
        try:
            body, extras = request_fields.read(endpoint, body, self.decoder.get_vocab_size(), self.developer_role)
        except request_fields.FieldError as err:
            raise ProtocolError(400, error_json(endpoint, str(err))) from err
        request_type = ENDPOINTS[endpoint][0]
        try:
            body = schemas_for_the_recipe(body)
        except ConstraintError as err:
            raise ProtocolError(400, error_json(endpoint, str(err))) from err
        try:
            request = request_type(body)
            model = request.model
            converted = request.convert(self.options)
        except recipe.ConversionError as err:
            raise recipe_error(endpoint, err) from err
        except Exception as err:  # a number the recipe cannot hold (OverflowError), ...
            raise ProtocolError(400, error_json(endpoint, f"unreadable request: {err}")) from err
        if extras.forces_a_call and converted.conversation.thinking_mode:  # as the recipe says of `required`
            raise ProtocolError(400, error_json(endpoint, "Thinking mode does not support this tool_choice"))
        return converted, model, extras

    def prompt(self, endpoint: str, body: dict[str, Any] | bytes | str) -> Prompt:
        """What the engine needs for a request, or ProtocolError: whatever in the body makes it
        fail is that request's error, never the service's."""
        if endpoint == "completions":
            return self.completions.prompt(body)
        conversation_request, model, extras = self.convert(endpoint, body)
        conversation = conversation_request.conversation
        try:
            if extras.forces_a_call:
                conversation = _calling_a_tool(conversation)
            token_ids = self.encoding.encode(conversation)
            images = []
            if resolved := self._images(conversation):
                token_ids, images = placed(token_ids, self.image_placeholder, resolved)
            max_tokens = conversation_request.resolve_max_tokens(len(token_ids), self.context_limit)
            options = conversation_request.inference_options
            temperature = options.temperature if options.temperature is not None else 1.0
            top_p = options.top_p if options.top_p is not None else 1.0
            seed = options.seed
            constraint = options.output_constraint
            logprobs = (options.top_logprobs or 0) if options.logprobs else None
        except recipe.ConversionError as err:
            raise recipe_error(endpoint, err) from err
        except ImageRequestError as err:
            raise ProtocolError(400, error_json(endpoint, str(err))) from err
        except Exception as err:
            raise ProtocolError(400, error_json(endpoint, f"unreadable request: {err}")) from err
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ProtocolError(400, error_json(endpoint, f"temperature must be a number >= 0, not {temperature}"))
        if not (math.isfinite(top_p) and 0 < top_p <= 1):
            raise ProtocolError(400, error_json(endpoint, f"top_p must be in (0, 1], not {top_p}"))
        if extras.min_tokens > max_tokens:
            raise ProtocolError(
                400, error_json(endpoint, f"min_tokens ({extras.min_tokens}) exceeds max_tokens ({max_tokens})")
            )
        grammar = None
        if constraint is not None:
            thinking = bool(token_ids) and token_ids[-1] == self.think_start  # reasoning first, then the answer
            try:
                one_call = isinstance(body, dict) and _one_call(body)
                kind = "tool_call_required" if extras.forces_a_call else constraint.kind
                grammar = output_grammar(kind, constraint.schema, thinking, self.markup, one_call)
            except ConstraintError as err:
                raise ProtocolError(400, error_json(endpoint, str(err))) from err
        return Prompt(
            model=model,
            token_ids=list(token_ids),
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stream=conversation_request.stream,
            grammar=grammar,
            logprobs=logprobs,
            ignore_eos=extras.ignore_eos,
            min_tokens=extras.min_tokens,
            stop_token_ids=list(extras.stop_token_ids),
            top_k=extras.top_k,
            traced=dict(extras.traced),
            images=images,
            anchors=self.next_turn_anchor(token_ids),
        )

    def next_turn_anchor(self, token_ids: list[int]) -> list[int]:
        """Where the next turn's prompt leaves this one, if before its end: the next turn renders
        this turn's answer after the last assistant tag as history, opened as the encoding opens
        every past answer (`history_opener`). A prompt that opens its answer otherwise (`<think>`
        opening a reasoning turn, where history drops the reasoning) has no prefix of the next
        turn past the point where the two openings part; the state there is stored too (DeepSeek's
        API caches at the end of every user input for this reason). Where the prompt opens its
        answer as history does (`</think>` without reasoning), its own end is that prefix: no
        anchor, and no step split before the first token for one."""
        tags = [i for i, token in enumerate(token_ids) if token == self.assistant]
        if not tags:
            return []
        after = token_ids[tags[-1] + 1 :]
        shared = common_prefix(after, self.history_opener)
        return [tags[-1] + 1 + shared] if shared < len(after) else []

    def _developer_role(self) -> str:
        """The chat role that reads OpenAI's `developer` messages as the recipe's Responses
        conversion reads them for this model (V4: a user message; V4.1: a system message): the
        role whose chat render equals that render, read off the recipe, not assumed."""
        if not self.served_models:
            return "system"
        name = self.served_models[0]

        def render(endpoint: str, key: str, role: str) -> list[int]:
            body = {"model": name, key: [{"role": role, "content": "a"}, {"role": "user", "content": "b"}]}
            return list(self.encoding.encode(self.convert(endpoint, body)[0].conversation))

        wanted = render("responses", "input", "developer")
        return next(
            (role for role in ("system", "user") if render("chat.completions", "messages", role) == wanted), "system"
        )

    def _history_opener(self) -> list[int]:
        """The tokens the encoding writes after an assistant tag before a past answer's text, in
        both thinking modes (their common part): read off renders of a conversation whose past
        answers differ, not assumed."""
        if not self.served_models:  # nothing to render a request for: an anchor after every tag
            return []
        name = self.served_models[0]
        openers = []
        for thinking in ("enabled", "disabled"):
            renders = []
            for answer in ("yes", "no"):
                messages = [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": "b"},
                ]
                body = {"model": name, "messages": messages, "thinking": {"type": thinking}}
                request, _, _ = self.convert("chat.completions", body)
                renders.append(list(self.encoding.encode(request.conversation)))
            tag = renders[0].index(self.assistant)
            first, second = renders[0][tag + 1 :], renders[1][tag + 1 :]
            openers.append(first[: common_prefix(first, second)])
        return openers[0][: common_prefix(*openers)]

    def _images(self, conversation: Any) -> list[ResolvedImage]:
        """The conversation's images, resolved, in the order of their placeholders."""
        if self.images is None or not any(message.image_sources for message in conversation.messages):
            return []
        return self.images.resolve(self.encoding.render_conversation(conversation).image_sources)

    def output(
        self, endpoint: str, body: dict[str, Any] | bytes | str, response_id: str
    ) -> OutputStream | CompletionStream:
        if endpoint == "completions":
            return self.completions.output(body, response_id)
        conversation_request, model, extras = self.convert(endpoint, body)
        request_type, response_type = ENDPOINTS[endpoint]
        parsing = conversation_request.parsing_options
        parsing.starts_in_tool_calls |= extras.forces_a_call  # the prompt opened the calls (_calling_a_tool)
        generator = request_type.chunk_generator(conversation_request, response_id, model)
        processor = recipe.StreamProcessor(generator, parsing, self.tokenizer)
        # every stop token, the model's and the request's, counts and shows as nothing (OutputStream.tokens);
        # with ignore_eos the model's are generated like any other
        stop_ids = {*self.stop_ids, *extras.stop_token_ids}
        stream = OutputStream(processor, response_type, response_id, model, stop_ids, self.decoder)
        stream.include_usage = extras.include_usage
        stream.continuous_usage = extras.continuous_usage
        stream.endpoint = endpoint
        stage = parsing.thinking_initial_stage
        stream.reasoning = stage is not None and stage != recipe.ThinkingInitialStage.ContentContinuation
        stream.think_end = self.think_end
        if endpoint == "responses" and isinstance(body, dict):  # the recipe reports these false and null
            stream.stated = {
                "store": body.get("store") is not False,
                "background": bool(body.get("background")),
                "previous_response_id": body.get("previous_response_id"),
                "metadata": body.get("metadata") or {},
            }
        return stream


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
        self.endpoint = ""
        self.reasoning = False  # the tokens generated so far are reasoning (the answer has not started)
        self.think_end: int | None = None  # the token that ends reasoning
        self.reasoning_tokens = 0
        self.stated: dict[str, Any] = {}  # Responses' state options, as the request gave them (common/responses.py)
        self.include_usage = False  # Chat Completions' usage on a chunk of its own (else on the finish chunk)
        self.continuous_usage = False  # usage on every Chat Completions chunk
        self.prompt_tokens = 0
        self.generated = 0  # tokens generated so far, for continuous usage

    def start(self, prompt_tokens: int, cached_tokens: int = 0, prompt_logprobs: Any = None) -> list[Event]:
        """The opening events (`prompt_logprobs` only matter to Completions' echo)."""
        self.response = self.response_type(self.response_id, self.model, int(time.time()), prompt_tokens, cached_tokens)
        self.prompt_tokens = prompt_tokens
        usage = recipe.PromptUsage(prompt_tokens=prompt_tokens, prompt_cache_hit_tokens=cached_tokens)
        return self._events(self.processor.push(recipe.InferenceChunk.ready(prompt_usage=usage)))

    @property
    def complete(self) -> bool:
        """True once the output has ended, possibly before the engine finished (a stop sequence):
        the caller should then stop generating."""
        return self.processor.finished

    def tokens(self, token_ids: Sequence[int], logprobs: Sequence[Any] | None = None) -> list[Event]:
        """Feed generated tokens (with, when the request asked, each one's logprob and most likely
        alternatives); the engine's stop tokens end the output and are not shown.

        One token per push: the recipe's processor does not always give the same output for
        tokens pushed together as for the same tokens pushed one by one (a group holding a
        partial UTF-8 character can vanish), and how tokens are grouped into messages depends
        on timing. One at a time, an answer is the same however it arrived.
        """
        events: list[Event] = []
        for i, token in enumerate(token_ids):
            if self.complete:
                break
            self.generated += 1
            if token in self.stop_ids:
                # generated, so counted (as Completions counts it, and vLLM), but no text: a stop
                # token passed under ignore_eos, or the one that ends the answer
                events += self._events(self.processor.push(recipe.InferenceChunk.text("", 1)))
            else:
                if self.reasoning:  # counted as generated: the end of reasoning is reasoning's last token
                    self.reasoning_tokens += 1
                    self.reasoning = token != self.think_end
                chunk = recipe.InferenceChunk.tokens([token], [logprobs[i]] if logprobs is not None else None)
                events += self._events(self.processor.push(chunk))
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
        return {**self._count_reasoning(json.loads(self.response.to_json())), **self.stated}

    def _events(self, chunks: list[Any]) -> list[Event]:
        events = []
        for chunk in chunks:
            data, name = chunk.to_json(), self.response_type.sse_event_name(chunk)
            # a usage (Chat Completions' last chunk, response.completed), or a whole response object
            if '"reasoning_tokens"' in data or (self.stated and name in RESPONSE_EVENTS):
                restated = self._count_reasoning(json.loads(data))
                if isinstance(restated.get("response"), dict):
                    restated["response"].update(self.stated)
                data = compact_json(restated)
            self.response.accumulate(chunk)
            events += self._chat_usage(data) if self.include_usage else [Event(name, data)]
        return events

    def _chat_usage(self, data: str) -> list[Event]:
        """A Chat Completions chunk as OpenAI sends it with include_usage: the usage on a last chunk
        of its own, with no choices (the recipe puts it on the finish_reason chunk, as DeepSeek's
        API does), and with continuous usage the counts so far on every other chunk."""
        chunk = json.loads(data)
        usage = chunk.get("usage")
        if usage is not None:
            chunk["usage"] = self._usage_so_far() if self.continuous_usage else None
            return [
                Event(None, compact_json(chunk)),
                Event(None, compact_json({**chunk, "choices": [], "usage": usage})),
            ]
        if not self.continuous_usage:
            return [Event(None, data)]
        return [Event(None, compact_json({**chunk, "usage": self._usage_so_far()}))]

    def _usage_so_far(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.generated,
            "total_tokens": self.prompt_tokens + self.generated,
        }

    def _count_reasoning(self, data: dict[str, Any]) -> dict[str, Any]:
        """The recipe counts reasoning tokens by tokenizing the reasoning text again, which can
        give more than were generated (206 of 200); the usage reports the tokens generated."""
        for usage in (data.get("usage"), (data.get("response") or {}).get("usage")):
            for details in ("completion_tokens_details", "output_tokens_details"):
                if isinstance(usage, dict) and isinstance(usage.get(details), dict):
                    usage[details]["reasoning_tokens"] = self.reasoning_tokens
        return data


def _calling_a_tool(conversation: Any) -> Any:
    """The conversation with Chat Completions' `tool_choice: required` (Anthropic's `any`, which the
    recipe converts as `auto`): its prompt ends inside the opened tool calls, as the recipe renders
    `required`, and the grammar of `tool_call_required` holds the answer to calls of its tools."""
    return recipe.Conversation(
        conversation.messages,
        thinking_mode=conversation.thinking_mode,
        tools=conversation.tools,
        tool_choice="required",
        reasoning_effort=conversation.reasoning_effort,
    )


def _one_call(body: dict[str, Any]) -> bool:
    """Whether the request allows one tool call at most: OpenAI's `parallel_tool_calls: false`,
    Anthropic's `tool_choice.disable_parallel_tool_use`."""
    choice = body.get("tool_choice")
    anthropic_single = isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True
    return body.get("parallel_tool_calls") is False or anthropic_single


def recipe_error(endpoint: str, err: Any) -> ProtocolError:
    """The recipe's refusal in the endpoint's own shape: it writes OpenAI's error body for every
    endpoint, and names Responses' `max_output_tokens` `max_tokens`. What a job's result (and
    the `results` topic, and GET /v1/jobs) carries is then what the protocol's clients parse."""
    try:
        error = json.loads(err.body)["error"]
        message = str(error["message"])
    except (ValueError, KeyError, TypeError):
        return ProtocolError(err.status_code, err.body)
    if endpoint == "messages":
        return ProtocolError(err.status_code, error_json(endpoint, message))
    if endpoint == "responses" and "max_tokens" in message:
        return ProtocolError(
            err.status_code,
            json.dumps({"error": {**error, "message": message.replace("max_tokens", "max_output_tokens")}}),
        )
    return ProtocolError(err.status_code, err.body)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two sequences share from their start."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
