"""Every field a request may carry, what it does, and the ones deepseek-recipe does not read.

deepseek-recipe reads the fields of OpenAI's and Anthropic's protocols it knows and accepts any
other without a word. Benchmark and evaluation clients send, beside OpenAI's fields, the ones
vLLM and SGLang take (`max_completion_tokens`, `ignore_eos`, `min_tokens`, ...); a server that
accepts a field and ignores it makes a client measure something it did not ask for (a
`max_completion_tokens: 4` request that runs to 8,192 tokens). So each endpoint lists its
fields here with what each does; a field outside the list, or a value the engine cannot
honour, is refused with a 400 that names it.

`read` turns a body into what the recipe reads (OpenAI's newer name for a field it knows under
an older one; the thinking switch clients pass in `chat_template_kwargs`) and the options the
recipe leaves to us (`Extras`). Completions (tokenizer_svc/completions.py) has no recipe under
it: its pydantic model is its list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# what each accepted field of Chat Completions does (tests/unit/test_request_fields.py shows each one's effect)
CHAT_FIELDS = {
    "model": "the served model's name",
    "messages": "the conversation",
    "max_tokens": "the most tokens to generate",
    "max_completion_tokens": "OpenAI's current name for max_tokens",
    "temperature": "sampling temperature (0: greedy)",
    "top_p": "nucleus sampling",
    "top_k": "sample among the k most likely tokens (vLLM's extension)",
    "seed": "the random stream of sampled tokens",
    "stop": "stop sequences, not shown in the answer",
    "stop_token_ids": "token ids that end the answer (vLLM's extension)",
    "ignore_eos": "generate past the end-of-sequence token, to max_tokens (vLLM's extension)",
    "min_tokens": "no end of sequence or stop token before this many tokens (vLLM's extension)",
    "stream": "Server-Sent Events",
    "stream_options": "include_usage: a final chunk with the usage; continuous_usage_stats: usage on every chunk",
    "logprobs": "each token's logprob",
    "top_logprobs": "and this many most likely alternatives",
    "tools": "functions the model may call",
    "tool_choice": "whether and which function it must call",
    "parallel_tool_calls": "false: one call at most",
    "response_format": "JSON object or JSON schema output",
    "thinking": "DeepSeek's switch for reasoning before the answer: {type: enabled | disabled}",
    "reasoning_effort": "reasoning on, at this effort ('none': off)",
    "chat_template_kwargs": "thinking / enable_thinking: the reasoning switch as vLLM and SGLang take it",
    "n": "choices per request: 1 only",
    "user": "the end user, recorded on the request's trace",
    "safety_identifier": "the end user, recorded on the request's trace",
    "metadata": "recorded on the request's trace",
    "prompt_cache_key": "recorded on the request's trace (requests are routed by their prompt's cached prefix)",
    "frequency_penalty": "0 only",
    "presence_penalty": "0 only",
    "repetition_penalty": "1 only",
    "logit_bias": "empty only",
    "store": "false only (completions are not stored for later retrieval)",
    "service_tier": "auto or default only",
    "modalities": "text only",
}
# fields accepted only at the value that changes nothing: what the engine does not do
NEUTRAL = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "logit_bias": ({}, None),
    "store": (False, None),
    "service_tier": ("auto", "default", None),
    "modalities": (["text"], None),
}
ENGINE_FIELDS = {
    "ignore_eos": "generate past the end-of-sequence token, to the cap (vLLM's extension)",
    "min_tokens": "no end of sequence or stop token before this many tokens (vLLM's extension)",
    "stop_token_ids": "token ids that end the answer (vLLM's extension)",
    "top_k": "sample among the k most likely tokens",
}
RESPONSES_FIELDS = {
    "model": "the served model's name",
    "input": "the conversation",
    "instructions": "the system prompt",
    "max_output_tokens": "the most tokens to generate",
    "temperature": "sampling temperature (0: greedy)",
    "top_p": "nucleus sampling",
    "stream": "Server-Sent Events",
    "tools": "functions the model may call",
    "tool_choice": "whether and which function it must call",
    "parallel_tool_calls": "false: one call at most",
    "text": "format: JSON object or JSON schema output",
    "reasoning": "effort: reasoning first, at this effort ('none': off)",
    "top_logprobs": "each output token's most likely alternatives",
    "include": "message.output_text.logprobs: each output token's logprob",
    "store": "kept for GET /v1/responses/{id} and previous_response_id (gateway/stored_responses.py)",
    "background": "answered at once, run as a job (gateway)",
    "previous_response_id": "continue a stored response (gateway)",
    "metadata": "echoed in the response object",
    "user": "the end user, recorded on the request's trace",
    "safety_identifier": "the end user, recorded on the request's trace",
    "prompt_cache_key": "recorded on the request's trace (requests are routed by their prompt's cached prefix)",
    "service_tier": "auto or default only",
    "truncation": "disabled only (a prompt past the context is refused, not cut)",
    "max_tool_calls": "none only",
    **ENGINE_FIELDS,
}
MESSAGES_FIELDS = {
    "model": "the served model's name",
    "messages": "the conversation",
    "system": "the system prompt",
    "max_tokens": "the most tokens to generate",
    "stop_sequences": "stop sequences, not shown in the answer",
    "temperature": "sampling temperature (0: greedy)",
    "top_p": "nucleus sampling",
    "stream": "Server-Sent Events",
    "tools": "tools the model may use",
    "tool_choice": "any and a named tool are enforced (without thinking); auto leaves the choice to the model",
    "thinking": "reasoning before the answer: enabled (or adaptive) or disabled",
    "output_config": "effort: reasoning first, at this effort",
    "metadata": "user_id, recorded on the request's trace",
    "service_tier": "auto or standard_only only",
    "cache_control": "every prompt's prefixes are cached already; recorded on the request's trace",
    **ENGINE_FIELDS,
}
# each endpoint's neutral-only fields (Chat Completions': NEUTRAL)
RESPONSES_NEUTRAL = {
    "service_tier": ("auto", "default", None),
    "truncation": ("disabled", None),
    "max_tool_calls": (None,),
}
MESSAGES_NEUTRAL = {"service_tier": ("auto", "standard_only", None)}
TRACED = ("user", "safety_identifier", "metadata", "prompt_cache_key", "cache_control")  # recorded, not acted on
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
THINKING_SWITCHES = ("thinking", "enable_thinking")  # chat_template_kwargs keys (SGLang's, vLLM's)
# the options read here on every endpoint: the engine's, beside those each protocol has
ENGINE_EXTRAS = ("ignore_eos", "min_tokens", "stop_token_ids", "top_k")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


# endpoint -> (its fields and what each does, those taken at a neutral value only)
FIELDS = {
    "chat.completions": (CHAT_FIELDS, NEUTRAL),
    "responses": (RESPONSES_FIELDS, RESPONSES_NEUTRAL),
    "messages": (MESSAGES_FIELDS, MESSAGES_NEUTRAL),
}


class FieldError(ValueError):
    """A field no endpoint of ours takes, or a value it cannot honour: the message names it."""


@dataclass(frozen=True)
class Extras:
    """What a request asks that the recipe does not read."""

    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0
    include_usage: bool = False  # the usage on a last stream chunk of its own (OpenAI's include_usage)
    continuous_usage: bool = False  # usage on every stream chunk (vLLM's continuous_usage_stats)
    traced: tuple[tuple[str, str], ...] = ()  # (field, value) for the request's trace
    # Anthropic's `tool_choice: {"type": "any"}`: a call of one of the tools, which the recipe reads
    # as `auto` (the tokenizer enforces it as Chat Completions' `required`)
    forces_a_call: bool = False


def read(
    endpoint: str, body: dict[str, Any], vocab_size: int, developer_role: str = "system"
) -> tuple[dict[str, Any], Extras]:
    """The body as the recipe reads it, and the extras; FieldError naming what cannot be taken.
    `developer_role`: the role Chat Completions' `developer` messages are read as (the codec reads
    it off the recipe's Responses conversion)."""
    fields, neutral_values = FIELDS[endpoint]
    if unknown := sorted(set(body) - set(fields)):
        raise FieldError(f"unsupported field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
    for name, neutral in neutral_values.items():
        if name in body and body[name] not in neutral:
            raise FieldError(f"{name}: {fields[name]} (not {body[name]!r})")
    traced = tuple((name, str(body[name])) for name in TRACED if body.get(name) is not None and name in fields)
    if endpoint != "chat.completions":  # the rest of Responses and Messages goes to the recipe as sent
        rest = {k: v for k, v in body.items() if k not in (*ENGINE_EXTRAS, *neutral_values, "cache_control")}
        if endpoint == "responses":
            rest = _responses_include(rest)
        extras = _engine_extras(body, vocab_size)
        choice = body.get("tool_choice") if endpoint == "messages" else None
        forces_a_call = isinstance(choice, dict) and choice.get("type") == "any" and bool(body.get("tools"))
        return rest, Extras(**{**extras.__dict__, "traced": traced, "forces_a_call": forces_a_call})
    recipe_body = {k: v for k, v in body.items() if k not in (*ENGINE_EXTRAS, *NEUTRAL, "chat_template_kwargs")}
    if isinstance(messages := body.get("messages"), list):
        recipe_body["messages"] = _chat_roles(messages, developer_role)
    if "max_completion_tokens" in body:
        cap = recipe_body.pop("max_completion_tokens")
        if body.get("max_tokens") is not None and cap is not None and body["max_tokens"] != cap:
            raise FieldError("max_tokens and max_completion_tokens differ: send one")
        if cap is not None:
            recipe_body["max_tokens"] = cap
    if (switch := _thinking_switch(body.get("chat_template_kwargs"))) is not None and "thinking" not in body:
        recipe_body["thinking"] = {"type": "enabled" if switch else "disabled"}
    continuous = include_usage = False
    if isinstance(options := body.get("stream_options"), dict):
        if unknown := sorted(set(options) - set(STREAM_OPTIONS)):
            raise FieldError(f"stream_options: unsupported {', '.join(unknown)}")
        continuous = _flag(options, "continuous_usage_stats", "stream_options.continuous_usage_stats")
        recipe_body["stream_options"] = {k: v for k, v in options.items() if k != "continuous_usage_stats"}
        include_usage = continuous or _flag(options, "include_usage", "stream_options.include_usage")
        if continuous:  # usage on every chunk, and on a last one of its own
            recipe_body["stream_options"]["include_usage"] = True
    extras = _engine_extras(body, vocab_size)
    asked = {"include_usage": include_usage, "continuous_usage": continuous, "traced": traced}
    return recipe_body, Extras(**{**extras.__dict__, **asked})


def _chat_roles(messages: list[Any], developer_role: str) -> list[Any]:
    """Chat messages in the roles the recipe's chat conversion reads. OpenAI's `developer` role
    (its newer name for instructions) reads as the recipe reads it in the Responses API, so one
    conversation is one prompt (and one cached prefix) through either endpoint. `function`, the
    role OpenAI replaced by `tool`, is refused by name."""
    roles = [m.get("role") for m in messages if isinstance(m, dict)]
    if "function" in roles:
        raise FieldError("messages: the role 'function' is not supported (OpenAI replaced it): send role 'tool'")
    return [
        {**m, "role": developer_role} if isinstance(m, dict) and m.get("role") == "developer" else m for m in messages
    ]


def _responses_include(body: dict[str, Any]) -> dict[str, Any]:
    """Responses' `include`: the output's logprobs, which the recipe turns on by `top_logprobs`
    alone (so `include` without it would be ignored); nothing else it can name is produced here."""
    include = body.pop("include", None) or []
    if not isinstance(include, list) or not all(isinstance(item, str) for item in include):
        raise FieldError("include must be a list of strings")
    if unknown := sorted(set(include) - {LOGPROBS_INCLUDE}):
        raise FieldError(f"include: unsupported {', '.join(unknown)} (only {LOGPROBS_INCLUDE})")
    if include and body.get("top_logprobs") is None:
        body["top_logprobs"] = 0
    return body


def _engine_extras(body: dict[str, Any], vocab_size: int) -> Extras:
    ignore_eos = _flag(body, "ignore_eos", "ignore_eos")
    min_tokens = body.get("min_tokens") or 0
    if not _is_int(min_tokens) or min_tokens < 0:
        raise FieldError(f"min_tokens must be an integer >= 0, not {min_tokens!r}")
    top_k = body.get("top_k")
    top_k = 0 if top_k is None or top_k == -1 else top_k  # -1: vLLM's "no top-k"
    if not _is_int(top_k) or top_k < 0:
        raise FieldError(f"top_k must be an integer >= 0 (0 or -1: every token), not {body['top_k']!r}")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) and 0 <= t < vocab_size for t in stop_ids):
        raise FieldError(f"stop_token_ids must be a list of token ids in [0, {vocab_size})")
    return Extras(ignore_eos=ignore_eos, min_tokens=min_tokens, stop_token_ids=tuple(stop_ids), top_k=top_k)


def _thinking_switch(kwargs: Any) -> bool | None:
    """chat_template_kwargs' reasoning switch, or None where it has none."""
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        raise FieldError("chat_template_kwargs must be an object")
    if unknown := sorted(set(kwargs) - set(THINKING_SWITCHES)):
        raise FieldError(f"chat_template_kwargs: unsupported {', '.join(unknown)} (the template takes thinking only)")
    switches = {_flag(kwargs, name, f"chat_template_kwargs.{name}") for name in THINKING_SWITCHES if name in kwargs}
    if len(switches) > 1:
        raise FieldError("chat_template_kwargs: thinking and enable_thinking disagree")
    return switches.pop() if switches else None


def _flag(options: dict[str, Any], name: str, where: str) -> bool:
    value = options.get(name)
    if value is not None and not isinstance(value, bool):
        raise FieldError(f"{where} must be true or false, not {value!r}")
    return bool(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
