"""The JSON-lines trace file that `deepmesh trace` reads (the cross-process trace is tested in
tests/system/test_distributed.py)."""

from __future__ import annotations


def test_the_trace_file_rotates_and_is_read_across_the_rotation(tmp_path):
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from common.tracing import JOB_ID, JsonLinesExporter, job_trace, read_spans

    path = tmp_path / "traces.jsonl"
    provider = TracerProvider(resource=Resource.create({"service.name": "deepmesh-test"}))
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path, max_bytes=2000)))
    tracer = provider.get_tracer("test")
    for i in range(12):
        with (
            tracer.start_as_current_span("root", attributes={JOB_ID: f"job-{i}"}),
            tracer.start_as_current_span("child", attributes={JOB_ID: f"job-{i}"}),
        ):
            pass
    provider.shutdown()
    assert (tmp_path / "traces.jsonl.1").is_file() and path.stat().st_size <= 2000 + 1000
    spans = read_spans(path)
    assert len(spans) < 24  # the oldest went with the rotation before last
    last = job_trace(spans, "job-11")
    assert [s["name"] for s in last] == ["root", "child"] and last[1]["parent_id"] == last[0]["span_id"]
