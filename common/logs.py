"""Logs as JSON lines carrying the job id and trace id, so a job's lines can be found next to its trace.

DEEPMESH_LOG_FORMAT=json (the default) or text; DEEPMESH_LOG_LEVEL (default WARNING).
"""

from __future__ import annotations

import json
import logging
import time

from opentelemetry import trace

from common.tracing import current_job


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        job_id = getattr(record, "job_id", None) or current_job.get()
        if job_id:
            entry["job_id"] = job_id
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            entry["trace_id"] = f"{context.trace_id:032x}"
            entry["span_id"] = f"{context.span_id:016x}"
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(service: str, level: str = "WARNING", fmt: str = "json") -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # kafka-python narrates every connection at INFO; keep it to warnings unless asked
    logging.getLogger("kafka").setLevel(max(logging.getLevelName(level.upper()), logging.WARNING))
