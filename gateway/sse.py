"""Server-Sent Events framing: what the gateway writes for a stream and for a job's replay."""

from __future__ import annotations

from common.messages import ResultPayload


def frame(name: str | None, data: str) -> str:
    """One event: `event:` when the protocol names it, then `data:`."""
    return f"event: {name}\ndata: {data}\n\n" if name else f"data: {data}\n\n"


def result_frames(results: list[ResultPayload]) -> bytes:
    """The events of results messages that arrived together, as one write; the last message's
    final data (Chat Completions' [DONE]) after its events."""
    frames = []
    for result in results:
        frames += [frame(event.name, event.data) for event in result.events]
        if result.done and result.done_data is not None:
            frames.append(frame(None, result.done_data))
    return "".join(frames).encode()
