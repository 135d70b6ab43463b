"""The kernel-backend registry: the reference is always there, others are chosen by device."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine import EngineError, LLMEngine, SamplingParams
from engine.backends import TorchBackend, available_backends, register_backend, select_backend
from tests.support.models import random_prompts


def test_reference_backend_everywhere():
    assert "torch" in available_backends("cpu")
    assert isinstance(select_backend("cpu"), TorchBackend)
    with pytest.raises(EngineError, match="unknown kernel backend"):
        select_backend("cpu", "no-such-backend")


def test_a_registered_backend_is_used_for_its_devices_only(tiny_model):
    calls = {"attention": 0, "routed_experts": 0}

    class CountingBackend(TorchBackend):
        name = "counting"

        def attention(self, *args):
            calls["attention"] += 1
            return super().attention(*args)

        def routed_experts(self, *args):
            calls["routed_experts"] += 1
            return super().routed_experts(*args)

    register_backend("counting", CountingBackend, supports=lambda device: device.type == "cpu")
    try:
        prompt = random_prompts([20], seed=2)[0]
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        counted = LLMEngine(tiny_model, kernel_backend="counting")
        tokens = counted.generate([prompt], params)[0].token_ids
        layers = tiny_model.config.num_hidden_layers
        assert calls == {"attention": 4 * layers, "routed_experts": 4 * layers}
        reference = LLMEngine(tiny_model, kernel_backend="torch")
        assert reference.generate([prompt], params)[0].token_ids == tokens
        with pytest.raises(EngineError, match="does not support"):
            select_backend(torch.device("meta"), "counting")
    finally:
        from engine import backends

        backends._REGISTRY.pop("counting")
        tiny_model.use_backend(TorchBackend())


def test_routed_experts_per_pick_and_grouped_agree_and_a_row_never_depends_on_its_batch():
    """Small steps multiply each (token, expert) pick on its own, longer ones run a grouped product
    per expert: both are the same function of the routing, and under the first a token's output is
    bit-for-bit the same alone or batched with any others."""
    from engine.backends import _experts_per_pick

    torch.manual_seed(0)
    n_experts, hidden, inner, top_k, limit = 8, 64, 32, 2, 7.0
    gate_up = torch.randn(n_experts, 2 * inner, hidden) * 0.1
    down = torch.randn(n_experts, hidden, inner) * 0.1
    x = torch.randn(64, hidden)
    indices = torch.stack([torch.randperm(n_experts)[:top_k] for _ in range(64)])
    weights = torch.rand(64, top_k)

    def per_pick(rows: slice) -> torch.Tensor:
        return _experts_per_pick(x[rows], indices[rows], weights[rows], gate_up, down, limit)

    def chosen(rows: slice) -> torch.Tensor:  # the path routed_experts takes for this many tokens
        return TorchBackend.routed_experts(x[rows], indices[rows], weights[rows], gate_up, down, limit)

    everything = per_pick(slice(0, 64))
    torch.testing.assert_close(everything, chosen(slice(0, 64)), rtol=1e-5, atol=1e-6)  # 128 picks: grouped
    assert torch.equal(chosen(slice(8, 12)), everything[8:12])  # 8 picks, one per expert: per pick
    alone = torch.cat([per_pick(slice(i, i + 1)) for i in range(64)])
    assert torch.equal(everything, alone)
    assert torch.equal(per_pick(slice(5, 37))[3], everything[8])


def test_prefill_pieces_trace_the_experts_grouped_and_decode_graphs_per_pick():
    """A graph traced under picks_per_expert_while_tracing (the compiled prefill's pieces, 2) takes
    the grouped product past that many picks an expert, as an eager step does past one; a decode
    graph, traced outside it, multiplies every pick on its own up to 16 (its rows then never
    depend on their batch). Both give eager's output."""
    from engine.backends import mark_graph_constants, picks_per_expert_while_tracing
    from engine.compiled_decode import renamed_copy
    from engine.compiled_prefill import PICKS_PER_EXPERT

    mark_graph_constants()  # as compile_only does before the engine's graphs are made: the limit a constant

    torch.manual_seed(1)
    n_experts, hidden, inner, top_k, limit = 8, 64, 32, 2, 7.0
    gate_up = torch.randn(n_experts, 2 * inner, hidden) * 0.1
    down = torch.randn(n_experts, hidden, inner) * 0.1
    x = torch.randn(32, hidden)  # 64 picks: 8 an expert on average
    indices = torch.stack([torch.randperm(n_experts)[:top_k] for _ in range(32)])
    weights = torch.rand(32, top_k)
    graphs: list[torch.fx.GraphModule] = []

    def recorded(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    def traced(name: str) -> Callable[..., torch.Tensor]:  # a code object of its own: its own graph
        return torch.compile(renamed_copy(TorchBackend.routed_experts, name), backend=recorded, fullgraph=True)

    inputs = (x, indices, weights, gate_up, down, limit)
    eager = TorchBackend.routed_experts(*inputs)
    with picks_per_expert_while_tracing(PICKS_PER_EXPERT):
        grouped = traced("piece")(*inputs)
        short = traced("short_piece")(*(tensor[:8] for tensor in inputs[:3]), *inputs[3:])  # 16 picks: 2 an expert
    per_pick = traced("decode_graph")(*inputs)

    def grouped_and_per_pick(graph: torch.fx.GraphModule) -> tuple[bool, bool]:
        calls = [node.target for node in graph.graph.nodes if node.op == "call_function"]
        return any("grouped_mm" in str(call) for call in calls), torch.bmm in calls

    assert [grouped_and_per_pick(graph) for graph in graphs] == [(True, False), (False, True), (False, True)]
    torch.testing.assert_close(grouped, eager, rtol=0, atol=0)  # the eager step's own path
    torch.testing.assert_close(short, eager[:8], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(per_pick, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("start", "length", "window", "entries", "floor"),
    [
        (0, 300, 64, 0, 0),  # a prompt's first chunk, no compressed entries
        (500, 700, 128, 40, 0),  # a later chunk: the ring's keys before it, entries seen in part
        (900, 333, 8, 17, 880),  # a small window, a truncated prompt's floor inside the ring's reach
        (0, 200, 128, 5, 0),  # short: one call
    ],
)
def test_a_long_chunks_attention_in_tiles_is_the_whole_chunks(start, length, window, entries, floor):
    """prefill_attention splits a long chunk's queries into tiles, each against the window keys it
    can see and every entry: the same output as one call over every key, whatever the chunk's
    start, window, entries and floor (the ring's keys read as the model reads them)."""
    from engine.model import SeqSlice
    from engine.model.v4 import prefill_attention, prefill_window_keys, with_entries

    generator = torch.Generator().manual_seed(length)
    heads, dim = 4, 16
    ring = torch.randn(2, window, dim, generator=generator)  # slot 1's sliding-window ring
    kv = torch.randn(length, dim, generator=generator)
    q = torch.randn(length, heads, dim, generator=generator)
    s = SeqSlice(1, start, length, [], floor)
    keys, bias, positions = prefill_window_keys(ring, s, kv, window, floor)
    window_keys = keys.shape[0]
    if entries:
        seen = torch.arange(entries).unsqueeze(0) < (positions // 25 % (entries + 1)).unsqueeze(1)
        keys, bias = with_entries(keys, bias, torch.randn(entries, dim, generator=generator), seen)
    sinks, backend = torch.randn(heads, generator=generator), TorchBackend()
    whole = backend.attention(q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), bias.unsqueeze(0), sinks, 0.25)[0]
    tiled = prefill_attention(backend, q, keys, bias, sinks, 0.25, window_keys, window)
    assert tiled.shape == whole.shape == (length, heads, dim)
    torch.testing.assert_close(tiled, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("queries", [1, 2, 37, 256])  # a decode row (unfused), then prompt chunks (fused)
def test_attention_is_a_softmax_over_the_keys_and_the_sink(queries):
    """TorchBackend.attention against the definition computed in float64: each head's softmax over
    its logits and its sink logit (a concatenated column), the sink's column without a value. Rows
    with masked keys, one row with every key masked (it attends to the sink alone: zero), a batch
    of two."""
    generator = torch.Generator().manual_seed(queries)
    batch, heads, dim, n_keys = 2, 4, 32, 70
    q = torch.randn(batch, heads, queries, dim, generator=generator) * 3
    keys = torch.randn(batch, n_keys, dim, generator=generator)
    bias = torch.zeros(batch, queries, n_keys).masked_fill_(
        torch.rand(batch, queries, n_keys, generator=generator) < 0.4, float("-inf")
    )
    bias[1, queries // 2] = float("-inf")
    sinks, scaling = torch.randn(heads, generator=generator), dim**-0.5

    logits = (q.double() * scaling) @ keys.double().unsqueeze(1).transpose(-1, -2) + bias.double().unsqueeze(1)
    with_sink = torch.cat([logits, sinks.double().view(1, heads, 1, 1).expand(batch, heads, queries, 1)], dim=-1)
    probs = torch.softmax(with_sink, dim=-1)[..., :n_keys]
    expected = (probs @ keys.double().unsqueeze(1)).transpose(1, 2)  # [B, S, H, d]

    out = TorchBackend.attention(q, keys, bias, sinks, scaling)
    assert out.shape == (batch, queries, heads, dim)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-5)
    assert out[1, queries // 2].abs().max() == 0


def test_a_chunks_index_scores_a_slice_of_queries_at_a_time_are_those_all_at_once(monkeypatch):
    """index_scores holds at most SCORE_BATCH [query, head, entry] products of a prompt chunk: its
    queries go in slices, each row's scores bitwise those of the chunk all at once."""
    from engine.model import v4

    generator = torch.Generator().manual_seed(3)
    q = torch.randn(300, 8, 32, generator=generator)
    keys, weights = torch.randn(75, 32, generator=generator), torch.randn(300, 8, generator=generator)
    whole = v4.index_scores(q, keys, weights, 0.25)
    monkeypatch.setattr(v4, "SCORE_BATCH", 8 * 75 * 7)  # slices of 7 rows, the last of 6
    assert torch.equal(v4.index_scores(q, keys, weights, 0.25), whole)


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_a_prompt_is_scored_the_same_with_its_indexer_in_slices(family, tiny_preset, tiny_v41_preset, monkeypatch):
    """A 300-token prompt's logprobs (query tiles, compressed entries, an indexer's top-k) with the
    indexer's queries in slices of a few rows: bitwise those computed all at once, on both families."""
    from engine.model import v4

    engine = LLMEngine.from_pretrained(tiny_preset if family == "v4" else tiny_v41_preset)
    prompt = random_prompts([300], seed=4)[0]
    whole = engine.prompt_logprobs(prompt, 2)
    monkeypatch.setattr(v4, "SCORE_BATCH", 5000)
    assert engine.prompt_logprobs(prompt, 2) == whole
