"""DeepSeek-V4.1 through the distributed mesh: every service its own OS process over real Apache
Kafka, prefill handing its state to decode through the cache service. The answers are the ones a
single process computes (which the embedded mesh's are too: tests/integration/test_gateway_v41.py)."""

from __future__ import annotations

import base64
import io
import re

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.support.behaviour import GREEDY, MODEL, one_process_answers
from tests.support.cluster import Cluster


@pytest.fixture(scope="module")
def cluster(tiny_v41_preset, tmp_path_factory):
    running = Cluster(tmp_path_factory.mktemp("cluster-v41"), tiny_v41_preset)
    try:
        yield running.start(("cache", "gateway", "tokenizer", "encoder", "prefill", "decode"))
    finally:
        running.stop()


def loaded_handoffs(cluster: Cluster) -> float:
    scraped = httpx.get(cluster.decode_metrics).text
    found = re.search(r'^deepmesh_state_handoffs_total\{outcome="loaded"\} (\S+)$', scraped, re.M)
    return float(found.group(1)) if found else 0.0


def test_greedy_answers_and_cached_prefixes_are_one_process_ones(cluster, tiny_v41_preset):
    """Chat (a system message: V4.1's own `<｜System｜>` token), Messages and token-id completions
    answer as one process does (the repeat with the same logprobs), decode starting from the state prefill stored; a
    repeated 600-token prompt reports the last block before its kept tokens as cached."""
    oai = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)
    claude = anthropic.Anthropic(base_url=cluster.url, api_key="unused", max_retries=0, timeout=120)
    system = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is Kafka?"}]
    long_prompt = [(7 * i + 11) % 100_000 + 3 for i in range(600)]
    chat = {"model": MODEL, "messages": system, "max_tokens": 12}
    messages = {"model": MODEL, "messages": system[1:], "system": "Answer briefly.", "max_tokens": 8}
    messages |= {"temperature": 0, "thinking": {"type": "disabled"}}
    completion = {"model": MODEL, "prompt": long_prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    greedy_chat = {**chat, "temperature": 0, **GREEDY["extra_body"]}
    expected = one_process_answers(
        tiny_v41_preset, [("chat.completions", greedy_chat), ("messages", messages), ("completions", completion)]
    )

    reply = oai.chat.completions.create(**chat, **GREEDY)
    assert reply.choices[0].message.content == expected[0]["choices"][0]["message"]["content"]
    assert reply.usage.prompt_tokens == expected[0]["usage"]["prompt_tokens"]
    message = claude.messages.create(
        **{k: v for k, v in messages.items() if k != "temperature"}, extra_body={"temperature": 0}
    )
    assert [block.model_dump(exclude_none=True) for block in message.content] == expected[1]["content"]
    first = oai.completions.create(**completion)
    again = oai.completions.create(**completion)
    assert first.choices[0].text == again.choices[0].text == expected[2]["choices"][0]["text"]
    logprobs = first.choices[0].logprobs.token_logprobs
    assert len(logprobs) == 6 and again.choices[0].logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-4)
    assert again.usage.prompt_tokens_details.cached_tokens == 600 - 140
    assert loaded_handoffs(cluster) == 4  # every decode started from what prefill stored (a fresh cluster)


def test_an_image_is_encoded_by_its_own_process_and_its_repeat_is_cached(cluster, tiny_v41_preset):
    """A data URL over the OpenAI SDK: the tokenizer resolves it, the encoder process stores its rows
    in the cache service, prefill and decode read them there; the answer and usage are one
    process's, and the same image and prompt again reports its reusable prefix as cached."""
    oai = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)
    pixels = (np.random.default_rng(7).random((800, 1000, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    content = [{"type": "text", "text": "What is in this picture?"}, {"type": "image_url", "image_url": {"url": url}}]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 6}
    (expected,) = one_process_answers(
        tiny_v41_preset, [("chat.completions", {**chat, "temperature": 0, **GREEDY["extra_body"]})]
    )
    first = oai.chat.completions.create(**chat, **GREEDY)
    assert first.choices[0].message.content == expected["choices"][0]["message"]["content"]
    assert first.usage.prompt_tokens == expected["usage"]["prompt_tokens"] > 500
    again = oai.chat.completions.create(**chat, **GREEDY)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 140
