"""ModelRunner: runs the model on the engine's state and samples the next tokens.

Prepares a step's inputs from the sequences the scheduler picked, runs the model over the
StateCache (or the compiled decode graphs and prefill pieces it holds), and samples from
the logits; it also computes every position's logits of a prompt outside the scheduler
(`score`, `prompt_logprobs`). It keeps no requests and allocates no state: which sequences
run is the engine's to say, and their slots and blocks come from the KV manager.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterator

import torch

from common.images import IMAGE_ID_BASE
from engine.backends import keep_freed_memory_in_process, select_backend
from engine.compiled_decode import CompiledDecode, DecodeOutput
from engine.compiled_prefill import CompiledPrefill
from engine.model import DeepseekV4ForCausalLM, SeqSlice, StepInput, ngram_context
from engine.sampler import Grammars, Sampler
from engine.sequence import Sequence, TokenLogprobs
from engine.state_cache import StateCache

Sampled = tuple[list[int], list[float], list[list[tuple[int, float]] | None]]  # tokens, logprobs, top logprobs


class ModelRunner:
    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        cache: StateCache,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        kernel_backend: str | None,
        compile_decode: bool,
        compile_prefill: bool = False,
        on_compile_progress: Callable[[int, int], None] | None = None,
        with_streams: bool = False,
        dspark_block: int = 0,
    ):
        """`compile_decode`: run decode steps as compiled graphs (engine/compiled_decode.py), compiled
        or loaded from the disk cache in the background from here on; a step whose batch's graph is
        not ready yet runs eager, as every step does where compiling is unavailable. `compile_prefill`:
        the other steps run through compiled pieces around eager attention (engine/compiled_prefill.py),
        likewise compiled in the background, after the decode graphs."""
        self.model = model
        self.cache = cache
        self.device = model.lm_head.weight.device
        keep_freed_memory_in_process()
        self.backend = select_backend(self.device, kernel_backend)
        model.use_backend(self.backend)
        model.merge_projections()
        self.sampler = Sampler(model.config)
        self.max_num_batched_tokens = max_num_batched_tokens
        # V4.1's prompt truncation (engine/config_v41.py) and Engram windows; 0 for V4
        self.keep_tokens = getattr(model.config, "prefill_keep_tokens", 0)
        self.ngram_context = getattr(model, "ngram_context", 0)
        self.with_streams = with_streams  # the V4 drafter's input: rows' residual streams too
        self.compiled_decode = (
            CompiledDecode.create(model, cache, max_num_seqs, on_compile_progress, with_streams, dspark_block)
            if compile_decode
            else None
        )
        self.compiled_prefill = (
            CompiledPrefill.create_for(model, cache, max_num_batched_tokens) if compile_prefill else None
        )

    # -- a scheduled step -----------------------------------------------------------------------

    def forward(self, seqs: list[Sequence], num_tokens: list[int]) -> tuple[torch.Tensor, DecodeOutput | None]:
        """Compute the scheduled tokens: each sequence's last hidden state of the step [len(seqs), hidden],
        and, from a compiled decode step, their logits too (else None)."""
        compiled = self.compiled_decode
        # a truncated prompt's one-token chunk hides the window before its kept tokens, which the
        # graph does not: it computes generated tokens, which have nothing to hide (KEEP >= window)
        in_truncated_prompt = self.keep_tokens and any(
            self.keep_tokens < len(seq.prompt_token_ids) and seq.num_computed < len(seq.prompt_token_ids)
            for seq in seqs
        )
        # an image's positions read the encoder's rows, which the graph does not take
        in_image = any(seq.images and seq.num_computed < len(seq.prompt_token_ids) for seq in seqs)
        decode_shaped = all(n == 1 for n in num_tokens) and not in_truncated_prompt and not in_image
        if compiled is not None and decode_shaped and compiled.is_ready(len(seqs)):
            return self._compiled_step(compiled, seqs)
        tokens = [
            seq.tokens_between(seq.num_computed, seq.num_computed + n) for seq, n in zip(seqs, num_tokens, strict=True)
        ]
        ends = [end - 1 for end in itertools.accumulate(num_tokens)]  # each sequence's last token of the step
        return self._rows(self._eager_step(seqs, tokens))[0][ends].clone(), None

    def forward_rows(
        self, seqs: list[Sequence], num_tokens: list[int], drafts: list[list[int]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
        """Compute each sequence's scheduled tokens and then its drafts: per sequence, every row's
        final hidden state [n, hidden], residual streams [n, hc_mult, hidden] (what a verify step
        accepts from and V4's drafter drafts from; None without `with_streams`) and, where a
        compiled graph computed them, logits.

        A verify step (one scheduled token per sequence, then its drafts) runs each row as a row
        of a decode step, the rows of one sequence at consecutive positions in its slot: a decode
        step writes every row's state before any row reads it, and the rings' room for drafts
        hides each row's later ones from it. So it runs through the compiled decode graph of its
        row count where that is ready."""
        tokens = [
            seq.tokens_between(seq.num_computed, seq.num_computed + n) + extra
            for seq, n, extra in zip(seqs, num_tokens, drafts, strict=True)
        ]
        lengths = [len(t) for t in tokens]
        logits = None
        if all(n == 1 for n in num_tokens):
            hidden, streams, logits = self._decode_rows(seqs, tokens)
        else:
            hidden, streams = self._rows(self._eager_step(seqs, tokens))
        split = [list(t.split(lengths)) if t is not None else None for t in (hidden, streams, logits)]
        return split[0], split[1], split[2]

    def _decode_rows(
        self, seqs: list[Sequence], tokens: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Every token of `tokens[i]` as a row of one decode step at seqs[i]'s next positions."""
        rows = [
            (seq, seq.num_computed + j, token)
            for seq, chunk in zip(seqs, tokens, strict=True)
            for j, token in enumerate(chunk)
        ]
        positions = [position for _, position, _ in rows]
        contexts = None
        if n := self.ngram_context:  # each row's window reads the drafts before it
            contexts = torch.cat(
                [
                    ngram_context(seq.tokens_between(max(0, seq.num_computed - n), seq.num_computed), chunk, n)
                    for seq, chunk in zip(seqs, tokens, strict=True)
                ]
            )
        compiled = self.compiled_decode
        if compiled is not None and compiled.is_ready(len(rows)):
            decoded = compiled(
                [token for _, _, token in rows],
                positions,
                [seq.slot for seq, _, _ in rows],
                [seq.block_table for seq, _, _ in rows],
                contexts.tolist() if contexts is not None else None,
            )
            return decoded.hidden, decoded.streams, decoded.logits
        slices = [SeqSlice(seq.slot, position, 1, list(seq.block_table)) for seq, position, _ in rows]
        step = StepInput.of(torch.tensor([token for _, _, token in rows], dtype=torch.long, device=self.device), slices)
        if contexts is not None:
            step.ngram_context = contexts.to(self.device)
        hidden, streams = self._rows(step)
        return hidden, streams, None

    def _rows(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's final hidden states and, `with_streams`, its residual streams (else None):
        through the compiled prefill pieces where they are ready for the step, else eager."""
        compiled = self.compiled_prefill
        if compiled is not None and step.image_rows is None and compiled.is_ready(len(step.input_ids)):
            hidden, streams = compiled(step)
            return hidden, streams if self.with_streams else None
        if self.with_streams:
            return self.model.forward_with_streams(step, self.cache)
        return self.model(step, self.cache), None

    def _eager_step(self, seqs: list[Sequence], tokens: list[list[int]]) -> StepInput:
        """The step computing `tokens[i]` at seqs[i]'s next positions."""
        slices, token_ids, contexts, images = [], [], [], []
        for seq, chunk in zip(seqs, tokens, strict=True):
            keep_from = max(0, len(seq.prompt_token_ids) - self.keep_tokens) if self.keep_tokens else 0
            slices.append(SeqSlice(seq.slot, seq.num_computed, len(chunk), list(seq.block_table), keep_from))
            token_ids.extend(chunk)
            if self.ngram_context:
                before = seq.tokens_between(max(0, seq.num_computed - self.ngram_context), seq.num_computed)
                contexts.append(ngram_context(before, chunk, self.ngram_context))
            if (
                seq.images
                and (rows := seq.image_rows_between(seq.num_computed, seq.num_computed + len(chunk))) is not None
            ):
                images.append(rows)
        step = StepInput.of(torch.tensor(token_ids, dtype=torch.long, device=self.device), slices)
        if contexts:
            step.ngram_context = torch.cat(contexts).to(self.device)
        if images:
            step.image_rows = step.input_ids >= IMAGE_ID_BASE
            step.image_embeds = torch.cat(images).to(self.device)
        return step

    def _compiled_step(self, compiled: CompiledDecode, seqs: list[Sequence]) -> tuple[torch.Tensor, DecodeOutput]:
        tokens = [seq.tokens_between(seq.num_computed, seq.num_computed + 1) for seq in seqs]
        contexts = None
        if n := self.ngram_context:
            contexts = [
                ngram_context(seq.tokens_between(max(0, seq.num_computed - n), seq.num_computed), token, n)[0].tolist()
                for seq, token in zip(seqs, tokens, strict=True)
            ]
        decoded = compiled(
            [token[0] for token in tokens],
            [seq.num_computed for seq in seqs],
            [seq.slot for seq in seqs],
            [seq.block_table for seq in seqs],
            contexts,
        )
        return decoded.hidden, decoded

    def sample(
        self,
        sampled: list[Sequence],
        rows: list[torch.Tensor],
        grammars: Grammars | None,
        step_seqs: list[Sequence],
        decoded: DecodeOutput | None,
    ) -> Sampled:
        """The next token of each `sampled` sequence from its last hidden state (`rows`), or from
        the logits the compiled decode step computed for the step's sequences (`step_seqs`)."""
        # the graph's logits when the sampled rows are its rows: not with a prompt chunk among them, nor
        # with a request sampled from its stored hidden state
        if decoded is not None and len(sampled) == len(step_seqs) and all(map(operator.is_, sampled, step_seqs)):
            return self.sampler(decoded.logits, sampled, grammars, decoded.normalizer, decoded.argmax)
        return self.sampler(self.model.compute_logits(torch.stack(rows)), sampled, grammars)

    # -- prompts outside the scheduler --------------------------------------------------------

    def score(self, tokens: list[int], slot: int, blocks: list[int]) -> torch.Tensor:
        """Logits [len(tokens), vocab] (fp32) of every prompt position, computed in chunks."""
        return torch.cat(list(self._chunk_logits(tokens, slot, blocks)))

    @torch.inference_mode()
    def prompt_logprobs(self, tokens: list[int], top: int, slot: int, blocks: list[int]) -> list[TokenLogprobs | None]:
        """Per prompt position, the logprob of its token given the ones before it and the `top`
        most likely tokens there (None at position 0: nothing comes before it). One pass over
        the prompt, out of the scheduler (as `score`), keeping one chunk's logits at a time."""
        entries: list[TokenLogprobs | None] = [None]
        start = 0
        for logits in self._chunk_logits(tokens, slot, blocks):
            logprobs = logits.log_softmax(dim=-1)
            # row i predicts token start + i + 1; the last row of the prompt predicts nothing
            following = torch.tensor(tokens[start + 1 : start + 1 + len(logits)], device=logits.device)
            chosen = logprobs[: len(following)].gather(1, following.unsqueeze(1)).squeeze(1).tolist()
            values, ids = logprobs[: len(following)].topk(top, dim=-1) if top else (None, None)
            for row, logprob in enumerate(chosen):
                best = list(zip(ids[row].tolist(), values[row].tolist(), strict=True)) if top else []
                entries.append((logprob, best))
            start += len(logits)
        return entries

    @torch.inference_mode()
    def _chunk_logits(self, tokens: list[int], slot: int, blocks: list[int]) -> Iterator[torch.Tensor]:
        """The logits [chunk, vocab] (fp32) of every prompt position, one engine chunk at a time, in
        a slot and blocks (`KVManager.scratch_state`) no request uses."""
        for start in range(0, len(tokens), self.max_num_batched_tokens):
            chunk = tokens[start : start + self.max_num_batched_tokens]
            step = StepInput.of(
                torch.tensor(chunk, dtype=torch.long, device=self.device),
                [SeqSlice(slot, start, len(chunk), blocks)],  # every row: no V4.1 truncation
            )
            if self.ngram_context:
                before = tokens[max(0, start - self.ngram_context) : start]
                step.ngram_context = ngram_context(before, chunk, self.ngram_context).to(self.device)
            yield self.model.compute_logits(self.model(step, self.cache))
