"""Token selection: greedy, or temperature with top-k / top-p, from a counter-based random stream.

A sampled token draws one uniform number from hash(seed, position), never from a shared
generator, so the same seed and prompt give the same tokens whatever else is batched
with them, and a preempted request resumes on exactly the stream it left.

A row under a grammar (engine/grammar.py) asks it about tokens chosen as if it had none: a
greedy row takes the first its grammar allows of its CANDIDATES most likely tokens, in order
(the first being its free choice), and a sampled row keeps its draw if allowed, else draws
again, up to CANDIDATES times, keeping the first draw allowed: a draw from the full
distribution kept when allowed is exactly a draw from the allowed part (rejection sampling;
after k refusals the draw among the allowed tokens below keeps it exact,
P(x) = p(x) (1 + q + ... + q^(k-1)) + q^k p(x) / p(A) = p(x) / p(A), q = 1 - p(A)). Only a row
none of whose candidates is allowed asks its grammar for every token it allows (a bitmask
over 129,280 tokens, which costs more than all the questions) and is chosen among those, as is
from the start a row whose top-k or top-p must act on the allowed distribution itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from engine.config import ModelConfig
from engine.sequence import SamplingParams, Sequence

_MASK64 = (1 << 64) - 1
CANDIDATES = 64  # a constrained row's tries (most likely tokens, or draws) before it asks for all it allows


def counter_uniform(seed: int, position: int, draw: int = 0) -> float:
    """A uniform number in [0, 1) from (seed, position, draw) by the splitmix64 finaliser;
    `draw` d > 0 is a position's further draw, after a grammar refused the ones before it."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + draw * 0xD6E8FEB86659FD93) & _MASK64
    z = (z + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


class Grammars(Protocol):
    """The grammars of a step's rows (engine/grammar.StepGrammars)."""

    rows: list[int]  # the rows under a grammar

    def first_allowed(self, row: int, candidates: Iterable[int]) -> int | None:
        """The first of these tokens the row's grammar allows, or None."""
        ...

    def allowed(self, rows: list[int]) -> list[torch.Tensor]:
        """The ids of the tokens each of these rows' grammar allows, ascending."""
        ...


class Sampler:
    def __init__(self, config: ModelConfig | None = None):
        self.config = config  # its EOS tokens are held back from rows short of min_tokens (unless ignore_eos)

    def __call__(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        grammars: Grammars | None = None,
        normalizer: torch.Tensor | None = None,
        argmax: torch.Tensor | None = None,
    ) -> tuple[list[int], list[float], list[list[tuple[int, float]] | None]]:
        """logits [B, V] (fp32) for the next token of each sequence -> (token ids, their logprobs,
        and for sequences that ask (params.logprobs) the most likely tokens with theirs).
        `grammars`: the rows' output constraints. `normalizer` (the logits' logsumexp) and `argmax`
        [B]: where the step computed them already (the compiled decode step does).

        Logprobs are those of the model's own distribution, before temperature, filters and grammars.
        """
        normalizer = logits.logsumexp(dim=-1) if normalizer is None else normalizer
        tops = top_logprobs(logits, normalizer, seqs)
        if held_back := self._held_back(seqs):  # after the logprobs: those are the model's own
            logits = logits.clone()
            for i, ids in held_back.items():
                logits[i, ids] = float("-inf")
            argmax = None
        constrained = grammars.rows if grammars is not None else []
        greedy = [i for i, seq in enumerate(seqs) if seq.params.greedy]
        tokens = [0] * len(seqs)
        if any(i not in constrained for i in greedy):  # one pass over every row: no copy of the free ones
            tokens = (logits.argmax(dim=-1) if argmax is None else argmax).tolist()
        # a constrained greedy row: its most likely tokens in order, the best its grammar allows
        best = [i for i in greedy if i in constrained]
        width = min(CANDIDATES, logits.shape[1])
        candidates = dict(zip(best, logits[best].topk(width, dim=-1).indices.tolist(), strict=True)) if best else {}
        unresolved = []  # constrained rows to choose among everything their grammar allows
        for i, seq in enumerate(seqs):
            if i in candidates:
                token = grammars.first_allowed(i, candidates[i])
            elif seq.params.greedy:
                continue
            elif i in constrained and _filters_the_allowed(seq.params):
                token = None
            else:
                cdf = _cdf(logits[i], seq.params)
                if i in constrained:  # its draw if allowed, else the first allowed of its next draws
                    token = grammars.first_allowed(i, (_draw(cdf, seq, d) for d in range(CANDIDATES + 1)))
                else:
                    token = _draw(cdf, seq, 0)
            if token is None:
                unresolved.append(i)
            else:
                tokens[i] = token
        if unresolved:
            for i, allowed in zip(unresolved, grammars.allowed(unresolved), strict=True):
                tokens[i] = _pick(logits[i], allowed, seqs[i], CANDIDATES + 1)
        chosen = logits.gather(1, torch.tensor(tokens, device=logits.device).unsqueeze(1)).squeeze(1) - normalizer
        return tokens, chosen.tolist(), tops

    def _held_back(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        """The stop tokens of the rows short of their min_tokens: they cannot be chosen yet."""
        held = {}
        for i, seq in enumerate(seqs):
            params = seq.params
            if len(seq.output_token_ids) < params.min_tokens:
                eos = [] if params.ignore_eos or self.config is None else self.config.eos_token_ids
                held[i] = [*params.stop_token_ids, *eos]
        return {i: ids for i, ids in held.items() if ids}


def _filters_the_allowed(params: SamplingParams) -> bool:
    """Top-k and top-p keep the best of the tokens a grammar allows, not of all: mask first."""
    return not params.greedy and (params.top_k > 0 or params.top_p < 1.0)


def _cdf(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """A sampled row's cumulative distribution over token ids, after temperature and filters.
    One row at a time: a row's draw must not depend on the rows batched with it (a cumulative
    sum over a batch rounds differently from one over a single row; on a CPU it is slower too)."""
    return target_probabilities(logits, params).cumsum(dim=-1)


def target_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """A sampled row's distribution over token ids [..., V], after temperature and filters (one row)."""
    return _filter(logits / params.temperature, params.top_k, params.top_p).softmax(dim=-1)


def _draw(cdf: torch.Tensor, seq: Sequence, draw: int) -> int:
    """The index the row's `draw`-th uniform at its position lands on (the position identifies it)."""
    return draw_index(cdf, seq.seed, seq.num_tokens, draw)


def draw_index(cdf: torch.Tensor, seed: int, position: int, draw: int = 0) -> int:
    """The index the `draw`-th uniform of (seed, position) lands on, in an unnormalised cumulative
    distribution."""
    u = counter_uniform(seed, position, draw) * cdf[-1]
    return int(torch.searchsorted(cdf, u.unsqueeze(0), right=True).clamp(max=cdf.shape[0] - 1))


def _pick(logits: torch.Tensor, allowed: torch.Tensor, seq: Sequence, draw: int) -> int:
    """A row's token among the `allowed` ids (ascending): the best one, or its `draw`-th draw
    from their distribution (with temperature and filters applied to them alone)."""
    if len(allowed) == 0:  # a grammar allows something at every step; its matcher reports the error
        return int(logits.argmax())
    subset = logits[allowed.to(logits.device)]
    if seq.params.greedy:
        return int(allowed[int(subset.argmax())])
    return int(allowed[_draw(_cdf(subset, seq.params), seq, draw)])


def top_logprobs(
    logits: torch.Tensor, normalizer: torch.Tensor, seqs: list[Sequence]
) -> list[list[tuple[int, float]] | None]:
    """The `params.logprobs` most likely tokens of each row that asks, with their logprobs."""
    tops: list[list[tuple[int, float]] | None] = [[] if seq.params.logprobs is not None else None for seq in seqs]
    asking = [i for i, seq in enumerate(seqs) if seq.params.logprobs]
    if asking:
        rows = torch.tensor(asking, device=logits.device)
        k = max(seqs[i].params.logprobs or 0 for i in asking)
        values, ids = logits[rows].topk(k, dim=-1)
        values = (values - normalizer[rows].unsqueeze(1)).tolist()
        for n, i in enumerate(asking):
            keep = seqs[i].params.logprobs or 0
            tops[i] = list(zip(ids[n, :keep].tolist(), values[n][:keep], strict=True))
    return tops


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set the logits outside the top-k and outside the top-p nucleus to -inf (one row)."""
    if top_k and top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token once the tokens before it already cover top_p; the first always stays
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter_(0, order, drop), float("-inf"))
    return logits
