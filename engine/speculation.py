"""Speculative decoding's acceptance rule: which of a sequence's k drafted tokens one verify step
of the target model accepts, and the token the target adds after them.

The rule of Leviathan et al. and Chen et al. (2023), as DeepInfer's `fused_sample` and SGLang's
blockwise rejection apply it. Draft d_j, proposed with probability q_j(d_j), is accepted with
probability min(1, p_j(d_j) / q_j(d_j)), where p_j is the target's distribution after the tokens
before it (temperature and filters applied). At the first rejection the next token is drawn from
the residual max(p_j - q_j, 0), normalised; when all k are accepted, from p_k. The emitted tokens
are then distributed exactly as the target's own samples would be.

A drafter that proposes its argmax (both of ours do) has a one-hot q_j: the draft is accepted
with probability p_j(d_j), and the residual is p_j without d_j. That is the same as drawing the
row's token from p_j as the sampler would without drafts, with the same uniform, and accepting the
draft if the draw is the draft: so each row draws exactly the token a step without speculation
would draw at its position (engine/sampler.py's draw 0 of (seed, position)), and a seeded
request's tokens are the same whether its steps speculated or not, that is whatever was batched
with it. A greedy row accepts while each draft is the target's argmax, then adds the argmax: its
output is the target's greedy output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampler import counter_uniform, draw_index

ACCEPT_DRAW = 1_000_003  # the accept test's draw at a position; draw 0 chooses its token, as without drafts


@dataclass(frozen=True)
class Verdict:
    accepted: int  # how many drafts, from the first, the target accepted
    tokens: list[int]  # those drafts, then the token the target chose after them


def verify_greedy(argmax: list[int], drafts: list[int]) -> Verdict:
    """`argmax` [k+1]: the target's most likely token at each verify row (row j follows draft j)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == argmax[accepted]:
        accepted += 1
    return Verdict(accepted, [*drafts[:accepted], argmax[accepted]])


def verify_sampled(
    target: torch.Tensor, drafts: list[int], proposal: torch.Tensor | None, seed: int, position: int
) -> Verdict:
    """`target` [k+1, V]: the target's probabilities at each verify row, after temperature and
    filters. `proposal` [k, V]: the drafter's probabilities each draft was sampled from, or None
    where each draft was the drafter's argmax. `position`: the position of the token row 0 chooses."""
    if proposal is None:
        return _verify_argmax_drafts(target, drafts, seed, position)
    for j, draft in enumerate(drafts):
        p, q = target[j], proposal[j]
        if counter_uniform(seed, position + j, ACCEPT_DRAW) * float(q[draft]) < float(p[draft]):
            continue
        residual = (p - q).clamp(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: a rejection had no probability
            residual = p
        return Verdict(j, [*drafts[:j], _draw(residual.double(), seed, position + j)])
    return Verdict(len(drafts), [*drafts, _draw(target[len(drafts)], seed, position + len(drafts))])


def _verify_argmax_drafts(target: torch.Tensor, drafts: list[int], seed: int, position: int) -> Verdict:
    """Each row draws the sampler's own token; the drafts are kept while they are those tokens, as
    a greedy row keeps them while they are its argmax."""
    return verify_greedy([_draw(row, seed, position + j) for j, row in enumerate(target)], drafts)


def _draw(weights: torch.Tensor, seed: int, position: int) -> int:
    """The token the position's draw-0 uniform lands on under these (unnormalised) weights, as the
    sampler draws it (its cumulative sum in the weights' dtype: the same rounding)."""
    return draw_index(weights.cumsum(dim=-1), seed, position)


SPECULATIVE_MODES = ("auto", "off", "mtp", "dspark")


class SpeculationSwitch:
    """Whether a decode step speculates.

    Never above `max_batch` sequences: verifying k drafts costs little more than one token only
    while a step is bound by reading the weights; a large batch is bound by its compute, and
    drafts there cost more than they save. `auto` also measures what the drafts buy: over the
    last `window` drafted tokens, at least `min_accepted` accepted per drafting sequence and
    step, or it stops drafting, and tries again after `retry_after` steps (a drafter with
    random weights accepts almost nothing and is soon off).
    """

    # A speculating step cost 1.9 plain compiled steps at batch 1 with one draft, on the tiny-vocab
    # model of benchmarks/speculative.py (docs/benchmarks.md): it pays from 0.9 accepted drafts a step.
    def __init__(self, mode: str, max_batch: int, min_accepted: float = 0.9, window: int = 256, retry_after: int = 512):
        self.mode, self.max_batch, self.min_accepted = mode, max_batch, min_accepted
        self.window, self.retry_after = window, retry_after
        self._drafted = self._accepted = self._verified = 0
        self._off_for = 0

    def speculates(self, batch_size: int) -> bool:
        if self.mode == "off" or batch_size > self.max_batch:
            return False
        if self._off_for:
            self._off_for -= 1
            return False
        return True

    def record(self, drafted: int, accepted: int, verified: int) -> None:
        """A step verified `verified` sequences' `drafted` drafts, of which it accepted `accepted`."""
        self._drafted += drafted
        self._accepted += accepted
        self._verified += verified
        if self.mode == "auto" and self._drafted >= self.window:
            if self._accepted < self.min_accepted * self._verified:
                self._off_for = self.retry_after
            self._drafted = self._accepted = self._verified = 0

    @property
    def is_off(self) -> bool:
        """Off for now: the steps run as if there were no drafter."""
        return self.mode == "off" or self._off_for > 0
