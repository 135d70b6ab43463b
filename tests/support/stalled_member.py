"""A consumer group member in a process of its own, for a test to stop and resume with signals.

    python -m tests.support.stalled_member BOOTSTRAP TOPIC GROUP

It takes what the group gives it, commits the first record of each partition as done (the rest
stay in flight, as a worker's unfinished jobs), prints `ready` and stops itself (SIGSTOP) at
once: records in hand, before its loop has once asked whether its membership changed. Resumed
(SIGCONT), it polls as a busy worker does, between engine steps, and prints one JSON line per
event: `changed` when its membership changes, and after that the offsets it is delivered.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from common.bus import KafkaBus
from tests.support.infra import STOPPED_MEMBER_SESSION_MS


def main(bootstrap: str, topic: str, group: str) -> None:
    consumer = KafkaBus(bootstrap, session_timeout_ms=STOPPED_MEMBER_SESSION_MS).consumer([topic], group)
    consumer.wait_assigned(timeout=30)
    held: dict[int, list[int]] = {}
    while sum(map(len, held.values())) < 6:
        for record in consumer.poll(timeout=0.2):
            held.setdefault(record.partition, []).append(record.offset)
    consumer.commit({(topic, partition): 1 for partition in held})
    print(json.dumps({"event": "ready"}), flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # the stop a test could only hit here by chance
    changed = False
    while True:
        records = consumer.poll(timeout=0.002)
        if consumer.membership_changed():
            changed = True
            consumer.rewind()
            print(json.dumps({"event": "changed"}), flush=True)
            continue
        if changed and records:
            print(json.dumps({"event": "delivered", "at": [[r.partition, r.offset] for r in records]}), flush=True)
        time.sleep(0.05)  # an engine step


if __name__ == "__main__":
    main(*sys.argv[1:4])
