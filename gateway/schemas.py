"""The request bodies of the three protocols, as JSON Schema, for the OpenAPI document the gateway serves.

The schemas are the official SDKs' own request types (openai's chat completion and response
create parameters, anthropic's message create parameters) turned into JSON Schema by pydantic,
so that a client generator or a fuzzer sees what those clients send. They are generated into
api_schemas.json (the SDKs are test dependencies, not the gateway's) by

    python -m gateway.schemas

and tests/integration/test_fuzz.py checks that the file matches the installed SDKs.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

SCHEMA_FILE = Path(__file__).with_name("api_schemas.json")
# endpoint -> (component name, the SDK type it comes from)
SOURCES = {
    "chat.completions": (
        "ChatCompletionRequest",
        "openai.types.chat.completion_create_params:CompletionCreateParamsBase",
    ),
    "responses": ("ResponsesRequest", "openai.types.responses.response_create_params:ResponseCreateParamsBase"),
    "messages": ("MessagesRequest", "anthropic.types.message_create_params:MessageCreateParamsBase"),
    "completions": ("CompletionRequest", "openai.types.completion_create_params:CompletionCreateParamsBase"),
}
# the other endpoints' bodies (batches, token counts), from the same SDKs
BATCH_SOURCES = {
    "batches": ("BatchCreateRequest", "openai.types.batch_create_params:BatchCreateParams"),
    "messages.batches": ("MessageBatchCreateRequest", "anthropic.types.messages.batch_create_params:BatchCreateParams"),
    "messages.count_tokens": (
        "MessageCountTokensRequest",
        "anthropic.types.message_count_tokens_params:MessageCountTokensParams",
    ),
}
JOB_REQUEST = {
    "type": "object",
    "required": ["endpoint", "body"],
    "properties": {
        "endpoint": {"enum": list(SOURCES)},
        "body": {"type": "object", "description": "the request, as the endpoint takes it"},
    },
}


def generate() -> dict[str, Any]:
    """{component name: schema} for the three request types and the definitions they use, each
    definition named after its protocol so that equal names from two SDKs never collide."""
    import importlib

    from pydantic import TypeAdapter

    components: dict[str, Any] = {}
    for name, source in [*SOURCES.values(), *BATCH_SOURCES.values()]:
        module, _, attribute = source.partition(":")
        request_type = getattr(importlib.import_module(module), attribute)
        schema = TypeAdapter(request_type).json_schema(ref_template=f"#/components/schemas/{name}.{{model}}")
        for definition, body in schema.pop("$defs", {}).items():
            components[f"{name}.{definition}"] = body
        components[name] = schema
    return _sorted_enums(components)


def _sorted_enums(value: Any) -> Any:
    """Enums in a fixed order: pydantic lists a Literal's values in an order that varies by run."""
    if isinstance(value, dict):
        return {k: sorted(v, key=repr) if k == "enum" else _sorted_enums(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_sorted_enums(v) for v in value]
    return value


@cache
def components() -> dict[str, Any]:
    return {**json.loads(SCHEMA_FILE.read_text()), "JobRequest": JOB_REQUEST}


def request_body(component: str) -> dict[str, Any]:
    """An operation's requestBody referring to a component."""
    reference = {"$ref": f"#/components/schemas/{component}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": reference}}}}


if __name__ == "__main__":
    SCHEMA_FILE.write_text(json.dumps(generate(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SCHEMA_FILE}")
