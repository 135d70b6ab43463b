# The two commands a newcomer needs: `make run` and `make test`. Both set everything up first
# and are idempotent: a second run only redoes what changed.

PYTHON ?= python3

# A machine may tell Python not to write bytecode (PYTHONDONTWRITEBYTECODE, as container images often
# do). Then every process compiles the project's modules anew, and every pytest process rewrites the
# asserts of the test modules and of its plugins' ~350 modules (schemathesis, hypothesis, anyio) again,
# 7 CPU-seconds each time. The recipes here let them write it (__pycache__, ignored by git).
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
TINY_MODEL := .cache/models/tiny

.PHONY: run test test-unit lint bench bench-serve compat install stack-down clean

install: $(INSTALLED)

$(BIN)/uv:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check "uv>=0.13,<0.14"

# --compile-bytecode: every process the tests start imports torch from .pyc instead of compiling it
# g++: Inductor compiles the decode step to C++; without one, decode steps run eager
$(INSTALLED): pyproject.toml $(BIN)/uv
	$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -e ".[test]"
	scripts/stack toolchain || echo "no C++ compiler: decode steps will run eager" >&2
	touch $@

$(TINY_MODEL)/config.json: $(INSTALLED)
	$(BIN)/deepmesh make-model $(TINY_MODEL) --preset tiny --seed 0

# every service in one process on the embedded default (in-process bus, local state store)
run: $(INSTALLED) $(TINY_MODEL)/config.json
	$(BIN)/deepmesh serve --model $(TINY_MODEL) --host 127.0.0.1 --port 8000

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The integration tests run against real Apache Kafka, PostgreSQL and Redis on loopback, started
# by scripts/stack (left running, so the next run starts in seconds; `make stack-down` stops them).
# Tiers: tests/unit (no subprocess, network or broker), tests/integration (the stack, the mesh
# embedded), tests/system (services as processes, compiled engines, the reference matrices).
# Two lanes at once. In front: the unit and integration tiers on two workers (pytest-xdist), each
# module whole in one of them, then the tests marked `alone` (the system tier's clusters, compiles
# and restarts, and schemathesis's). Behind, from the start, at the lowest CPU priority
# (scripts/lowest-priority), on two workers too: the system tier's `in_process` modules (long
# computations in their own process, no services, no deadline). They run on what the front lane
# leaves idle while it waits on the broker, on timeouts and on killed processes; their report
# follows the front's. Each lane collects only the tiers its tests are in (tests/conftest.py keeps
# `in_process` to tests/system): every pytest process imports what it collects.
# DeepInfer's source (and SGLang's), whose plain-torch references the V4.1 tests compare against:
# fetched once from PyPI, checked against pinned hashes (scripts/fetch-reference)
REFERENCE := .cache/reference/.fetched
$(REFERENCE): scripts/fetch-reference
	scripts/fetch-reference all >/dev/null
	touch $@

BEHIND_LOG := .cache/test-in-process.log

test: lint $(REFERENCE)
	stack="$$(scripts/stack up)" && eval "$$stack" && export DEEPMESH_REQUIRE_INFRA=1 DEEPMESH_REQUIRE_REFERENCE=1 && \
	{ env -u DEEPMESH_KAFKA_BOOTSTRAP scripts/lowest-priority \
		$(BIN)/pytest -n 2 --dist loadfile --no-loadscope-reorder -m in_process --durations=10 tests/system >$(BEHIND_LOG) 2>&1 & } && \
	{ behind_pid=$$!; trap 'kill -- -$$behind_pid 2>/dev/null' INT TERM; \
	  $(BIN)/pytest -n 2 --dist loadfile -m "not alone and not in_process" --durations=15 tests/unit tests/integration && \
	  $(BIN)/pytest -m alone --durations=15; front=$$?; wait $$behind_pid; behind=$$?; \
	  echo "== the in_process tests, run behind: $(BEHIND_LOG) =="; cat $(BEHIND_LOG); exit $$((front || behind)); }

# the unit tier alone: no stack, one process (444 tests, about 200 s on this 2-core machine)
test-unit: $(INSTALLED) $(REFERENCE)
	DEEPMESH_REQUIRE_REFERENCE=1 $(BIN)/pytest tests/unit

stack-down:
	scripts/stack down

bench: $(INSTALLED)
	$(BIN)/python benchmarks/engine_vs_transformers.py --config small
	$(BIN)/python benchmarks/engine_vs_transformers.py --config tiny-vocab
	$(BIN)/python benchmarks/engine_v41.py
	$(BIN)/python benchmarks/speculative.py
	$(BIN)/python benchmarks/speculative.py --method dspark

# TTFT p50 / p90, inter-token latency and throughput at 1, 8 and 32 requests in flight, embedded and
# distributed, aiperf as the client (from .compat-venv), the engine alone beside them: a table, and
# benchmarks/results/serve.png (benchmarks/serve.py; docs/benchmarks.md has a run)
bench-serve: $(INSTALLED) $(TINY_MODEL)/config.json
	$(BIN)/python benchmarks/serve.py

# deepmesh against guidellm, aiperf and lm-eval, installed in .compat-venv of their own: a short
# run of each, checked from each one's own report (scripts/compat/README.md)
compat: $(INSTALLED) $(TINY_MODEL)/config.json
	scripts/compat/run

clean: stack-down
	rm -rf $(VENV) .compat-venv .cache
