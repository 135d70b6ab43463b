"""The drafters: they propose the tokens that follow each running sequence's pending one, for
the target model to verify in its next step (engine/speculation.py).

DeepSeek-V4's MTP module (engine/model/v4.py `MultiTokenPrediction`) computes its row at
position p from token p + 1 and the target's residual streams at p, so it runs one row behind
the target: after each target step it takes the rows whose next token is now known, and its
own window ring keeps them. Drafting chains the module on itself, as SGLang runs V4's NextN:
its row at p predicts token p + 2; that token's embedding and the module's own streams make
the next row. Draft rows land in the ring's room past the real rows and are overwritten when
the target's rows for their positions arrive; the state the target keeps never sees them.

A sequence whose rows have a gap (its state was loaded, or steps ran without the drafter)
starts the module's rows afresh: positions before `draft_floor` are masked, so the module
never reads what another sequence left in its slot.
"""

from __future__ import annotations

import torch

from engine.compiled_decode import CompiledDecode, draft_rows
from engine.model import DeepseekV4ForCausalLM, SeqSlice
from engine.model.dspark import draft_blocks
from engine.sequence import Sequence
from engine.state_cache import StateCache


class MtpDrafter:
    def __init__(self, model: DeepseekV4ForCausalLM, cache: StateCache):
        self.model, self.cache = model, cache
        self.module = model.mtp[0]  # V4 publishes one; chained, it drafts any number of tokens
        self.device = model.lm_head.weight.device
        self.compiled: CompiledDecode | None = None  # the engine's graphs, with one of the module's rows per bucket

    @torch.inference_mode()
    def advance(self, seqs: list[Sequence], streams: list[torch.Tensor], starts: list[int], wanted: list[int]) -> None:
        """Take the target's streams [n, hc, d] of positions starts[i].. that the last step computed
        for seqs[i], run the module over every row whose next token is known, then draft wanted[i]
        tokens for each sequence whose rows now reach its pending token (`Sequence.drafts`)."""
        ran, slices, tokens, inputs = [], [], [], []
        for seq, rows, start, k in zip(seqs, streams, starts, wanted, strict=True):
            held = seq.draft_streams
            if held is not None and seq.draft_upto + len(held) == start:
                rows = torch.cat([held, rows])
            else:  # a gap: the module's rows start again here
                seq.draft_floor = seq.draft_upto = start
            n = min(len(rows), seq.num_tokens - 1 - seq.draft_upto)  # rows whose next token exists
            seq.draft_streams, seq.drafts = rows[max(n, 0) :], []
            if n <= 0:
                continue
            slices.append(SeqSlice(seq.slot, seq.draft_upto, n, list(seq.block_table), seq.draft_floor))
            tokens.extend(seq.tokens_between(seq.draft_upto + 1, seq.draft_upto + 1 + n))
            inputs.append(rows[:n])
            seq.draft_upto += n
            ran.append((seq, k))
        if not slices:
            return
        drafts, own = self._run(tokens, torch.cat(inputs), slices)
        last_rows = (torch.tensor([s.length for s in slices]).cumsum(0) - 1).tolist()
        # a sequence drafts once its last row is its pending token's predecessor: that row predicts what follows
        chains = [
            (seq, k, row)
            for (seq, k), row in zip(ran, last_rows, strict=True)
            if k and seq.draft_upto == seq.num_tokens - 1
        ]
        if chains:
            rows = torch.tensor([row for _, _, row in chains], device=self.device)
            self._chain([(seq, k) for seq, k, _ in chains], drafts[rows], own[rows])

    def keep_up(self, seqs: list[Sequence], starts: list[int]) -> None:
        """A step without the drafter computed no streams for it: its rows start again (`advance`)."""

    def _chain(self, seqs: list[tuple[Sequence, int]], drafts: torch.Tensor, streams: torch.Tensor) -> None:
        """Draft k tokens for each (sequence, k) from its module row's draft and streams: each draft
        is the module's most likely next token, fed back with its streams for the one after."""
        while True:
            for (seq, _), token in zip(seqs, drafts.tolist(), strict=True):
                seq.drafts.append(token)
            going = [i for i, (seq, k) in enumerate(seqs) if len(seq.drafts) < k]
            if not going:
                return
            seqs = [seqs[i] for i in going]
            # the row at the new draft's predecessor's position: it reads the draft, predicts the next
            slices = [
                SeqSlice(seq.slot, seq.num_tokens - 2 + len(seq.drafts), 1, list(seq.block_table), seq.draft_floor)
                for seq, _ in seqs
            ]
            drafts, streams = self._run([seq.drafts[-1] for seq, _ in seqs], streams[going], slices)

    def _run(
        self, tokens: list[int], streams: torch.Tensor, slices: list[SeqSlice]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The module over these rows, each row a row of one decode step (a sequence's rows at
        consecutive positions of its slot: every row's key is written before any is read, and the
        ring's room hides a row's later ones from it), masked below each sequence's floor: each
        row's most likely next token [n] and the module's own streams [n, hc, d]. Through the
        compiled graph of the row count where it is ready."""
        rows = [(s, s.start + j) for s in slices for j in range(s.length)]
        positions = [position for _, position in rows]
        slots, floors = [s.slot for s, _ in rows], [s.keep_from for s, _ in rows]
        if self.compiled is not None and self.compiled.is_ready(len(rows)):
            return self.compiled.draft(tokens, positions, slots, floors, streams)
        inputs = (
            torch.tensor(values, dtype=torch.long, device=self.device) for values in (tokens, positions, slots, floors)
        )
        return draft_rows(self.model, self.cache, *inputs, streams)


class DSparkDrafter:
    """DeepSeek-V4.1's DSpark (engine/model/dspark.py): every target step stores its main keys as
    it runs (in a cache with the stages' rings), steps without drafts too, so drafting needs no
    rows handed over: one forward of a block per sequence, its pending token then noise tokens,
    gives every draft at once.

    A sequence whose rows have a gap (its state was loaded, or it was preempted) reads main keys
    from where this engine's rows start again (`draft_floor`) on."""

    def __init__(self, model: torch.nn.Module, cache: StateCache, block_size: int, min_confidence: float = 0.0):
        """`min_confidence`: a sequence's drafts are verified while the product of their
        confidences, the confidence head's estimate that all of them are accepted, is at least
        this (DeepInfer's `MTPVarlen` and SGLang's DSpark scheduler size verification by the
        same products; 0, DeepInfer's default, verifies every draft)."""
        self.model, self.cache, self.block_size = model, cache, block_size
        self.min_confidence = min_confidence
        self.device = model.lm_head.weight.device
        self.compiled: CompiledDecode | None = None  # the blocks' graphs, where a bucket's is ready

    def keep_up(self, seqs: list[Sequence], starts: list[int]) -> None:
        """After a step that computed seqs[i]'s positions starts[i].. and stored their main keys:
        the rows each sequence's blocks may read now reach its computed length."""
        for seq, start in zip(seqs, starts, strict=True):
            if seq.draft_upto != start:  # a gap: earlier main keys in its slot are not its own
                seq.draft_floor = start
            seq.draft_upto = seq.num_computed

    @torch.inference_mode()
    def advance(self, seqs: list[Sequence], streams: object, starts: list[int], wanted: list[int]) -> None:
        """After a step that computed seqs[i]'s positions starts[i].. (their main keys stored), draft
        wanted[i] tokens for each sequence whose pending token is known (`Sequence.drafts`)."""
        self.keep_up(seqs, starts)
        drafting = []
        for seq, k in zip(seqs, wanted, strict=True):
            seq.drafts = []
            if k and seq.num_tokens == seq.num_computed + 1:
                drafting.append((seq, k))
        if not drafting:
            return

        inputs = (
            [seq.tokens_between(seq.num_computed, seq.num_tokens)[0] for seq, _ in drafting],
            [seq.num_computed for seq, _ in drafting],
            [seq.slot for seq, _ in drafting],
            [seq.draft_floor for seq, _ in drafting],
        )
        if self.compiled is not None and self.compiled.is_ready(len(drafting)):
            drafts, confidence = self.compiled.dspark(*inputs)
        else:
            tensors = (torch.tensor(values, dtype=torch.long, device=self.device) for values in inputs)
            drafts, confidence = draft_blocks(self.model, self.cache, *tensors, self.block_size)
        surviving = (confidence.cumprod(dim=1) >= self.min_confidence).int().cumprod(dim=1).sum(dim=1).tolist()
        for (seq, k), row, sure, kept in zip(drafting, drafts.tolist(), confidence.tolist(), surviving, strict=True):
            seq.drafts, seq.draft_confidence = row[: min(k, kept)], sure[: min(k, kept)]
