"""The compiled prefill step (engine/compiled_prefill.py) against the eager engine, on both
families: the same greedy tokens and their logprobs for prompts that fit one bucket, that pad, that
span several buckets a step, that are chunked across steps and batched beside other sequences'
decode rows, and that V4.1 truncates (its consumer layers run a prompt's last 140 rows: the pieces
past the YOCO boundary run fewer rows than the step has); with V4's drafter reading the residual
streams the pieces give, and V4.1's DSpark the main keys they store.

The pieces are traced, not code-generated, as the decode graphs of tests/system/test_compiled_decode.py
(tests/support/compiled_models.py); benchmarks/compiled_prefill.py compiles them with Inductor and
compares their rows with eager. The one bucket here is 16 tokens (the largest set low for the
module: each bucket traces every piece again), so that a 64-token step runs as four and a 23-token
one as two, the second padded."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from engine import LLMEngine, SamplingParams, compiled_prefill
from engine.compiled_prefill import row_groups, token_buckets
from tests.support.compiled_models import DRAFTING_MODELS, MODELS, TRACED, compiling_through
from tests.support.drafters import recording_drafts
from tests.support.models import all_state_free, random_prompts

# under a bucket, one, two (padded), four a step, chunked over steps, and past V4.1's truncation
# (its last 140 rows): the 260-token prompt's first step keeps none of its rows, its second 8
LENGTHS = (3, 16, 23, 50, 130, 260)
BUDGET = 64  # the engines' max_num_batched_tokens: a 130-token prompt is three steps

pytestmark = pytest.mark.in_process


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tmp_path_factory):
    """Each family's small model (tests/support/compiled_models.py): V4's three layers (HCA, CSA,
    sliding window; hash and routed MoE), V4.1's four (Engram, ratio 2, the YOCO boundary, a consumer)."""
    return LLMEngine.from_pretrained(MODELS[request.param](tmp_path_factory.mktemp(request.param) / "model")).model


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, seed=11)


def compiled_engine(model, monkeypatch: pytest.MonkeyPatch, **options) -> LLMEngine:
    monkeypatch.setattr(compiled_prefill, "LARGEST_BUCKET", 16)
    traced: list[torch.fx.GraphModule] = []

    def recorded(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        traced.append(graph)
        return lookup_backend(TRACED)(graph, example_inputs)

    with compiling_through(recorded):
        engine = LLMEngine(model, max_num_batched_tokens=BUDGET, compile_prefill=True, **options)
    assert engine.compiled_prefill is not None, "torch.compile is unavailable: no g++? (scripts/stack toolchain)"
    assert engine.compiled_prefill.buckets == [16]
    assert engine.wait_compiled(), engine.compiled_prefill.failure
    # a bucket's 16 tokens pick each of the 8 experts 4 times on average: its pieces multiply them
    # grouped, as eager does, not a pick at a time as a decode graph does (compiled_prefill.PICKS_PER_EXPERT)
    calls = [node.target for graph in traced for node in graph.graph.nodes if node.op == "call_function"]
    assert any("grouped_mm" in str(call) for call in calls) and torch.bmm not in calls
    # that limit is a constant of each graph (backends.mark_graph_constants), not guarded: a guard on
    # the tracing thread's limit would fail on the engine's thread, and the piece would run eager
    for graph in engine.compiled_prefill._graphs.values():
        for entry in _debug_get_cache_entry_list(graph._torchdynamo_orig_callable.__code__):
            assert "_tracing" not in str(entry.guard_manager)
    return engine


def test_token_buckets_and_the_groups_a_step_runs_as():
    assert token_buckets(1024) == [16, 32, 64, 128, 256, 512, 1024]  # the engine's default step: one bucket
    assert token_buckets(4096) == [16, 32, 64, 128, 256, 512, 1024]
    assert token_buckets(40) == [16, 32, 64]
    assert token_buckets(8) == [16]
    buckets = token_buckets(4096)
    assert row_groups(1, buckets) == [16]
    assert row_groups(300, buckets) == [512]  # one bucket where one holds the step
    assert row_groups(1024, buckets) == [1024]
    assert row_groups(2100, buckets) == [1024, 1024, 32, 16, 16]  # 12 padding rows
    for tokens in range(1, 5000, 7):
        groups = row_groups(tokens, buckets)
        assert sum(groups) >= tokens and all(size in buckets for size in groups)
        assert tokens <= 1024 or sum(groups) - tokens < 16


def test_prompts_prefilled_through_the_pieces_give_the_eager_tokens(model, prompts, monkeypatch):
    """One request at a time and all at once (chunks beside decode rows in one step), through the
    pieces and eager: the same greedy tokens, their logprobs within rounding."""
    eager = LLMEngine(model, max_num_batched_tokens=BUDGET)
    expected = [eager.generate([prompt], greedy(12))[0] for prompt in prompts]
    engine = compiled_engine(model, monkeypatch)
    alone = [engine.generate([prompt], greedy(12))[0] for prompt in prompts]
    steps_alone = engine.compiled_prefill.steps
    together = engine.generate(prompts, greedy(12))
    for outputs in (alone, together):
        assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
        for output, reference in zip(outputs, expected, strict=True):
            assert output.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
    # every step ran through the pieces (decode steps too: no decode graph here), none fell back
    assert steps_alone >= sum(-(-n // BUDGET) + 11 for n in LENGTHS)
    assert engine.compiled_prefill.eager_pieces == 0
    assert all_state_free(engine)


@pytest.mark.parametrize("family", list(DRAFTING_MODELS))
def test_the_drafter_reads_what_the_pieces_give(family, tmp_path_factory, prompts, monkeypatch):
    """V4's MTP module drafts from the residual streams of each step, V4.1's DSpark from the main
    keys each step stores from its target layers' features: through the pieces, each drafts what it
    drafts from an eager step, draft for draft, and the tokens are the eager engine's."""
    write, method = DRAFTING_MODELS[family]
    model = LLMEngine.from_pretrained(write(tmp_path_factory.mktemp(method) / "model")).model
    options = dict(speculative=method, speculative_tokens=2)
    eager = LLMEngine(model, max_num_batched_tokens=BUDGET, **options)
    eager_drafts = recording_drafts(eager)
    batch = [prompts[2], prompts[5]]  # the second past V4.1's truncation: keys from its kept rows
    expected = [eager.generate([prompt], greedy(16))[0].token_ids for prompt in batch]
    engine = compiled_engine(model, monkeypatch, **options)
    drafts = recording_drafts(engine)
    outputs = [engine.generate([prompt], greedy(16))[0].token_ids for prompt in batch]
    assert outputs == expected
    assert len(drafts) > 10 and [d for d, _ in drafts] == [d for d, _ in eager_drafts]
    assert engine.compiled_prefill.steps > 0 and engine.compiled_prefill.eager_pieces == 0
    assert all_state_free(engine)
