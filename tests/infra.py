"""Access to the real infrastructure `scripts/stack up` starts (Kafka, PostgreSQL, Redis).

`make test` starts the stack and sets DEEPMESH_REQUIRE_INFRA=1, so a test that needs a
service fails if it is missing. Run by hand without the stack, those tests are skipped.
"""

from __future__ import annotations

import os

import pytest


def require_service(env_var: str) -> str:
    value = os.environ.get(env_var)
    if value:
        return value
    if os.environ.get("DEEPMESH_REQUIRE_INFRA") == "1":
        pytest.fail(f"{env_var} is not set: start the stack with scripts/stack up")
    pytest.skip(f'{env_var} not set (run `eval "$(scripts/stack up)"` or `make test`)')
