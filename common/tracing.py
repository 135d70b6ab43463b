"""One trace per job across every service and process.

The gateway starts a job's trace; every hop carries the W3C trace context onwards, in
Kafka record headers (`traceparent`) and in HTTP headers to the cache service, so spans
made in other processes join the same trace. Spans are per job and per stage, never per
token: a 128-token generation is about a dozen spans.

Exporters (DEEPMESH_TRACE_EXPORTER, comma-separated): `jsonl` appends one JSON object per
span to DEEPMESH_TRACE_FILE (what `deepmesh trace JOB_ID` reads), `console` prints spans,
`otlp` sends them over OTLP/HTTP to OTEL_EXPORTER_OTLP_ENDPOINT (Jaeger, Tempo, a
collector), `none` turns tracing off.
"""

from __future__ import annotations

import contextvars
import json
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Span, SpanKind

JOB_ID = "deepmesh.job_id"  # the span attribute `deepmesh trace` looks jobs up by
tracer = trace.get_tracer("deepmesh")  # a proxy: spans go to whichever provider setup_tracing installs
current_job: contextvars.ContextVar[str | None] = contextvars.ContextVar("current_job", default=None)


class JsonLinesExporter(SpanExporter):
    """Appends spans to a file, one JSON object per line; several processes may share the file.

    Past `max_bytes` the file becomes `<name>.1` (replacing the previous one) and a new one
    starts, so a long-running local deployment keeps at most twice that on disk.
    """

    def __init__(self, path: str | Path, max_bytes: int = 64 << 20):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(s), separators=(",", ":")) + "\n" for s in spans)
        with self._lock:
            with open(self.path, "a") as out:  # one write per batch: lines from processes don't interleave
                out.write(lines)
                full = out.tell() > self.max_bytes
            if full:
                os.replace(self.path, rotated(self.path))
        return SpanExportResult.SUCCESS


def rotated(path: Path) -> Path:
    return path.with_name(path.name + ".1")


def span_record(span: ReadableSpan) -> dict:
    context, parent = span.get_span_context(), span.parent
    return {
        "name": span.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "kind": span.kind.name,
        "service": span.resource.attributes.get("service.name"),
        "pid": span.resource.attributes.get("process.pid"),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
    }


def setup_tracing(service: str, exporters: str, trace_file: str | Path) -> None:
    """Install this process's tracer provider; call once, before the service starts."""
    names = [n.strip() for n in exporters.split(",") if n.strip() and n.strip() != "none"]
    if not names:
        return  # the API's default no-op provider: spans cost next to nothing
    resource = Resource.create({"service.name": f"deepmesh-{service}", "process.pid": os.getpid()})
    provider = TracerProvider(resource=resource)
    for name in names:
        if name == "jsonl":
            # written by a thread of the processor's own, every 0.1 s: a file append per span on
            # the thread that ends it stood in every request's path (a first token's included)
            exporter = JsonLinesExporter(trace_file)
            provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=100))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        else:
            raise ValueError(f"unknown trace exporter {name!r} (jsonl, console, otlp or none)")
    trace.set_tracer_provider(provider)


def http_telemetry() -> dict:
    """FastAPI's own tracing (an HTTP server span per request, continuing the caller's trace), without
    spans for health checks and metric scrapes, nor per-dependency spans."""
    untraced = {"/healthz", "/readyz", "/metrics"}
    return {"operation_spans": False, "metrics": False, "logs": False, "exclude": lambda s: s.get("path") in untraced}


def headers_of(span: Span) -> dict[str, bytes]:
    """The W3C headers that make a span the parent of whatever the receiver does next."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return {k: v.encode() for k, v in carrier.items()}


def context_of(headers: Mapping[str, bytes] | Mapping[str, str] | None) -> Context:
    """The trace context a record (or HTTP request) carries; an empty one starts a new trace."""
    carrier = {k: (v.decode(errors="replace") if isinstance(v, bytes) else v) for k, v in (headers or {}).items()}
    return propagate.extract(carrier)


def sender_span(headers: Mapping[str, bytes] | None) -> Span:
    """The span that produced a record (not recording here): what a log line about the record belongs to."""
    return trace.get_current_span(context_of(headers))


def start_span(
    name: str, job_id: str, parent: Context | Span | None = None, kind: SpanKind = SpanKind.INTERNAL, **attributes
) -> Span:
    """A span of a job's trace, to be ended by the caller (it may outlive the current call)."""
    if isinstance(parent, Span):
        parent = trace.set_span_in_context(parent)
    return tracer.start_span(name, context=parent, kind=kind, attributes={JOB_ID: job_id, **attributes})


@contextmanager
def within(span: Span, job_id: str, end: bool = False) -> Iterator[Span]:
    """Make `span` current, and `job_id` the job of every log line, for the enclosed work."""
    token = current_job.set(job_id)
    try:
        with trace.use_span(span, end_on_exit=end):
            yield span
    finally:
        current_job.reset(token)


@contextmanager
def job_span(
    name: str, job_id: str, parent: Context | Span | None = None, kind: SpanKind = SpanKind.INTERNAL, **attributes
) -> Iterator[Span]:
    """A span around the enclosed work, current while it runs."""
    with within(start_span(name, job_id, parent, kind, **attributes), job_id, end=True) as span:
        yield span


def read_spans(path: str | Path) -> list[dict]:
    """The spans in a trace file and in its rotated predecessor."""
    spans = []
    for part in (rotated(Path(path)), Path(path)):
        if not part.is_file():
            continue
        with open(part) as lines:
            for line in lines:
                try:
                    spans.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut short by a process killed mid-write
    return spans


def job_trace(spans: list[dict], job_id: str) -> list[dict]:
    """Every span of the trace(s) a job's spans belong to, in start order."""
    trace_ids = {s["trace_id"] for s in spans if s["attributes"].get(JOB_ID) == job_id}
    return sorted((s for s in spans if s["trace_id"] in trace_ids), key=lambda s: s["start_ns"])


def format_tree(spans: list[dict]) -> str:
    """The span tree, children under parents, with each span's duration and start offset."""
    if not spans:
        return ""
    ids = {s["span_id"] for s in spans}
    children: dict[str | None, list[dict]] = {}
    for span in spans:
        parent = span["parent_id"] if span["parent_id"] in ids else None
        children.setdefault(parent, []).append(span)
    origin = min(s["start_ns"] for s in spans)
    lines = [f"trace {', '.join(sorted({s['trace_id'] for s in spans}))}"]

    def walk(parent: str | None, depth: int) -> None:
        for span in children.get(parent, []):
            took = (span["end_ns"] - span["start_ns"]) / 1e6
            offset = (span["start_ns"] - origin) / 1e6
            orphan = " (parent not recorded)" if depth == 0 and span["parent_id"] else ""
            label = f"{'  ' * depth}{span['name']}"
            where = f"{span['service']}[{span['pid']}]"
            lines.append(f"{label:<48} {where:<28} {took:>10.2f} ms  @ +{offset:.2f} ms{orphan}")
            walk(span["span_id"], depth + 1)

    walk(None, 0)
    return "\n".join(lines)
