"""A drafter for tests of speculative decoding: the true continuation with chosen mistakes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from engine import LLMEngine
from engine.sequence import Sequence


class ScriptedDrafter:
    """Drafts the reference continuation, right for the first j tokens and wrong after, j cycling
    through 0..k from step to step (and from sequence to sequence)."""

    def __init__(self, reference: dict[int, list[int]], vocab: int = 512):
        self.reference, self.vocab, self.turn, self.right = reference, vocab, 0, 0

    def advance(self, seqs: list[Sequence], streams: list, starts: list[int], wanted: list[int]) -> None:
        for seq, k in zip(seqs, wanted, strict=True):
            if seq.num_computed < seq.num_tokens - 1:  # a prompt still prefilling: nothing to draft yet
                continue
            follows = self.reference[len(seq.prompt_token_ids)][len(seq.output_token_ids) :][:k]
            right = self.turn % (k + 1)
            self.turn += 1
            seq.drafts = [t if i < right else (t + 1) % self.vocab for i, t in enumerate(follows)]
            self.right += min(right, len(follows))

    def keep_up(self, seqs: list[Sequence], starts: list[int]) -> None:
        """Steps without drafts: nothing to follow."""


def counting_drafts(counts: Counter) -> Callable[[LLMEngine], None]:
    """An `after_step` for decode_to_end: adds each step's drafted, accepted and verified to `counts`."""

    def count(engine: LLMEngine) -> None:
        counts.update(
            drafted=engine.last_step_drafted, accepted=engine.last_step_accepted, verified=engine.last_step_verified
        )

    return count


def recording_drafts(engine: LLMEngine) -> list[tuple[list[int], list[float]]]:
    """Every sequence's drafts the engine's drafter proposes from now on, and their confidences
    (empty for a drafter that gives none)."""
    blocks: list[tuple[list[int], list[float]]] = []
    advance = engine.drafter.advance

    def recorded(seqs: list[Sequence], *args: object) -> None:
        advance(seqs, *args)
        blocks.extend((list(seq.drafts), list(seq.draft_confidence)) for seq in seqs if seq.drafts)

    engine.drafter.advance = recorded
    return blocks
