"""Batches as the official SDKs use them, whatever the deployment (see tests/behaviour.py):
OpenAI's Files and Batch API, Anthropic's Message Batches."""

from __future__ import annotations

import io
import json
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest

from tests.support.behaviour import GREEDY, MODEL, SDKClients

PROMPTS = [f"Question {i}: what does a Kafka broker keep?" for i in range(20)]


def chat_line(custom_id: str, prompt: str, max_tokens: int = 6, **extra) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {**body, **extra}}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def answers_alone(oai: openai.OpenAI, prompts: list[str], max_tokens: int) -> dict[str, str]:
    """Each prompt's greedy answer as a request of its own (all sent at once), by prompt."""

    def ask(prompt: str) -> str:
        messages = [{"role": "user", "content": prompt}]
        reply = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, **GREEDY)
        return reply.choices[0].message.content

    with ThreadPoolExecutor(len(prompts)) as pool:
        return dict(zip(prompts, pool.map(ask, prompts), strict=True))


def wait_for_batch(retrieve, batch_id: str, ended, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while True:
        batch = retrieve(batch_id)
        if ended(batch):
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch}"
        time.sleep(0.25)


def openai_ended(batch) -> bool:
    return batch.status in ("completed", "failed", "expired", "cancelled")


def lines_of(oai: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in oai.files.content(file_id).text.splitlines() if x.strip()]


class BatchBehaviour(SDKClients):
    @pytest.fixture
    def url(self, service) -> str:
        return service.url

    def test_a_batch_answers_every_custom_id_as_the_request_alone_would(self, oai):
        """100 lines, more than run at once (64 by default): the runner sends them over rounds."""
        alone = answers_alone(oai, PROMPTS, max_tokens=6)
        lines = [chat_line(f"req-{i}", PROMPTS[i % len(PROMPTS)], thinking={"type": "disabled"}) for i in range(100)]
        lines.append(chat_line("no-messages", "x") | {"body": {"model": MODEL, "max_tokens": 4}})  # fails alone
        upload = oai.files.create(file=("requests.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        assert upload.purpose == "batch" and upload.bytes == len(jsonl(lines))
        assert oai.files.retrieve(upload.id).filename == "requests.jsonl"
        batch = oai.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"run": "a"}
        )
        assert batch.status == "validating" and batch.metadata == {"run": "a"}
        batch = wait_for_batch(oai.batches.retrieve, batch.id, openai_ended)
        assert batch.status == "completed", batch
        assert batch.request_counts.total == 101
        assert (batch.request_counts.completed, batch.request_counts.failed) == (100, 1)
        assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
        output = lines_of(oai, batch.output_file_id)
        assert sorted(line["custom_id"] for line in output) == sorted(f"req-{i}" for i in range(100))
        for line in output:
            prompt = PROMPTS[int(line["custom_id"].split("-")[1]) % len(PROMPTS)]
            assert line["response"]["status_code"] == 200 and line["error"] is None
            # the SDK's own parser reads each answer as a chat completion
            completion = openai.types.chat.ChatCompletion.model_validate(line["response"]["body"])
            assert completion.choices[0].message.content == alone[prompt], line["custom_id"]
        (failed,) = lines_of(oai, batch.error_file_id)
        assert failed["custom_id"] == "no-messages" and failed["response"]["status_code"] == 400
        assert failed["response"]["body"]["error"]["message"]
        assert batch.usage.output_tokens == 100 * 6 and batch.usage.input_tokens > 100

        listed = oai.batches.list(limit=1)
        assert len(listed.data) == 1 and listed.data[0].id == batch.id and listed.has_more is not None
        assert oai.files.delete(upload.id).deleted
        with pytest.raises(openai.NotFoundError):
            oai.files.retrieve(upload.id)

    def test_an_input_file_that_is_not_a_batch_fails_it_with_every_bad_line(self, oai):
        good = chat_line("a", "hi")
        text = (
            jsonl([good])
            + b"{not json\n"
            + jsonl([good])  # the same custom_id again
            + jsonl([{**chat_line("c", "hi"), "url": "/v1/embeddings"}])
            + jsonl([{"method": "POST", "url": "/v1/chat/completions", "body": {}}])
        )
        upload = oai.files.create(file=("bad.jsonl", io.BytesIO(text)), purpose="batch")
        batch = oai.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        batch = wait_for_batch(oai.batches.retrieve, batch.id, openai_ended)
        assert batch.status == "failed" and batch.failed_at
        found = {(e.line, e.code) for e in batch.errors.data}
        assert found == {
            (2, "invalid_json_line"),
            (3, "duplicate_custom_id"),
            (4, "invalid_url"),
            (5, "missing_required_parameter"),
        }
        assert oai.files.retrieve(upload.id).id == upload.id  # the file is kept: fix it and submit again

        with pytest.raises(openai.BadRequestError, match="endpoint"):
            oai.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
        with pytest.raises(openai.BadRequestError, match="input_file_id"):
            oai.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
        with pytest.raises(openai.BadRequestError, match="purpose"):
            oai.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")

    def test_more_than_50000_requests_fail_validation(self, oai):
        line = json.dumps(chat_line("x", "hi")).encode()
        text = b"".join(line.replace(b'"x"', f'"r{i}"'.encode()) + b"\n" for i in range(50_001))
        upload = oai.files.create(file=("big.jsonl", io.BytesIO(text)), purpose="batch")
        batch = oai.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        batch = wait_for_batch(oai.batches.retrieve, batch.id, openai_ended)
        assert batch.status == "failed" and [e.code for e in batch.errors.data] == ["too_many_requests"]

    def test_a_file_over_200_mb_is_refused_with_413(self, url):
        def body():
            yield b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
            for _ in range(201):
                yield b"x" * (1 << 20)
            yield b"\r\n--b--\r\n"

        headers = {"Content-Type": "multipart/form-data; boundary=b"}
        response = httpx.post(f"{url}/v1/files", content=body(), headers=headers, timeout=120)
        assert response.status_code == 413 and "200 MB" in response.json()["error"]["message"]

    def test_cancel_stops_the_rest_and_keeps_what_finished(self, oai):
        lines = [chat_line(f"r{i}", PROMPTS[i % len(PROMPTS)], max_tokens=12) for i in range(300)]
        upload = oai.files.create(file=("many.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = oai.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_for_batch(oai.batches.retrieve, batch.id, lambda b: b.request_counts and b.request_counts.completed > 0)
        cancelling = oai.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        batch = wait_for_batch(oai.batches.retrieve, batch.id, openai_ended)
        assert batch.status == "cancelled" and batch.cancelled_at
        done = lines_of(oai, batch.output_file_id)
        stopped = lines_of(oai, batch.error_file_id)
        assert 0 < len(done) < 300 and len(done) + len(stopped) == 300
        assert {line["error"]["code"] for line in stopped} == {"batch_cancelled"}
        assert all(line["response"]["status_code"] == 200 for line in done)

    def test_anthropic_message_batches(self, claude, url):
        question = [{"role": "user", "content": "What is a Kafka partition?"}]
        greedy = {"temperature": 0, "thinking": {"type": "disabled"}}
        alone = claude.messages.create(model=MODEL, max_tokens=6, messages=question, extra_body=greedy)
        params = {"model": MODEL, "max_tokens": 6, "messages": question, **greedy}
        requests = [{"custom_id": f"q{i}", "params": params} for i in range(5)]
        requests.append({"custom_id": "no-max-tokens", "params": {"model": MODEL, "messages": question}})
        batch = claude.messages.batches.create(requests=requests)
        assert batch.processing_status == "in_progress" and batch.request_counts.processing == 6
        batch = wait_for_batch(claude.messages.batches.retrieve, batch.id, lambda b: b.processing_status == "ended")
        assert (batch.request_counts.succeeded, batch.request_counts.errored) == (5, 1) and batch.ended_at
        results = {r.custom_id: r.result for r in claude.messages.batches.results(batch.id)}
        assert set(results) == {r["custom_id"] for r in requests}
        for i in range(5):
            assert results[f"q{i}"].type == "succeeded"
            answer = results[f"q{i}"].message  # the SDK's own parser reads each as a Message
            assert [b.model_dump() for b in answer.content] == [b.model_dump() for b in alone.content]
        assert results["no-max-tokens"].type == "errored"
        assert results["no-max-tokens"].error.error.type == "invalid_request_error"
        assert batch.id in [b.id for b in claude.messages.batches.list(limit=5)]
        assert claude.messages.batches.delete(batch.id).type == "message_batch_deleted"
        with pytest.raises(anthropic.NotFoundError):
            claude.messages.batches.retrieve(batch.id)

        with pytest.raises(anthropic.BadRequestError, match="more than once"):
            claude.messages.batches.create(requests=[requests[0], requests[0]])
        many = [
            {**requests[0], "custom_id": f"c{i}", "params": {**requests[0]["params"], "max_tokens": 24}}
            for i in range(200)
        ]
        batch = claude.messages.batches.create(requests=many)
        with pytest.raises(anthropic.BadRequestError, match="still processing"):
            claude.messages.batches.delete(batch.id)
        assert claude.messages.batches.cancel(batch.id).processing_status in ("canceling", "ended")
        batch = wait_for_batch(claude.messages.batches.retrieve, batch.id, lambda b: b.processing_status == "ended")
        counts = batch.request_counts
        assert counts.canceled > 0 and counts.succeeded + counts.canceled == 200
        kinds = {r.result.type for r in claude.messages.batches.results(batch.id)}
        assert "canceled" in kinds
