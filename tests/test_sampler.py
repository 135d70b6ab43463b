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
