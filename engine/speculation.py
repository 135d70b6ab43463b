"""Speculative decoding's acceptance rule: which of a sequence's k drafted tokens one verify step
of the target model accepts, and the token the target adds after them.

The rule of Leviathan et al. and Chen et al. (2023), as DeepInfer's `fused_sample` and SGLang's
blockwise rejection apply it. Draft d_j, proposed with probability q_j(d_j), is accepted with
probability min(1, p_j(d_j) / q_j(d_j)), where p_j is the target's distribution after the tokens
before it (temperature and filters applied). At the first rejection the next token is drawn from
the residual max(p_j - q_j, 0), normalised; when all k are accepted, from p_k. The emitted tokens
are then distributed exactly as the target's own samples would be. A drafter that proposes its
argmax has a one-hot q_j: the draft is accepted with probability p_j(d_j), and the residual is
p_j without d_j. A greedy row accepts while each draft is the target's argmax, then adds the
argmax: its output is the target's greedy output.

The uniforms come from the sampler's counter stream at each row's position (engine/sampler.py),
so a seeded row's tokens do not depend on what is batched with it.
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
    for j, draft in enumerate(drafts):
        p = target[j]
        q = None if proposal is None else proposal[j]
        q_draft = 1.0 if q is None else float(q[draft])
        if counter_uniform(seed, position + j, ACCEPT_DRAW) * q_draft < float(p[draft]):
            continue
        if q is None:
            residual = p.clone()
            residual[draft] = 0
        else:
            residual = (p - q).clamp(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: a rejection had no probability
            residual = p
        return Verdict(j, [*drafts[:j], _draw(residual, seed, position + j)])
    return Verdict(len(drafts), [*drafts, _draw(target[len(drafts)], seed, position + len(drafts))])


def _draw(weights: torch.Tensor, seed: int, position: int) -> int:
    """The token the position's draw-0 uniform lands on, under these (unnormalised) weights."""
    return draw_index(weights.double().cumsum(dim=0), seed, position)
