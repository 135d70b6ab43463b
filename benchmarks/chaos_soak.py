"""Chaos soak: streaming and async jobs through two replicas of every worker while a random
service is SIGKILLed (and replaced) every few seconds and the broker is killed and restarted
once per phase. Every answer is compared with the same greedy request run in one process.

Phase 1 streams answers through the gateway (which stays up: a stream ends with its
gateway); the faults hit the tokenizers, prefills, decodes and the cache service. Phase 2
submits async jobs; the faults include the gateway. Prints sent / completed / failed /
hung / wrong per phase; the target is 0 lost, 0 hung, 0 wrong. Uses the stack's Kafka and
PostgreSQL (started here with scripts/stack up if they are not running).

    python benchmarks/chaos_soak.py [--streams 200] [--jobs 50] [--every 4] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# one torch thread in every process of the cluster, as in the tests (tests/conftest.py): with a
# thread per core in each of a dozen processes, every parallel op waits for a core another holds
os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--every", type=float, default=4.0, help="seconds between faults")
    parser.add_argument("--spacing", type=float, default=0.4, help="seconds between stream starts")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--timeout", type=float, default=600, help="a stream or job not done by then is hung")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "chaos_soak.json")
    args = parser.parse_args()

    from tests.support.cluster import stack_up

    stack_up()
    import random

    from engine.checkpoint.make_model import make_model
    from tests.support.chaos import (
        Faults,
        Outcome,
        body,
        expected_answers,
        random_plan,
        run_jobs,
        run_streams,
        start_cluster,
    )

    random.seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_model(root / "tiny", "tiny", seed=0)
        bodies = [body(i, args.max_tokens) for i in range(args.streams + args.jobs)]
        print(f"computing {len(bodies)} answers in one process ...", file=sys.stderr)
        expected = expected_answers(model, bodies)
        print("starting the cluster: gateway, cache, 2 x tokenizer / prefill / decode ...", file=sys.stderr)
        (root / "cluster").mkdir()
        cluster = start_cluster(root / "cluster", model, replicas=2)
        report = {}
        try:
            streams = Outcome()
            window = args.streams * args.spacing
            plan = random_plan(window, args.every, ("tokenizer", "prefill", "decode", "cache"))
            started = time.monotonic()
            with Faults(cluster, plan, args.every) as faults:
                run_streams(
                    cluster.url, bodies[: args.streams], expected[: args.streams], args.timeout, streams, args.spacing
                )
            report["streams"] = _phase("streams", streams, faults.done, time.monotonic() - started)

            jobs = Outcome()
            plan = random_plan(
                max(30, args.jobs * 0.6), args.every, ("gateway", "tokenizer", "prefill", "decode", "cache")
            )
            if "gateway" not in plan:  # the phase is there to kill the gateway under async jobs
                plan[0] = "gateway"
            started = time.monotonic()
            with Faults(cluster, plan, args.every) as faults:
                run_jobs(cluster.url, bodies[args.streams :], expected[args.streams :], args.timeout, jobs)
            report["jobs"] = _phase("async jobs", jobs, faults.done, time.monotonic() - started)
        finally:
            cluster.stop()
    lost = sum(r["sent"] - r["completed"] - r["wrong"] for r in report.values())
    hung = sum(r["hung"] for r in report.values())
    wrong = sum(r["wrong"] for r in report.values())
    print(f"total: {lost} lost, {hung} hung, {wrong} wrong")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


def _phase(name: str, outcome, faults: list[str], seconds: float) -> dict:
    from tests.support.chaos import summary

    print(f"{name}: {outcome.line()}; {seconds:.0f} s; faults: {summary(faults)}")
    for problem in outcome.problems[:20]:
        print(f"  {problem}")
    return {
        **{k: getattr(outcome, k) for k in ("sent", "completed", "failed", "hung", "wrong", "refused")},
        "seconds": round(seconds, 1),
        "faults": faults,
        "problems": outcome.problems,
    }


if __name__ == "__main__":
    main()
