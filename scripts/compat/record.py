"""A stand-in OpenAI-compatible server that records what clients send.

Every request is appended to a JSON-lines log (method, path, headers, body) and answered with a
minimal valid response, streamed as SSE when the body asks for it, so that the client goes on
as it would against a real server: the next request, the report, the exit code. The answers
carry exactly as many tokens as the body asked for (max_completion_tokens, max_tokens), and
usage says so, which lets the harness check its own parsing of each client's report.

    python scripts/compat/record.py --port 8123 --log requests.jsonl --model deepmesh-tiny

Standard library only: it runs under any Python, before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

WORD = " tok"  # one answer token: the clients only count and concatenate them


class Recorder(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], log_path: str, model: str) -> None:
        super().__init__(address, Handler)
        self.log_path = log_path
        self.model = model
        self.lock = threading.Lock()  # one JSON line at a time from the handler threads

    def record(self, entry: dict[str, Any]) -> None:
        with self.lock, open(self.log_path, "a", encoding="utf-8") as log:
            log.write(json.dumps(entry, ensure_ascii=False) + "\n")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the clients' connection pools expect
    server: Recorder

    def log_message(self, format: str, *args: Any) -> None:  # the JSON-lines log is the record
        pass

    def do_GET(self) -> None:
        self._record(None)
        path = self.path.split("?")[0]
        if path in ("/health", "/healthz"):
            self._json(200, {"status": "ok"})
        elif path == "/v1/models":
            model = {"id": self.server.model, "object": "model", "created": 0, "owned_by": "record"}
            self._json(200, {"object": "list", "data": [model]})
        else:
            self._json(404, {"error": {"message": f"not found: {path}", "type": "not_found"}})

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        self._record(body)
        path = self.path.split("?")[0]
        if not isinstance(body, dict) or path not in ("/v1/chat/completions", "/v1/completions"):
            self._json(404, {"error": {"message": f"not recorded here: {path}", "type": "not_found"}})
            return
        wanted = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        chat = path == "/v1/chat/completions"
        if body.get("stream"):
            self._stream(body, wanted, chat)
        elif chat:
            self._json(200, _chat(body, wanted))
        else:
            self._json(200, _completion(body, wanted))

    def _record(self, body: Any) -> None:
        self.server.record(
            {
                "time": time.time(),
                "method": self.command,
                "path": self.path,
                "headers": dict(self.headers.items()),
                "body": body,
            }
        )

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, body: dict[str, Any], wanted: int, chat: bool) -> None:
        # no Content-Length: the stream ends when the connection closes
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        options = body.get("stream_options") or {}
        base = {"id": "rec-1", "created": int(time.time()), "model": body.get("model") or self.server.model}
        base["object"] = "chat.completion.chunk" if chat else "text_completion"
        prompt = _prompt_tokens(body)
        for index in range(wanted):
            if chat:
                delta = {"role": "assistant", "content": WORD} if index == 0 else {"content": WORD}
                choice = {"index": 0, "delta": delta, "finish_reason": None}
            else:
                choice = {"index": 0, "text": WORD, "finish_reason": None}
            chunk = {**base, "choices": [choice]}
            if options.get("continuous_usage_stats"):
                chunk["usage"] = _usage(prompt, index + 1)
            self._event(chunk)
        last = {"index": 0, "finish_reason": "length"}
        last |= {"delta": {}} if chat else {"text": ""}
        self._event({**base, "choices": [last]})
        if options.get("include_usage"):
            self._event({**base, "choices": [], "usage": _usage(prompt, wanted)})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, payload: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _prompts(body: dict[str, Any]) -> list[Any]:
    """The prompts of a Completions body: a string, token ids, or a list of either."""
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return prompt
    return [prompt]


def _prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(str(message.get("content", "")).split()) for message in body["messages"])
    return sum(len(p) if isinstance(p, list) else len(p.split()) for p in _prompts(body))


def _chat(body: dict[str, Any], wanted: int) -> dict[str, Any]:
    message = {"role": "assistant", "content": WORD * wanted}
    return {
        "id": "rec-1",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model"),
        "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
        "usage": _usage(_prompt_tokens(body), wanted),
    }


def _completion(body: dict[str, Any], wanted: int) -> dict[str, Any]:
    choices = []
    for index, prompt in enumerate(_prompts(body)):
        # token ids stand for themselves; a text prompt counts one token a word
        pieces = [f"<{t}>" for t in prompt] if isinstance(prompt, list) else prompt.split()
        echoed = pieces if body.get("echo") else []
        text = "".join(echoed) + WORD * wanted
        choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": "length"}
        if body.get("logprobs") is not None:
            # the legacy logprobs object; with echo the prompt's tokens come first, the very first
            # one without a logprob (nothing precedes it), as OpenAI and vLLM answer
            tokens = echoed + [WORD] * wanted
            logprobs: list[float | None] = [-1.0] * len(tokens)
            tops: list[dict[str, float] | None] = [{token: -1.0} for token in tokens]
            if echoed:
                logprobs[0], tops[0] = None, None
            offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": logprobs,
                "top_logprobs": tops,
                "text_offset": offsets,
            }
        choices.append(choice)
    return {
        "id": "rec-1",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.get("model"),
        "choices": choices,
        "usage": _usage(_prompt_tokens(body), wanted * len(choices)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log", required=True, help="JSON-lines file the requests are appended to")
    parser.add_argument("--model", default="deepmesh-tiny", help="the model GET /v1/models lists")
    args = parser.parse_args()
    server = Recorder((args.host, args.port), args.log, args.model)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


if __name__ == "__main__":
    main()
