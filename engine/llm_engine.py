"""LLMEngine: requests in, tokens out, one scheduled step at a time."""

from __future__ import annotations

import itertools
import operator
import random
from collections.abc import Iterator
from collections.abc import Sequence as SequenceOf
from pathlib import Path
from typing import Any

import torch

from common.blocks import BLOCK_SIZE
from engine.backends import keep_freed_memory_in_process, select_backend
from engine.compiled_decode import CompiledDecode, DecodeOutput
from engine.config import ModelConfig
from engine.errors import InvalidRequestError, UnknownRequestError
from engine.grammar import GrammarCompiler, consume
from engine.loader import load_model, weights_id
from engine.model import DeepseekV4ForCausalLM, SeqSlice, StepInput
from engine.resident_prefixes import ResidentPrefix, ResidentPrefixes
from engine.sampler import Sampler
from engine.scheduler import Scheduler
from engine.sequence import CompletionOutput, RequestOutput, SamplingParams, Sequence, SequenceStatus, TokenLogprobs
from engine.state_cache import StateCache
from engine.state_transfer import SnapshotError, StateSnapshot, layout_id


class LLMEngine:
    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 1024,
        max_low_priority_tokens: int = 256,
        max_model_len: int | None = None,
        num_blocks: int | None = None,
        state_memory_bytes: int = 4 << 30,
        resident_prefix_bytes: int = 256 << 20,
        kernel_backend: str | None = None,
        weights: str = "",
        grammars: GrammarCompiler | None = None,
        compile_decode: bool = False,
    ):
        """`weights` names the checkpoint (loader.weights_id): part of the state layout, so that
        state is only ever shared between engines running the same weights.
        `max_low_priority_tokens`: the most tokens a prefill step gives to requests of priority > 0
        (batch work), so that an interactive request arriving meanwhile waits for a short step.
        `resident_prefix_bytes`: how much slot state the resident prefixes may copy (their blocks
        cost nothing: they are free blocks not yet reused; engine/resident_prefixes.py).
        `grammars`: compiles requests' output constraints (SamplingParams.grammar) against the
        model's tokenizer; None: a request with one is refused.
        `compile_decode`: run decode steps as compiled graphs (engine/compiled_decode.py), compiled
        or loaded from the disk cache here, before the first request; eager where unavailable."""
        self.model = model
        self.config: ModelConfig = model.config
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        keep_freed_memory_in_process()
        self.backend = select_backend(self.device, kernel_backend)
        model.use_backend(self.backend)
        model.merge_projections()
        self.max_model_len = min(
            max_model_len or self.config.max_position_embeddings, self.config.max_position_embeddings
        )
        if num_blocks is None:
            # enough for every slot to hold a full-length sequence, within the memory budget
            cache_probe = StateCache(self.config, 0, 0, self.dtype, "meta")
            wanted = max_num_seqs * StateCache.blocks_needed(self.max_model_len)
            affordable = (state_memory_bytes - max_num_seqs * cache_probe.layout.slot_bytes) // max(
                cache_probe.layout.block_bytes, 1
            )
            num_blocks = max(1, min(wanted, affordable))
        self.cache = StateCache(self.config, num_blocks, max_num_seqs, self.dtype, self.device)
        self.scheduler = Scheduler(self.cache, max_num_seqs, max_num_batched_tokens, max_low_priority_tokens)
        self.resident = ResidentPrefixes(resident_prefix_bytes)
        self.cache.block_allocator.on_reuse = self.resident.block_reused
        self.sampler = Sampler()
        self.grammars = grammars
        self.max_num_batched_tokens = max_num_batched_tokens
        self.seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._aborted: list[RequestOutput] = []
        self._seed_source = random.Random()
        self.last_step_tokens = 0  # tokens the last step computed (a prefill worker measures its speed)
        self.weights = weights
        self.layout = layout_id(self.config, self.dtype, weights)
        self.compiled_decode = CompiledDecode.create(model, self.cache, max_num_seqs) if compile_decode else None

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None, **kwargs
    ) -> LLMEngine:
        model = load_model(path, device=device, dtype=dtype)
        tokenizer = Path(path) / "tokenizer.json"
        if "grammars" not in kwargs and tokenizer.is_file():
            config = model.config
            kwargs["grammars"] = GrammarCompiler(tokenizer, config.vocab_size, config.eos_token_ids[0])
        return cls(model, weights=weights_id(path), **kwargs)

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        sampling_params: SamplingParams,
        snapshot_at: SequenceOf[int] = (),
    ) -> None:
        """Queue a request. `snapshot_at`: prompt positions after which a step's output carries
        a copy of the state (RequestOutput.prefix_state), for a prefix cache to store."""
        if request_id in self.seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt = self._validate_tokens(prompt_token_ids)
        total = len(prompt) + sampling_params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({sampling_params.max_tokens}) = {total} "
                f"exceeds the model's context of {self.max_model_len} tokens"
            )
        if self.cache.uses_blocks and self.cache.blocks_needed(total) > self.cache.num_blocks:
            raise InvalidRequestError(
                f"{total} tokens need more state than this engine holds ({self.cache.num_blocks} blocks)"
            )
        seed = sampling_params.seed if sampling_params.seed is not None else self._seed_source.getrandbits(63)
        seq = Sequence(request_id, prompt, sampling_params, seed=seed, arrival=next(self._arrivals))
        seq.matcher = self._matcher(sampling_params, [])
        seq.snapshot_at = _snapshot_positions(snapshot_at, len(prompt))
        self._register(seq)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            raise UnknownRequestError(f"no request {request_id!r} (finished, aborted or never added)")
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self._aborted.append(RequestOutput(request_id, [], [], True, "abort", len(seq.prompt_token_ids)))

    # -- state hand-over ----------------------------------------------------------------------

    def export_state(self, request_id: str) -> StateSnapshot:
        """A copy of a running request's state: what another engine needs to continue it."""
        seq = self.seqs.get(request_id)
        if seq is None:
            raise UnknownRequestError(f"no request {request_id!r} (finished, aborted or never added)")
        if seq.slot is None or seq.num_computed == 0:
            raise InvalidRequestError(f"request {request_id!r} has no computed state yet")
        return self._snapshot(seq)

    def _snapshot(self, seq: Sequence, prefix_only: bool = False) -> StateSnapshot:
        """The sequence's state; with prefix_only, as the state of its computed tokens alone (a
        prefix cache entry), without the tokens that follow them."""
        n_blocks = self.cache.blocks_needed(seq.num_computed) if self.cache.uses_blocks else 0
        token_ids = seq.token_ids[: seq.num_computed] if prefix_only else seq.token_ids
        snapshot = StateSnapshot(
            layout=self.layout,
            token_ids=token_ids,
            prompt_len=len(token_ids) if prefix_only else len(seq.prompt_token_ids),
            num_computed=seq.num_computed,
            seed=seq.seed,
            blocks=self.cache.read_blocks(seq.block_table[:n_blocks]),
            slot=self.cache.read_slot(seq.slot),
            last_hidden=seq.last_hidden,
        )
        # the same state, where it already is: in this engine's blocks (tier 0)
        resident = ResidentPrefix(seq.num_computed, seq.block_table[:n_blocks], snapshot.slot, seq.last_hidden)
        self.resident.add(seq.params.prefix_namespace, seq.token_ids[: seq.num_computed], resident)
        return snapshot

    def import_resident(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        sampling_params: SamplingParams,
        snapshot_at: SequenceOf[int] = (),
    ) -> int:
        """Start a request from the longest prefix of its prompt whose state this engine still
        holds in its own memory, in the request's namespace (its params' prefix_namespace): its
        full blocks are shared, its partial block copied, nothing loaded. Returns the prompt
        tokens served from it; 0 (and nothing added) when none is held or there is no room now.

        The outcome is add_request's, as with import_prefix: the state is that of these tokens."""
        prompt = self._validate_tokens(prompt_token_ids)
        entry = self.resident.longest(sampling_params.prefix_namespace, prompt, len(prompt))
        if entry is None or entry.last_hidden is None:
            return 0
        allocator, cached = self.cache.block_allocator, entry.num_tokens
        full = cached // BLOCK_SIZE if self.cache.uses_blocks else 0
        partial = entry.block_ids[full:]  # the block the next tokens write into: copied
        taken_from_free = sum(allocator.ref_counts[b] == 0 for b in entry.block_ids)
        if self.cache.num_free_slots == 0 or allocator.num_free - taken_from_free < len(partial):
            return 0
        seq = self._add_started(request_id, prompt, sampling_params, snapshot_at, cached)
        for block_id in entry.block_ids:  # first, so that allocating the copy cannot reuse them
            allocator.revive(block_id)
        table = entry.block_ids[:full]
        for block_id in partial:
            copy = allocator.allocate()
            self.cache.copy_block(block_id, copy)
            allocator.release(block_id)
            table.append(copy)
        seq.block_table = table
        seq.slot = self.cache.allocate_slot()
        self.cache.write_slot(seq.slot, entry.slot)
        seq.num_computed, seq.last_hidden = cached, entry.last_hidden
        self.scheduler.add_running(seq)
        self.resident.hits += 1
        return cached

    def keep_resident(self, namespace: str, snapshot: StateSnapshot) -> bool:
        """Hold a prefix's state in this engine's own memory without a request for it: loaded now,
        off any request's path, so that a later prompt starting with its tokens takes it back with
        no load (a conversation's answer, computed by a decode engine, for its next turn). Its
        blocks are written and freed at once: free blocks keep their content until reused, and
        nothing running is displaced. False when it is not a prefix state or there is no room."""
        self._check_snapshot(snapshot)
        allocator, n_blocks = self.cache.block_allocator, len(snapshot.blocks) if self.cache.uses_blocks else 0
        if snapshot.last_hidden is None or n_blocks > allocator.num_free or self.resident.max_bytes <= 0:
            return False
        block_ids = [allocator.allocate() for _ in range(n_blocks)]
        if n_blocks:
            self.cache.write_blocks(block_ids, snapshot.blocks)
        for block_id in block_ids:
            allocator.release(block_id)
        slot = {k: v.to(self.device) for k, v in snapshot.slot.items()}
        entry = ResidentPrefix(snapshot.num_computed, block_ids, slot, snapshot.last_hidden.to(self.device, self.dtype))
        self.resident.add(namespace, snapshot.token_ids[: snapshot.num_computed], entry)
        return True

    def import_state(self, request_id: str, snapshot: StateSnapshot, sampling_params: SamplingParams) -> bool:
        """Continue a request from another engine's snapshot; the next step decodes it.

        Returns True if the state was loaded, False if there was no room for it now and the
        request was queued to be recomputed from its tokens instead (same tokens, more work).
        Tokens generated before the hand-over count towards max_tokens; their logprobs stay
        with the engine that produced them.
        """
        self._check_snapshot(snapshot)
        prompt, outputs = snapshot.token_ids[: snapshot.prompt_len], snapshot.token_ids[snapshot.prompt_len :]
        seq = self._resumed_sequence(request_id, prompt, outputs, sampling_params, snapshot.seed)
        return self._load(seq, snapshot)

    def import_prefix(
        self,
        request_id: str,
        snapshot: StateSnapshot,
        prompt_token_ids: SequenceOf[int],
        sampling_params: SamplingParams,
        snapshot_at: SequenceOf[int] = (),
    ) -> bool:
        """Start a request whose prompt begins with the tokens a snapshot's state was computed from:
        load that state and prefill only the rest of the prompt.

        The outcome is the same as add_request's: the state after a prefix does not depend on
        what follows it, and prefill resumed at any position computes what one pass would. A
        snapshot of the whole prompt (a repeat) leaves nothing to compute: the next step samples
        the first token from the snapshot's last hidden state. Returns False, like import_state,
        when there was no room and the whole prompt was queued for prefill instead.
        """
        self._check_snapshot(snapshot)
        prompt = self._validate_tokens(prompt_token_ids)
        cached = snapshot.num_computed
        if cached > len(prompt) or (cached == len(prompt) and snapshot.last_hidden is None):
            raise SnapshotError(f"a {cached}-token prefix leaves nothing to compute of a {len(prompt)}-token prompt")
        if list(snapshot.token_ids[:cached]) != prompt[:cached]:
            raise SnapshotError("the snapshot's tokens are not a prefix of the prompt")
        seq = self._add_started(request_id, prompt, sampling_params, snapshot_at, cached)
        return self._load(seq, snapshot)

    def _add_started(
        self,
        request_id: str,
        prompt: list[int],
        sampling_params: SamplingParams,
        snapshot_at: SequenceOf[int],
        cached: int,
    ) -> Sequence:
        """A validated, registered request whose first `cached` tokens' state the caller gives it:
        not queued, and its snapshots only past them."""
        self.add_request(request_id, prompt, sampling_params, [p for p in snapshot_at if p > cached])
        seq = self.seqs[request_id]
        self.scheduler.waiting.remove(seq)
        return seq

    def _check_snapshot(self, snapshot: StateSnapshot) -> None:
        if snapshot.layout != self.layout:
            raise SnapshotError(f"snapshot layout {snapshot.layout} is not this engine's ({self.layout})")
        if not (snapshot.prompt_len > 0 and 0 < snapshot.num_computed <= len(snapshot.token_ids)):
            raise SnapshotError(
                f"inconsistent snapshot: {len(snapshot.token_ids)} tokens, prompt {snapshot.prompt_len}, "
                f"computed {snapshot.num_computed}"
            )
        n_blocks = self.cache.blocks_needed(snapshot.num_computed) if self.cache.uses_blocks else 0
        if tuple(snapshot.blocks.shape) != (n_blocks, self.cache.layout.block_numel):
            raise SnapshotError(f"snapshot blocks {tuple(snapshot.blocks.shape)}, expected {n_blocks} rows")
        shapes = {name: tuple(t.shape) for name, t in snapshot.slot.items()}
        if shapes != self.cache.slot_shapes():
            raise SnapshotError("snapshot slot state does not match this engine's layout")

    def _load(self, seq: Sequence, snapshot: StateSnapshot) -> bool:
        """Give a registered sequence the snapshot's state and run it; with no room, queue it for recompute."""
        n_blocks = len(snapshot.blocks) if self.cache.uses_blocks else 0
        if self.cache.num_free_slots == 0 or n_blocks > self.cache.block_allocator.num_free:
            self.scheduler.add(seq)  # no room now: recompute it from its tokens when there is
            return False
        seq.slot = self.cache.allocate_slot()
        seq.block_table = [self.cache.block_allocator.allocate() for _ in range(n_blocks)]
        if n_blocks:
            self.cache.write_blocks(seq.block_table, snapshot.blocks)
        self.cache.write_slot(seq.slot, {k: v.to(self.device) for k, v in snapshot.slot.items()})
        seq.num_computed = snapshot.num_computed
        if snapshot.last_hidden is not None:
            seq.last_hidden = snapshot.last_hidden.to(self.device, self.dtype)
        self.scheduler.add_running(seq)
        return True

    def resume(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        output_token_ids: SequenceOf[int],
        sampling_params: SamplingParams,
        seed: int,
    ) -> None:
        """Continue a request whose state is not at hand, by recomputing it from its tokens.

        Gives the same tokens as if it had never stopped: the state is a function of the
        tokens, and sampling draws from (seed, position).
        """
        seq = self._resumed_sequence(request_id, prompt_token_ids, output_token_ids, sampling_params, seed)
        self.scheduler.add(seq)

    def _resumed_sequence(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        output_token_ids: SequenceOf[int],
        sampling_params: SamplingParams,
        seed: int,
    ) -> Sequence:
        """A validated, registered sequence that already has some output tokens."""
        if request_id in self.seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt = self._validate_tokens(prompt_token_ids)
        outputs = self._validate_tokens(output_token_ids) if output_token_ids else []
        if len(outputs) >= sampling_params.max_tokens:
            raise InvalidRequestError(f"request {request_id!r} already has {len(outputs)} of its max_tokens")
        if len(prompt) + sampling_params.max_tokens > self.max_model_len:
            raise InvalidRequestError(f"prompt + max_tokens exceeds the model's context of {self.max_model_len}")
        seq = Sequence(request_id, prompt, sampling_params, seed=seed, arrival=next(self._arrivals))
        seq.output_token_ids = outputs
        seq.matcher = self._matcher(sampling_params, outputs)
        self._register(seq)
        return seq

    def _matcher(self, params: SamplingParams, outputs: list[int]) -> Any:
        if params.grammar is None:
            return None
        if self.grammars is None:
            raise InvalidRequestError("this engine has no tokenizer to enforce an output constraint with")
        return self.grammars.matcher(params.grammar, outputs)

    def _register(self, seq: Sequence) -> None:
        """Hold a new request. Its id may be that of one aborted since the last step (a worker that
        drops a job and takes it again): that one's abort output is not this one's."""
        self._aborted = [out for out in self._aborted if out.request_id != seq.request_id]
        self.seqs[seq.request_id] = seq

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work

    # -- stepping ---------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        # imported with every token computed (a repeated prompt): sampled from their last hidden state
        computed = [seq for seq in self.scheduler.running if seq.num_pending == 0]
        batch = self.scheduler.schedule()
        self.last_step_tokens = sum(batch.num_tokens) if batch else 0
        sampled = [seq for seq in computed if seq in self.scheduler.running]  # not preempted to make room
        rows = [seq.last_hidden for seq in sampled]
        decoded = None  # what the compiled decode step computed, if this step ran it
        if batch is not None:
            last, decoded = self._forward(batch.seqs, batch.num_tokens)
            for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
                seq.num_computed += n
                seq.last_hidden = last[i]
                if seq.snapshot_at and seq.num_computed == seq.snapshot_at[0]:
                    seq.snapshot_at.pop(0)
                    prefix = self._snapshot(seq, prefix_only=True)
                    outputs.append(RequestOutput(seq.request_id, [], [], False, None, prefix_state=prefix))
                if seq.num_computed == seq.num_tokens:
                    sampled.append(seq)
                    rows.append(last[i])
        if not sampled:
            return outputs
        matchers = [seq.matcher for seq in sampled]
        grammars = self.grammars.step(matchers) if any(m is not None for m in matchers) else None
        # the graph's logits when the sampled rows are its rows: not with a prompt chunk among them, nor
        # with a request sampled from its stored hidden state
        if decoded is not None and len(sampled) == len(batch.seqs) and all(map(operator.is_, sampled, batch.seqs)):
            tokens, logprobs, tops = self.sampler(decoded.logits, sampled, grammars, decoded.normalizer, decoded.argmax)
        else:
            tokens, logprobs, tops = self.sampler(self.model.compute_logits(torch.stack(rows)), sampled, grammars)
        for seq, token, logprob, top in zip(sampled, tokens, logprobs, tops, strict=True):
            if seq.matcher is not None:
                consume(seq.matcher, token)
            seq.output_token_ids.append(token)
            seq.output_logprobs.append(logprob)
            reason = self._finish_reason(seq, token)
            final_state = None
            if reason:
                if seq.params.keep_final_state:  # everything but the last token, which was never computed
                    final_state = self._snapshot(seq)
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
                self.scheduler.remove(seq)
                del self.seqs[seq.request_id]
            outputs.append(
                RequestOutput(
                    seq.request_id,
                    [token],
                    [logprob],
                    finished=reason is not None,
                    finish_reason=reason,
                    num_prompt_tokens=len(seq.prompt_token_ids),
                    final_state=final_state,
                    new_top_logprobs=[top] if top is not None else None,
                )
            )
        return outputs

    def _forward(self, seqs: list[Sequence], num_tokens: list[int]) -> tuple[torch.Tensor, DecodeOutput | None]:
        """Compute the scheduled tokens: each sequence's last hidden state of the step [len(seqs), hidden],
        and, from a compiled decode step, their logits too (else None)."""
        if self.compiled_decode is not None and all(n == 1 for n in num_tokens):
            decoded = self.compiled_decode(
                [seq.tokens_between(seq.num_computed, seq.num_computed + 1)[0] for seq in seqs],
                [seq.num_computed for seq in seqs],
                [seq.slot for seq in seqs],
                [seq.block_table for seq in seqs],
            )
            return decoded.hidden, decoded
        slices, token_ids, ends = [], [], []
        for seq, n in zip(seqs, num_tokens, strict=True):
            slices.append(SeqSlice(seq.slot, seq.num_computed, n, list(seq.block_table)))
            token_ids.extend(seq.tokens_between(seq.num_computed, seq.num_computed + n))
            ends.append(len(token_ids) - 1)
        step = StepInput.of(torch.tensor(token_ids, dtype=torch.long, device=self.device), slices)
        return self.model(step, self.cache)[ends].clone(), None  # each sequence's last token of the step

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.config.eos_token_ids):
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    # -- convenience ------------------------------------------------------------------------

    def generate(
        self,
        prompts: SequenceOf[SequenceOf[int]],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Run the prompts to completion, batched together; outputs in prompt order."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else sampling_params
        if len(params) != len(prompts):
            raise InvalidRequestError("one SamplingParams, or one per prompt")
        ids = [f"generate-{next(self._arrivals)}" for _ in prompts]
        seqs = []
        try:
            for request_id, prompt, p in zip(ids, prompts, params, strict=True):
                self.add_request(request_id, prompt, p)
                seqs.append(self.seqs[request_id])
        except Exception:
            for seq in seqs:
                self.abort(seq.request_id)
            raise
        while any(not seq.is_finished for seq in seqs):
            self.step()
        return [
            CompletionOutput(s.request_id, s.prompt_token_ids, s.output_token_ids, s.output_logprobs, s.finish_reason)
            for s in seqs
        ]

    def score(self, token_ids: SequenceOf[int]) -> torch.Tensor:
        """Logits [len(token_ids), vocab] (fp32) of every prompt position, computed in chunks."""
        return torch.cat(list(self._chunk_logits(token_ids)))

    @torch.inference_mode()
    def prompt_logprobs(self, token_ids: SequenceOf[int], top: int) -> list[TokenLogprobs | None]:
        """Per prompt position, the logprob of its token given the ones before it and the `top`
        most likely tokens there (None at position 0: nothing comes before it). One pass over
        the prompt, out of the scheduler (as `score`), keeping one chunk's logits at a time."""
        tokens = self._validate_tokens(token_ids)
        entries: list[TokenLogprobs | None] = [None]
        start = 0
        for logits in self._chunk_logits(tokens):
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
    def _chunk_logits(self, token_ids: SequenceOf[int]) -> Iterator[torch.Tensor]:
        """The logits [chunk, vocab] (fp32) of every prompt position, one engine chunk at a time."""
        tokens = self._validate_tokens(token_ids)
        if len(tokens) > self.max_model_len:
            raise InvalidRequestError(f"{len(tokens)} tokens exceed the model's context of {self.max_model_len}")
        n_blocks = self.cache.blocks_needed(len(tokens)) if self.cache.uses_blocks else 0
        if self.cache.num_free_slots == 0 or n_blocks > self.cache.block_allocator.num_free:
            raise InvalidRequestError("not enough free state to score now; retry when running requests finish")
        slot = self.cache.allocate_slot()
        blocks = [self.cache.block_allocator.allocate() for _ in range(n_blocks)]
        try:
            for start in range(0, len(tokens), self.max_num_batched_tokens):
                chunk = tokens[start : start + self.max_num_batched_tokens]
                step = StepInput.of(
                    torch.tensor(chunk, dtype=torch.long, device=self.device),
                    [SeqSlice(slot, start, len(chunk), blocks)],
                )
                yield self.model.compute_logits(self.model(step, self.cache))
        finally:
            for block in blocks:
                self.cache.block_allocator.release(block)
            self.cache.release_slot(slot)

    def _validate_tokens(self, token_ids: SequenceOf[int]) -> list[int]:
        tokens = list(token_ids)
        if not tokens:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.config.vocab_size
        bad = [t for t in tokens if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        return tokens

    # -- for workers --------------------------------------------------------------------------
    # What a service's worker asks of the engine beyond requests in and outputs out: its load,
    # for the reports routers go by, and where a request stands. Workers use these, never the
    # scheduler, the state cache, the resident prefixes or `seqs` themselves.

    def has_request(self, request_id: str) -> bool:
        """Whether the request is in the engine (waiting or running), not finished or aborted."""
        return request_id in self.seqs

    def request_seed(self, request_id: str) -> int:
        """The seed a request samples with (its own, or the one drawn for it): decode continues
        with it, so that a handed-over request samples as it would have here."""
        seq = self.seqs.get(request_id)
        if seq is None:
            raise UnknownRequestError(f"no request {request_id!r} (finished, aborted or never added)")
        return seq.seed

    def prompt_tokens_left(self, request_id: str) -> int | None:
        """Prompt tokens of a request still to compute (0 once it decodes); None: not in the engine."""
        seq = self.seqs.get(request_id)
        return None if seq is None else max(0, len(seq.prompt_token_ids) - seq.num_computed)

    def resident_tokens(self, namespace: str, token_ids: SequenceOf[int]) -> int:
        """How many of these tokens the longest prefix this engine holds in its own memory (tier 0)
        in `namespace` covers: what a request starting with them would not compute (0: none)."""
        entry = self.resident.longest(namespace, token_ids, len(token_ids))
        return 0 if entry is None else entry.num_tokens

    def resident_summary(self, limit: int = 256) -> list[tuple[int, str, str]]:
        """The prefixes held in this engine's own memory as a load report lists them: (tokens,
        base key, key) of the most recently used (common/prefixes.py)."""
        return self.resident.summary(limit)

    def hold_low_priority(self, hold: bool) -> None:
        """From the next step on, while `hold`, steps take priority-0 work only: priority-0 work is
        on its way, to this engine or another one on the same thread (engine/scheduler.py)."""
        self.scheduler.hold_low_priority = hold

    def num_waiting(self) -> int:
        """Requests added and not yet admitted to a step (no room for them yet)."""
        return len(self.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_free_blocks(self) -> int:
        return self.cache.block_allocator.num_free

    def num_blocks(self) -> int:
        return self.cache.num_blocks

    def num_free_slots(self) -> int:
        """Sequences the engine could run at once beside those it runs now."""
        return self.cache.num_free_slots

    def max_slots(self) -> int:
        return self.cache.max_seqs


def _snapshot_positions(positions: SequenceOf[int], prompt_len: int) -> list[int]:
    """Sorted, distinct positions inside the prompt: after at least one token, before its last
    (whose logits a step must compute anyway)."""
    bad = [p for p in positions if not isinstance(p, int) or not 0 < p < prompt_len]
    if bad:
        raise InvalidRequestError(f"snapshot positions must be in [1, {prompt_len - 1}], got {bad[:5]}")
    return sorted(set(positions))
