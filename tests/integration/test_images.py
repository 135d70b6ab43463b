"""Images in requests, over the embedded mesh serving the tiny-v41 preset (its vision tower): the
official SDKs send them, the tokenizer resolves them with deepseek-recipe, the encoder stage
stores their rows by content, prefill reads them from the KV cache.

The oracles: deepseek-recipe's own count of an image's tokens (`image_token_adjustment`) for the
usage, and a one-process run of the engine for the answer (tests/support/behaviour.py: the rows
come from the checkpoint's vision tower there, which tests/unit/test_vision.py holds against
DeepInfer's). Every bad image is a 400 naming the problem while a well-formed request beside
it is answered.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import threading
import time
from collections.abc import Iterator

import anthropic
import deepseek_recipe as recipe
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from common.messages import DeadLetter, Envelope
from common.topics import Topic, topic_name
from tests.support.batch_behaviour import jsonl, lines_of, openai_ended, wait_for_batch
from tests.support.behaviour import GREEDY, MODEL, SDKClients, one_process_answer, wait_for_status
from tests.support.infra import thread_cpu_seconds
from tokenizer_svc.images import ImagePolicy


@pytest.fixture(scope="module")
def model(tiny_v41_preset):
    return tiny_v41_preset


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """An image host on loopback: /photo.png is an image, anything else never answers."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ImageHost)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class ImageHost(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path != "/photo.png":
            time.sleep(30)
            return
        body = png(700, 500, seed=21)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def mesh_options() -> dict:
    """The image host above is the operator's allowed network; a fetch has 5 s."""
    return {"image_policy": ImagePolicy(allowed_networks=("127.0.0.1/32",), total_seconds=5.0)}


@pytest.fixture
def url(service):
    return service.url


def png(width: int, height: int, seed: int = 0, kind: str = "PNG") -> bytes:
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, kind)
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def chat(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def recipe_prompt_tokens(model, endpoint: str, body: dict) -> int:
    """The prompt's length by deepseek-recipe alone: its encoding (one placeholder per image) plus
    its count of the images' tokens beyond their placeholders."""
    from tokenizer_svc.protocol import ENDPOINTS

    options = recipe.ConversionOptions().with_default_thinking_mode(False)  # as `deepmesh serve` runs
    options = options.with_model_alias(MODEL, recipe.ModelVersion.DeepseekV41Flash)
    converted = ENDPOINTS[endpoint][0](body).convert(options)
    encoding = recipe.DeepseekV41Encoding().with_tokenizer(recipe.Tokenizer.from_file(str(model / "tokenizer.json")))
    sources = encoding.render_conversation(converted.conversation).image_sources
    resolver = recipe.ImageResolver(recipe.ReqwestImageFetcher(), recipe.OpenCvImagePreprocessor())
    extra = resolver.resolve(sources, recipe.ImageQuota()).image_token_adjustment()
    return len(encoding.encode(converted.conversation)) + extra


def messages_body(body: dict) -> dict:
    """An SDK call's keywords as the JSON body it sends (`extra_body` merged in)."""
    return {k: v for k, v in body.items() if k != "extra_body"} | body.get("extra_body", {})


def cached_after_repeat(prompt_tokens: int, keep: int) -> int:
    """What a repeat of a V4.1 prompt reports as cached: all but the tokens it always computes
    (bounded replay, KEEP), where its first run stored its state."""
    return prompt_tokens - keep


class TestImages(SDKClients):
    def test_the_openai_sdk_sends_an_image_counted_answered_and_cached_when_repeated(self, service, oai, model):
        """A data URL through Chat Completions: usage counts the image's tokens as the recipe does,
        the answer is a one-process run's, and the same image again reports cached tokens."""
        messages = chat(
            {"type": "text", "text": "What is in this picture?"}, image_part(data_url(png(1000, 800, seed=1)))
        )
        body = {"model": MODEL, "messages": messages, "max_tokens": 6, **GREEDY}
        encoder = service.mesh.encoder
        first = oai.chat.completions.create(**body)
        encoded = encoder.encoded
        expected = recipe_prompt_tokens(model, "chat.completions", messages_body(body))
        assert expected > 300  # the image's tokens, not one placeholder
        assert first.usage.prompt_tokens == expected
        alone = one_process_answer(model, {**messages_body(body)})
        assert first.choices[0].message.content == alone["choices"][0]["message"]["content"]
        again = oai.chat.completions.create(**body)
        keep = service.mesh.prefill.engine.config.prefill_keep_tokens
        assert again.usage.prompt_tokens_details.cached_tokens == cached_after_repeat(expected, keep) > 0
        assert again.choices[0].message.content == first.choices[0].message.content
        assert encoder.encoded == encoded  # encoded once: the repeat found its rows in the cache

    def test_prompts_that_differ_only_in_their_image_share_nothing_past_it(self, service, oai):
        question = {"type": "text", "text": "Describe it. " * 40}
        bodies = [
            {"model": MODEL, "messages": chat(image_part(data_url(png(900, 700, seed=s))), question), "max_tokens": 2}
            for s in (5, 6)
        ]
        oai.chat.completions.create(**bodies[0], **GREEDY)
        other = oai.chat.completions.create(**bodies[1], **GREEDY)
        # the image comes after a short system prefix: nothing a full block long is shared
        assert not (other.usage.prompt_tokens_details and other.usage.prompt_tokens_details.cached_tokens)

    def test_the_anthropic_sdk_sends_base64_image_blocks(self, service, claude, model):
        image = base64.b64encode(png(1000, 800, seed=2)).decode()
        content = [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": image}},
            {"type": "text", "text": "What is this?"},
        ]
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
        first = claude.messages.create(**body, thinking={"type": "disabled"}, extra_body={"temperature": 0})
        expected = recipe_prompt_tokens(model, "messages", {**body, "thinking": {"type": "disabled"}})
        assert first.usage.input_tokens == expected
        again = claude.messages.create(**body, thinking={"type": "disabled"}, extra_body={"temperature": 0})
        keep = service.mesh.prefill.engine.config.prefill_keep_tokens
        assert again.usage.cache_read_input_tokens == cached_after_repeat(expected, keep) > 0
        assert again.content[0].text == first.content[0].text

    def test_responses_input_image(self, oai, model):
        content = [{"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": data_url(png(64, 48))}]
        body = {"model": MODEL, "input": [{"role": "user", "content": content}], "max_output_tokens": 16}
        response = oai.responses.create(**body)
        assert response.usage.input_tokens == recipe_prompt_tokens(model, "responses", body)

    @pytest.mark.parametrize(
        ("parts", "problem"),
        [
            ([image_part(data_url(b"\x89PNG\r\n\x1a\nnot an image"))], "is corrupt or not an image"),
            ([image_part(data_url(png(64, 48)[:300]))], "is truncated"),
            ([image_part(data_url(png(20, 20, kind="BMP"), "image/bmp"))], "unsupported image"),
            ([image_part(data_url(png(20, 20, kind="BMP")))], "unsupported type"),  # a BMP that says it is a PNG
            ([image_part("data:image/png;base64,!!!")], "Invalid base64"),
            ([image_part("http://169.254.169.254/latest/meta-data/")], "public addresses only"),
            ([image_part("http://127.0.0.2:1/x.png")], "public addresses only"),
            ([image_part("http://[::ffff:10.0.0.1]/x.png")], "public addresses only"),
            ([image_part("file:///etc/passwd")], "image_url"),
            ([image_part(data_url(png(20, 20, seed=i))) for i in range(17)], "17 images: at most 16 a request"),
        ],
        ids=[
            "corrupt",
            "truncated",
            "bmp",
            "bmp-as-png",
            "bad-data-url",
            "metadata-service",
            "loopback",
            "mapped-private",
            "file",
            "too-many",
        ],
    )
    def test_a_bad_image_is_a_400_naming_it_while_a_good_request_is_answered(self, oai, parts, problem):
        answered = []
        beside = threading.Thread(
            target=lambda: answered.append(
                oai.chat.completions.create(
                    model=MODEL,
                    messages=chat({"type": "text", "text": "and this?"}, image_part(data_url(png(64, 48, seed=9)))),
                    max_tokens=3,
                    **GREEDY,
                )
            )
        )
        beside.start()
        with pytest.raises(openai.BadRequestError) as refused:
            oai.chat.completions.create(model=MODEL, messages=chat({"type": "text", "text": "x"}, *parts), max_tokens=3)
        beside.join(timeout=120)
        assert refused.value.status_code == 400 and problem in refused.value.message
        assert answered and answered[0].choices[0].finish_reason in ("stop", "length")

    def test_an_image_url_that_never_answers_times_out_alone(self, oai, image_host):
        """A slow image host holds its own request to the fetch's time limit and no other: a request
        sent meanwhile is answered first. Nor does the wait cost a core: the tokenizer's thread, busy
        only waiting for the image, waits, where it polled without pause (5 CPU-seconds of its 5 s)."""
        tokenizer = next(t for t in threading.enumerate() if t.name == "tokenizer")
        answered: list[float] = []
        messages = chat({"type": "text", "text": "meanwhile"}, image_part(data_url(png(64, 48, seed=12))))
        oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **GREEDY)  # warm: the rest is fixed

        def beside() -> None:
            time.sleep(0.5)  # once the slow one is being fetched
            oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **GREEDY)
            answered.append(time.monotonic())

        thread = threading.Thread(target=beside)
        started, cpu = time.monotonic(), thread_cpu_seconds(tokenizer)
        thread.start()
        with pytest.raises(openai.BadRequestError, match="timed out"):
            oai.chat.completions.create(model=MODEL, messages=chat(image_part(f"{image_host}/never.png")), max_tokens=2)
        refused = time.monotonic()
        waited, used = refused - started, thread_cpu_seconds(tokenizer) - cpu
        thread.join(timeout=60)
        assert answered and answered[0] < refused
        assert used < 0.2 * waited, f"the tokenizer's thread used {used:.2f} CPU-seconds of {waited:.1f} s"

    def test_image_urls_are_fetched_for_both_sdks(self, oai, claude, image_host, model):
        """An http URL (the image host is an allowed network here): the same image and count as the
        same bytes sent as a data URL."""
        url = f"{image_host}/photo.png"
        question = {"type": "text", "text": "What is it?"}
        by_url = chat(question, image_part(url))
        by_data = chat(question, image_part(data_url(png(700, 500, seed=21))))
        fetched = oai.chat.completions.create(model=MODEL, messages=by_url, max_tokens=3, **GREEDY)
        sent = oai.chat.completions.create(model=MODEL, messages=by_data, max_tokens=3, **GREEDY)
        assert fetched.usage.prompt_tokens == sent.usage.prompt_tokens > 200  # the image, not a placeholder
        assert fetched.choices[0].message.content == sent.choices[0].message.content
        source = {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(png(700, 500, seed=21)).decode(),
        }
        for image in ({"type": "url", "url": url}, source):
            content = [{"type": "image", "source": image}, question]
            body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": content}]}
            message = claude.messages.create(**body, thinking={"type": "disabled"})
            counted = recipe_prompt_tokens(model, "messages", {**body, "thinking": {"type": "disabled"}})
            assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == counted

    def test_an_anthropic_image_url_to_the_metadata_service_is_a_400(self, claude):
        content = [{"type": "image", "source": {"type": "url", "url": "http://169.254.169.254/latest/"}}]
        with pytest.raises(anthropic.BadRequestError, match="public addresses only"):
            claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": content}])

    def test_async_jobs_and_batches_carry_images(self, service, oai, model):
        """An image through the async jobs API and through a batch (the OpenAI SDK's files and
        batches), each answered as the same request sent alone, its image counted."""
        body = {
            "model": MODEL,
            "messages": chat({"type": "text", "text": "What colour?"}, image_part(data_url(png(320, 240, seed=4)))),
            "max_tokens": 4,
            **messages_body(GREEDY),
        }
        alone = oai.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=4, **GREEDY)
        job = httpx.post(f"{service.url}/v1/jobs", json={"endpoint": "chat.completions", "body": body}, timeout=30)
        assert job.status_code == 202
        done = wait_for_status(service.url, job.json()["id"], {"succeeded", "failed"})
        assert done["status"] == "succeeded", done
        assert done["result"]["choices"][0]["message"]["content"] == alone.choices[0].message.content
        assert (
            done["usage"]["prompt_tokens"]
            == alone.usage.prompt_tokens
            == recipe_prompt_tokens(model, "chat.completions", body)
        )
        lines = [
            {"custom_id": f"img-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body} for i in range(3)
        ]
        upload = oai.files.create(file=("images.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = oai.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        batch = wait_for_batch(oai.batches.retrieve, batch.id, openai_ended)
        assert batch.status == "completed" and batch.request_counts.completed == 3, batch
        for line in lines_of(oai, batch.output_file_id):
            completion = openai.types.chat.ChatCompletion.model_validate(line["response"]["body"])
            assert completion.choices[0].message.content == alone.choices[0].message.content
            assert completion.usage.prompt_tokens == alone.usage.prompt_tokens

    def test_an_encode_message_whose_bytes_are_not_its_image_goes_to_the_dead_letter_topic(self, service, oai):
        """A record on `encode` (a public topic's neighbour: anyone on the broker can write one) whose
        bytes do not hash to the digest it names is parked with the reason; the encoder goes on."""
        digest = hashlib.sha256(b"one image").hexdigest()
        prefill = {
            "endpoint": "chat.completions",
            "prompt_token_ids": [1, 2, 3],
            "sampling": {"max_tokens": 1, "temperature": 0, "top_p": 1},
            "images": [{"digest": digest, "start": 1, "num_tokens": 1}],
        }
        images = [{"digest": digest, "data": base64.b64encode(b"another image").decode()}]
        envelope = Envelope(type="encode", job_id="forged-1", payload={"prefill": prefill, "images": images})
        letters = service.bus.consumer([topic_name(Topic.DEAD_LETTER, service.prefix)], group="images-dlq")
        service.bus.produce(topic_name(Topic.ENCODE, service.prefix), "forged-1", envelope.encode())
        found, deadline = [], time.monotonic() + 60
        while not found and time.monotonic() < deadline:
            found = [DeadLetter.model_validate_json(r.value) for r in letters.poll(timeout=0.5) if r.key == "forged-1"]
        letters.close()
        assert found and "not the image the digest names" in found[0].reason
        reply = oai.chat.completions.create(
            model=MODEL, messages=chat(image_part(data_url(png(64, 48, seed=11)))), max_tokens=2, **GREEDY
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
