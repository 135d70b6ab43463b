"""A client of the mesh's topics, written from the documented contract (requests in, results
out), and the answer one process gives to the same request."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from common.messages import Envelope, RequestPayload, ResultPayload, decode
from common.topics import Topic, topic_name
from engine import LLMEngine, SamplingParams
from tests.support.models import reference_engine
from tokenizer_svc.protocol import Codec

MODEL = "deepmesh-tiny"


def submit(mesh, endpoint: str, body: dict, priority: str = "interactive") -> str:
    job_id = uuid.uuid4().hex
    payload = RequestPayload(endpoint=endpoint, body=body, priority=priority).model_dump()
    envelope = Envelope(type="request", job_id=job_id, payload=payload)
    mesh.bus.produce(topic_name(Topic.REQUESTS, mesh.prefix), job_id, envelope.encode())
    return job_id


def collect(mesh, job_ids: set[str], timeout: float = 120) -> dict[str, list[ResultPayload]]:
    """Each job's results as a client written from the documented contract reads them: a
    message's seq is the index of its first event; events a replay repeats are skipped."""
    consumer = mesh.bus.consumer([topic_name(Topic.RESULTS, mesh.prefix)], group=f"client-{uuid.uuid4().hex[:8]}")
    results: dict[str, list[ResultPayload]] = {}
    have: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            for record in consumer.poll(timeout=0.5):
                envelope = decode(record.value, "result")
                job_id, result = envelope.job_id, ResultPayload.model_validate(envelope.payload)
                if job_id not in job_ids or (results.get(job_id) and results[job_id][-1].done):
                    continue
                known = have.get(job_id, 0)
                assert envelope.seq <= known, f"results of {job_id} skip from event {known} to {envelope.seq}"
                fresh = result.events[known - envelope.seq :]
                if fresh or result.done:
                    results.setdefault(job_id, []).append(result.model_copy(update={"events": fresh}))
                have[job_id] = max(known, envelope.seq + len(result.events))
            if all(results.get(j) and results[j][-1].done for j in job_ids):
                return results
    finally:
        consumer.close()
    raise AssertionError(f"results incomplete after {timeout}s: { ({j: len(r) for j, r in results.items()}) }")


def _one_process(model: Path) -> tuple[LLMEngine, Codec]:
    engine = reference_engine(model)
    return engine, Codec(model / "tokenizer.json", [MODEL], engine.max_model_len, set(engine.config.eos_token_ids))


def reference_body(model: Path, endpoint: str, body: dict) -> dict:
    """The same request in one process: engine.generate, then the same output conversion."""
    engine, codec = _one_process(model)
    prompt = codec.prompt(endpoint, body)
    params = SamplingParams(max_tokens=prompt.max_tokens, temperature=prompt.temperature, top_p=prompt.top_p, seed=7)
    generated = engine.generate([prompt.token_ids], params)[0]
    out = codec.output(endpoint, body, "ref")
    out.start(len(prompt.token_ids))
    out.tokens(generated.token_ids)
    out.finish(generated.finish_reason)
    return out.body()


BODIES = {
    "chat.completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about Kafka."}],
        "max_tokens": 24,
        "temperature": 0,
        "seed": 7,
    },
    # thinking mode samples at temperature 1 (here with a seed); without it, 0 is greedy
    "responses": {
        "model": MODEL,
        "input": "Tell me about Kafka.",
        "max_output_tokens": 24,
        "temperature": 0,
        "reasoning": {"effort": "none"},
    },
    "messages": {
        "model": MODEL,
        "max_tokens": 24,
        "temperature": 0,
        "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "Tell me about Kafka."}],
    },
}
