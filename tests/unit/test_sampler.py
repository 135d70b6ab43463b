"""The sampler's filters and its counter-based random stream."""

from __future__ import annotations

import math

import torch

from engine.sampler import Sampler, _filter, counter_uniform
from engine.sequence import SamplingParams, Sequence


def test_counter_uniform_is_deterministic_and_uniform():
    draws = [counter_uniform(7, p) for p in range(20000)]
    assert draws == [counter_uniform(7, p) for p in range(20000)]
    assert all(0 <= u < 1 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01
    histogram = torch.histc(torch.tensor(draws), bins=10, min=0, max=1)
    assert (histogram - 2000).abs().max() < 200
    assert counter_uniform(8, 0) != counter_uniform(7, 0)


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    kept = _filter(logits.clone(), top_k=2, top_p=1.0).isfinite()
    assert kept.tolist() == [True, True, False, False, False]
    kept = _filter(logits.clone(), top_k=0, top_p=0.8).isfinite()
    assert kept.tolist() == [True, True, True, False, False]  # 0.5 + 0.2 < 0.8 <= 0.85
    kept = _filter(logits.clone(), top_k=0, top_p=0.01).isfinite()
    assert kept.tolist() == [True, False, False, False, False]  # the best token always stays


def test_sampled_frequencies_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().unsqueeze(0)
    sampler = Sampler()
    counts = [0, 0, 0]
    n = 3000
    for seed in range(n):
        seq = Sequence("r", [1], SamplingParams(temperature=1.0), seed=seed, arrival=0)
        token, logprob, _ = sampler(logits.clone(), [seq])
        counts[token[0]] += 1
        assert math.isclose(logprob[0], math.log(probs[token[0]].item()), abs_tol=1e-5)
    for count, p in zip(counts, probs.tolist(), strict=True):
        assert abs(count / n - p) < 0.03


def test_greedy_rows_ignore_the_random_stream():
    logits = torch.tensor([[0.1, 2.0, 0.3], [0.1, 2.0, 0.3]])
    greedy = Sequence("g", [1], SamplingParams(temperature=0), seed=1, arrival=0)
    tokens, _, _ = Sampler()(logits, [greedy, greedy])
    assert tokens == [1, 1]


class AllowOnly:
    """A grammar for every row that allows only `allowed` (the sampler's view of engine/grammar.py)."""

    def __init__(self, rows: int, allowed: set[int]):
        self.rows, self.allowing, self.masks = list(range(rows)), allowed, 0

    def first_allowed(self, row: int, candidates: list[int]) -> int | None:
        return next((token for token in candidates if token in self.allowing), None)

    def allowed(self, rows: list[int]) -> list[torch.Tensor]:
        self.masks += len(rows)
        return [torch.tensor(sorted(self.allowing)) for _ in rows]


def test_a_grammar_refusing_the_first_choice_gets_a_draw_from_what_it_allows():
    """Chosen first as if free, then among the allowed: greedy is the best allowed token, and
    sampling gives exactly the distribution restricted to the allowed tokens; a mask only when
    no candidate (most likely tokens, further draws) is allowed."""
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().unsqueeze(0)
    greedy = Sequence("g", [1], SamplingParams(temperature=0), seed=0, arrival=0)
    grammar = AllowOnly(1, {1, 2})
    assert Sampler()(logits.clone(), [greedy], grammar)[0] == [1] and grammar.masks == 0
    assert Sampler()(logits.clone(), [greedy], AllowOnly(1, {0, 2}))[0] == [0]
    many = torch.linspace(0, -10, 200).unsqueeze(0)  # token 0 the most likely, token 199 the least
    grammar = AllowOnly(1, {199})
    assert Sampler()(many.clone(), [greedy], grammar)[0] == [199] and grammar.masks == 1  # past the candidates
    counts = [0, 0, 0]
    n = 4000
    grammar = AllowOnly(1, {1, 2})
    for seed in range(n):
        seq = Sequence("r", [1], SamplingParams(temperature=1.0), seed=seed, arrival=0)
        token, logprob, _ = Sampler()(logits.clone(), [seq], grammar)
        counts[token[0]] += 1
        assert math.isclose(logprob[0], math.log(probs[token[0]].item()), abs_tol=1e-5)  # the model's own
    assert counts[0] == 0 and abs(counts[1] / n - 0.6) < 0.03 and abs(counts[2] / n - 0.4) < 0.03
    assert grammar.masks < 5  # a mask only after every further draw was refused too (p = 0.5 ** 17 each)
    rare = Sequence("r", [1], SamplingParams(temperature=1.0), seed=1, arrival=0)
    grammar = AllowOnly(1, {199})
    assert Sampler()(many.clone(), [rare], grammar)[0] == [199] and grammar.masks == 1
    nucleus = Sequence("p", [1], SamplingParams(temperature=1.0, top_p=0.5), seed=3, arrival=0)
    grammar = AllowOnly(1, {1, 2})
    assert Sampler()(logits.clone(), [nucleus], grammar)[0] == [1] and grammar.masks == 1  # top-p of the allowed
