"""Moving batches through their lifecycle: validate, send, follow, cancel, expire, finalise.

`BatchRunner.advance` does one round of every step and may run anywhere that reaches the
database, the files directory and the bus; every step is idempotent and reads its state from
the database (its queries are in gateway/batch_store.py), so a runner that dies mid-round
loses nothing: the next round (in a new process) carries on. Distributed, Celery beat
schedules the round on the stack's Redis and a Celery worker runs it (gateway/batch_tasks.py);
embedded, a thread of the serving process does.

Batch work is sent at `priority="batch"`, and only as much of it at once as `in_flight` allows,
shared fairly: the next request sent is always from the tenant with the fewest requests in
flight, then from that tenant's batch with the fewest. The engines schedule interactive work
first (engine/scheduler.py), so batch work fills what interactive traffic leaves free.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from common.api import error_body
from gateway.batch_store import (
    CANCELED,
    EXPIRED,
    PENDING,
    SENDING,
    SENT,
    Batch,
    BatchRequest,
    BatchStore,
)
from gateway.batches import (
    InvalidInput,
    openai_line,
    openai_url,
    parse_openai_input,
    problem_of,
    usage_of,
)
from gateway.files import FileStore
from gateway.jobs import Job, JobStore

log = logging.getLogger(__name__)

Send = Callable[[str, str, dict[str, Any], dict[str, Any]], None]  # job id, endpoint, body, options
Cancel = Callable[[str], None]  # job id
RESEND_AFTER_SECONDS = 30.0  # a request left `sending` this long was not produced (its runner died)


class BatchRunner:
    def __init__(
        self,
        jobs: JobStore,
        files: FileStore,
        send: Send,
        cancel: Cancel,
        in_flight: int = 64,
        resend_sent: bool = False,
        resend_after: float = RESEND_AFTER_SECONDS,
    ):
        """`resend_sent`: the first round sends again every request whose job has not ended, sent
        or still `sending` (embedded: the in-process bus lost what was in it when the process
        stopped, and no other runner is producing). `resend_after`: later rounds take a request
        `sending` this long as lost with the runner that was producing it."""
        self.jobs, self.files, self.send, self.cancel = jobs, files, send, cancel
        self.batches = BatchStore(jobs.session)
        self.in_flight = in_flight
        self.resend_sent = resend_sent
        self.resend_after = resend_after

    def advance(self) -> None:
        """One round: validate new batches, follow what runs, stop what is cancelled or expired,
        send more, and finalise the batches with nothing left to run."""
        if self.resend_sent:
            self._resend(SENT, older_than=time.time())
            self._resend(SENDING, older_than=time.time())
            self.resend_sent = False
        self._resend(SENDING, older_than=time.time() - self.resend_after)
        self._validate()
        self._follow()
        self._stop()
        self._send_more()
        self._finalise()
        self.jobs.purge_expired()  # stored responses past their keep time (this runner runs on a clock)

    # -- steps -----------------------------------------------------------------------------------

    def _validate(self) -> None:
        for batch in self.batches.validating():
            path = self.files.path(batch.input_file_id or "")
            try:
                if not path.is_file():
                    raise InvalidInput([{"code": "file_not_found", "message": "the input file is gone", "param": None}])
                requests = parse_openai_input(path, openai_url(batch.endpoint))
            except InvalidInput as err:
                self.batches.fail(batch.id, err.errors)
                continue
            self.batches.start(batch.id, requests)

    def _follow(self) -> None:
        """Requests whose jobs ended take the job's outcome."""
        self.batches.take_job_outcomes()

    def _stop(self) -> None:
        """Cancelled batches and those past their window: nothing more is sent, and their jobs
        that run are cancelled. What has finished stays in the results."""
        for batch in self.batches.stopping(time.time()):
            outcome = CANCELED if batch.status == "cancelling" else EXPIRED
            for job_id in self.batches.end_pending(batch.id, outcome):
                job = self.jobs.cancel(job_id)
                if job is not None and job.status == "cancelled":
                    self.cancel(job_id)
            self._follow()  # the ones that finished first keep their outcome
            self.batches.end_running(batch.id, outcome)

    def _send_more(self) -> None:
        """Fill the free places: the next request sent is from the tenant with the fewest
        requests in flight, then from that tenant's batch with the fewest."""
        active, in_flight, pending = self.batches.sendable(self.in_flight)
        free = self.in_flight - sum(in_flight.values())
        if not active or free <= 0:
            return
        by_tenant = Counter()
        for batch_id, count in in_flight.items():
            by_tenant[active[batch_id].tenant] += count
        chosen: list[tuple[str, int]] = []
        while free > 0 and pending:
            batch_id = min(pending, key=lambda b: (by_tenant[active[b].tenant], in_flight[b], active[b].created_at))
            chosen.append((batch_id, pending[batch_id].pop(0)))
            if not pending[batch_id]:
                del pending[batch_id]
            in_flight[batch_id] += 1
            by_tenant[active[batch_id].tenant] += 1
            free -= 1
        if chosen:
            self._send(chosen, active)

    def _send(self, chosen: list[tuple[str, int]], batches: dict[str, Batch]) -> None:
        """Create each request's job, mark it sending, then produce it and mark it sent: a job
        exists before any result for it can arrive, and one whose producing was cut short is
        sent again (RESEND_AFTER_SECONDS)."""
        requests = self.batches.claim(chosen, batches, _refused, time.time())
        self._produce(requests, batches)

    def _produce(self, requests: list[BatchRequest], batches: dict[str, Batch]) -> None:
        sent: list[tuple[str, int]] = []
        try:
            for request in requests:
                batch = batches[request.batch_id]
                options = {"tenant": batch.tenant, "priority": "batch"}
                self.send(request.job_id, batch.endpoint, request.body, options)
                sent.append((request.batch_id, request.index))
        finally:  # what was produced is sent, even when the broker refused the rest
            self.batches.mark_sent(sent)

    def _resend(self, state: str, older_than: float) -> None:
        requests, batches = self.batches.unfinished(state, older_than)
        if requests:
            log.warning("sending %d batch requests again", len(requests))
            self.batches.mark_sending(requests)
            self._produce(requests, batches)

    def _finalise(self) -> None:
        """Batches with nothing left to run: write OpenAI's output and error files, add up the
        usage, and end them completed, cancelled or expired."""
        for batch in self.batches.running():
            counts = self.batches.counts(batch.id)
            if counts.get(PENDING) or counts.get(SENDING) or counts.get(SENT):
                continue
            self.batches.finalizing(batch.id, time.time())
            output_id = error_id = None
            usage = None
            if batch.protocol == "openai":  # Anthropic's results are read from the requests themselves
                output_id, error_id, usage = self._write_files(batch)
            self.batches.end(batch.id, output_id, error_id, usage)

    def _write_files(self, batch: Batch) -> tuple[str | None, str | None, dict[str, Any]]:
        output: list[bytes] = []
        errors: list[bytes] = []
        answered: list[dict[str, Any] | None] = []
        for request, job in self.batches.results(batch.id):
            ok, line = openai_line(request, job, batch.endpoint)
            (output if ok else errors).append(line)
            if ok and job is not None:
                answered.append(job.result)
        output_id = self.files.write(batch.tenant, "batch_output", f"{batch.id}_output.jsonl", output).id
        error_id = (
            self.files.write(batch.tenant, "batch_output", f"{batch.id}_error.jsonl", errors).id if errors else None
        )
        return output_id, error_id, usage_of(batch.endpoint, answered)


def _refused(request: BatchRequest, endpoint: str) -> Job | None:
    """The job of a request the protocol refuses before it is sent, already failed; None for one that can run."""
    problem = problem_of(endpoint, request.body)
    return _failed_job(request, endpoint, problem) if problem is not None else None


def _failed_job(request: BatchRequest, endpoint: str, problem: str) -> Job:
    """The job of a request that cannot run, already failed with the protocol's 400."""
    job = Job.queued(request.job_id, endpoint, request.body)
    job.status, job.finished_at, job.status_code = "failed", job.created_at, 400
    job.result = error_body(endpoint, problem)
    return job


class BatchRunnerThread(threading.Thread):
    """The embedded mode's scheduler: a round every `interval` seconds."""

    def __init__(self, runner: BatchRunner, interval: float, stop: threading.Event):
        super().__init__(name="batch-runner", daemon=True)
        self.runner, self.interval, self.stop = runner, interval, stop

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                self.runner.advance()
            except Exception:  # the next round tries again; nothing is lost by a failed one
                log.exception("batch round failed")
