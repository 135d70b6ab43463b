"""LLMEngine: requests in, tokens out, one scheduled step at a time.

The engine holds the requests (their sequences, checks and outputs) and runs each step: the
scheduler picks what runs, the model runner (engine/model_runner.py) computes and samples it,
and the KV manager (engine/kv_manager.py) holds the state memory it runs in and the snapshots
that carry state between engines.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from pathlib import Path
from typing import Any

import torch

from common.images import IMAGE_ID_BASE
from engine.checkpoint import load_model, weights_id
from engine.compiled_decode import CompiledDecode
from engine.compiled_prefill import CompiledPrefill
from engine.config import ModelConfig
from engine.config_v41 import V41Config
from engine.drafter import DSparkDrafter, MtpDrafter
from engine.errors import InvalidRequestError, UnknownRequestError
from engine.grammar import GrammarCompiler, consume
from engine.kv_manager import KVManager
from engine.model import DeepseekV4ForCausalLM
from engine.model.v41 import DeepseekV41ForCausalLM
from engine.model_runner import ModelRunner
from engine.resident_prefixes import ResidentPrefixes
from engine.sampler import Sampler, target_probabilities, top_logprobs
from engine.scheduler import Scheduler
from engine.sequence import (
    CompletionOutput,
    ImageSpan,
    RequestOutput,
    SamplingParams,
    Sequence,
    SequenceStatus,
    TokenLogprobs,
)
from engine.speculation import SPECULATIVE_MODES, SpeculationSwitch, verify_greedy, verify_sampled
from engine.state_cache import StateCache
from engine.state_transfer import SnapshotError, StateSnapshot


class LLMEngine:
    def __init__(
        self,
        model: DeepseekV4ForCausalLM | DeepseekV41ForCausalLM,
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
        compile_prefill: bool = False,
        on_compile_progress: Callable[[int, int], None] | None = None,
        speculative: str = "off",
        speculative_tokens: int = 3,
        speculative_max_batch: int = 4,
        speculative_min_confidence: float = 0.0,
    ):
        """`weights` names the checkpoint (engine.checkpoint.weights_id): part of the state layout, so that
        state is only ever shared between engines running the same weights.
        `max_low_priority_tokens`: the most tokens a prefill step gives to requests of priority > 0
        (batch work), so that an interactive request arriving meanwhile waits for a short step.
        `resident_prefix_bytes`: how much slot state the resident prefixes may copy (their blocks
        cost nothing: they are free blocks not yet reused; engine/resident_prefixes.py).
        `grammars`: compiles requests' output constraints (SamplingParams.grammar) against the
        model's tokenizer; None: a request with one is refused.
        `compile_decode`: run decode steps as compiled graphs (engine/compiled_decode.py), compiled
        or loaded from the disk cache on a background thread from here on: steps run eager until
        their batch's graph is ready (`wait_compiled` blocks until all are), and always where
        compiling is unavailable. `on_compile_progress(ready, planned)` hears of each graph ready.
        `compile_prefill`: run every other step as compiled pieces around its eager
        attention cores (engine/compiled_prefill.py), compiled likewise, after the decode graphs.
        `speculative`: draft `speculative_tokens` tokens a step and verify them in the next
        (engine/speculation.py): "mtp" with V4's multi-token-prediction module, "dspark" with
        V4.1's draft model, "auto" with the checkpoint's drafter where it has one and while what it
        drafts is accepted often enough, "off"; never for a step of more than
        `speculative_max_batch` sequences. `speculative_min_confidence` (DSpark): verify a
        sequence's drafts while the product of their confidences is at least this (0: all)."""
        self.model = model
        self.config: ModelConfig | V41Config = model.config
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.max_model_len = min(
            max_model_len or self.config.max_position_embeddings, self.config.max_position_embeddings
        )
        self.speculative_method = method = drafting_method(model, speculative)  # "mtp", "dspark" or None
        drafting = method is not None
        self.speculation = SpeculationSwitch(speculative if drafting else "off", speculative_max_batch)
        self.speculative_tokens = speculative_tokens if drafting else 0
        if drafting and speculative_tokens < 1:
            raise ValueError(f"speculative_tokens must be at least 1, got {speculative_tokens}")
        # the most rows a step computes past a sequence's accepted tokens: its drafts, or DSpark's
        # whole block, which it drafts as it was trained, whatever it keeps (engine/model/dspark.py)
        block = self.config.dspark_block_size if method == "dspark" else 0
        draft_rows = max(self.speculative_tokens, block)
        self.kv = KVManager(
            self.config,
            self.dtype,
            self.device,
            max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len,
            num_blocks=num_blocks,
            state_memory_bytes=state_memory_bytes,
            resident_prefix_bytes=resident_prefix_bytes,
            weights=weights,
            lookahead=draft_rows,
            draft_layers=len(model.mtp) if drafting else 0,
        )
        self.drafter: MtpDrafter | DSparkDrafter | None = None
        if method == "mtp":
            self.drafter = MtpDrafter(model, self.kv.cache)
        elif method == "dspark":
            self.drafter = DSparkDrafter(model, self.kv.cache, draft_rows, speculative_min_confidence)
        self.runner = ModelRunner(
            model,
            self.kv.cache,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kernel_backend=kernel_backend,
            compile_decode=compile_decode,
            compile_prefill=compile_prefill,
            on_compile_progress=on_compile_progress,
            with_streams=method == "mtp",
            dspark_block=draft_rows if method == "dspark" else 0,
        )
        if self.drafter is not None:
            self.drafter.compiled = self.runner.compiled_decode
        self.scheduler = Scheduler(self.cache, max_num_seqs, max_num_batched_tokens, max_low_priority_tokens)
        self.grammars = grammars
        self.max_num_batched_tokens = max_num_batched_tokens
        self.seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._aborted: list[RequestOutput] = []
        self._seed_source = random.Random()
        self.last_step_tokens = 0  # tokens the last step computed (a prefill worker measures its speed)
        # drafts the last step verified, those it accepted, and the sequences it verified drafts of
        self.last_step_drafted = self.last_step_accepted = self.last_step_verified = 0
        self.weights = weights

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until every decode graph and prefill piece this engine compiles is ready: True then,
        False on `timeout` or where nothing compiles (not asked for, or unavailable). What measures
        steady-state speed calls this first."""
        compiled = [graphs for graphs in (self.compiled_decode, self.compiled_prefill) if graphs is not None]
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        return bool(compiled) and all(graphs.wait(left()) for graphs in compiled)

    def compile_progress(self, step: str = "decode") -> tuple[int, int]:
        """(buckets ready, buckets planned) of the compiled "decode" graphs or "prefill" pieces: (0, 0)
        where those steps do not compile."""
        compiled = self.compiled_decode if step == "decode" else self.compiled_prefill
        return (compiled.num_ready, len(compiled.buckets)) if compiled is not None else (0, 0)

    def close(self) -> None:
        """Compile no further graph (the one compiling now finishes first)."""
        for compiled in (self.compiled_decode, self.compiled_prefill):
            if compiled is not None:
                compiled.stop()

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        prefill_keep_tokens: int | None = None,
        **kwargs,
    ) -> LLMEngine:
        """`prefill_keep_tokens`: DeepSeek-V4.1's prompt truncation (engine/config_v41.py; 0: off,
        None: its default); ignored for V4."""
        model = load_model(path, device=device, dtype=dtype, prefill_keep_tokens=prefill_keep_tokens)
        tokenizer = Path(path) / "tokenizer.json"
        if "grammars" not in kwargs and tokenizer.is_file():
            config = model.config
            kwargs["grammars"] = GrammarCompiler(tokenizer, config.vocab_size, config.eos_token_ids[0])
        return cls(model, weights=weights_id(path), **kwargs)

    @property
    def backend(self) -> object:
        return self.runner.backend

    @property
    def sampler(self) -> Sampler:
        return self.runner.sampler

    @property
    def compiled_decode(self) -> CompiledDecode | None:
        return self.runner.compiled_decode

    @property
    def compiled_prefill(self) -> CompiledPrefill | None:
        return self.runner.compiled_prefill

    @property
    def cache(self) -> StateCache:
        return self.kv.cache

    @property
    def resident(self) -> ResidentPrefixes:
        return self.kv.resident

    @property
    def layout(self) -> str:
        """The state layout's id (state_transfer.layout_id): snapshots load only where it is the same."""
        return self.kv.layout

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        sampling_params: SamplingParams,
        snapshot_at: SequenceOf[int] = (),
        images: SequenceOf[ImageSpan] = (),
    ) -> None:
        """Queue a request. `snapshot_at`: prompt positions after which a step's output carries
        a copy of the state (RequestOutput.prefix_state), for a prefix cache to store. `images`:
        the encoder's rows of each image span of the prompt (common/images.py), which every way
        in takes alike: a prompt's image positions always come with their rows."""
        prompt, _ = self._checked_request(request_id, prompt_token_ids, sampling_params, images=images)
        seed = self._request_seed(sampling_params)
        seq = self._new_sequence(request_id, prompt, sampling_params, seed, snapshot_at=snapshot_at, images=images)
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
        return self.kv.snapshot(seq)

    def import_resident(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        sampling_params: SamplingParams,
        snapshot_at: SequenceOf[int] = (),
        images: SequenceOf[ImageSpan] = (),
    ) -> int:
        """Start a request from the longest prefix of its prompt whose state this engine still
        holds in its own memory, in the request's namespace (its params' prefix_namespace): its
        full blocks are shared, its partial block copied, nothing loaded. Returns the prompt
        tokens served from it; 0 (and nothing added) when none is held or there is no room now.

        The outcome is add_request's, as with import_prefix: the state is that of these tokens."""
        prompt, _ = self._checked_request(request_id, prompt_token_ids, sampling_params, images=images)
        entry = self.kv.resident_prefix(sampling_params.prefix_namespace, prompt, self.reusable_prefix(len(prompt)))
        if entry is None:
            return 0
        seq = self._add_started(request_id, prompt, sampling_params, snapshot_at, entry.num_tokens, images)
        self.kv.take_resident(seq, entry)
        self.scheduler.add_running(seq)
        return entry.num_tokens

    def keep_resident(self, namespace: str, snapshot: StateSnapshot) -> bool:
        """Hold a prefix's state in this engine's own memory without a request for it: loaded now,
        off any request's path, so that a later prompt starting with its tokens takes it back with
        no load (a conversation's answer, computed by a decode engine, for its next turn). Its
        blocks are written and freed at once: free blocks keep their content until reused, and
        nothing running is displaced. False when it is not a prefix state or there is no room."""
        return self.kv.keep_resident(namespace, snapshot)

    def import_state(
        self,
        request_id: str,
        snapshot: StateSnapshot,
        sampling_params: SamplingParams,
        images: SequenceOf[ImageSpan] = (),
    ) -> bool:
        """Continue a request from another engine's snapshot; the next step decodes it.

        Returns True if the state was loaded, False if there was no room for it now and the
        request was queued to be recomputed from its tokens instead (same tokens, more work).
        Tokens generated before the hand-over count towards max_tokens; their logprobs stay
        with the engine that produced them.
        """
        self.kv.check_snapshot(snapshot)
        prompt, outputs = snapshot.token_ids[: snapshot.prompt_len], snapshot.token_ids[snapshot.prompt_len :]
        seq = self._resumed_sequence(request_id, prompt, outputs, sampling_params, snapshot.seed, images)
        return self._load(seq, snapshot)

    def import_prefix(
        self,
        request_id: str,
        snapshot: StateSnapshot,
        prompt_token_ids: SequenceOf[int],
        sampling_params: SamplingParams,
        snapshot_at: SequenceOf[int] = (),
        images: SequenceOf[ImageSpan] = (),
    ) -> bool:
        """Start a request whose prompt begins with the tokens a snapshot's state was computed from:
        load that state and prefill only the rest of the prompt.

        The outcome is the same as add_request's: the state after a prefix does not depend on
        what follows it, and prefill resumed at any position computes what one pass would. A
        snapshot of the whole prompt (a repeat) leaves nothing to compute: the next step samples
        the first token from the snapshot's last hidden state. Returns False, like import_state,
        when there was no room and the whole prompt was queued for prefill instead.
        """
        self.kv.check_snapshot(snapshot)
        prompt, _ = self._checked_request(request_id, prompt_token_ids, sampling_params, images=images)
        cached = snapshot.num_computed
        if cached > self.reusable_prefix(len(prompt)):
            raise SnapshotError(
                f"a {cached}-token prefix of a {len(prompt)}-token prompt: this model replays at least the "
                f"prompt's last {len(prompt) - self.reusable_prefix(len(prompt))} tokens"
            )
        if cached > len(prompt) or (cached == len(prompt) and snapshot.last_hidden is None):
            raise SnapshotError(f"a {cached}-token prefix leaves nothing to compute of a {len(prompt)}-token prompt")
        if list(snapshot.token_ids[:cached]) != prompt[:cached]:
            raise SnapshotError("the snapshot's tokens are not a prefix of the prompt")
        seq = self._add_started(request_id, prompt, sampling_params, snapshot_at, cached, images)
        return self._load(seq, snapshot)

    def _add_started(
        self,
        request_id: str,
        prompt: list[int],
        sampling_params: SamplingParams,
        snapshot_at: SequenceOf[int],
        cached: int,
        images: SequenceOf[ImageSpan] = (),
    ) -> Sequence:
        """A checked, registered request whose first `cached` tokens' state the caller gives it:
        not queued, and its snapshots only past them."""
        seed = self._request_seed(sampling_params)
        return self._new_sequence(
            request_id, prompt, sampling_params, seed, snapshot_at=[p for p in snapshot_at if p > cached], images=images
        )

    def _load(self, seq: Sequence, snapshot: StateSnapshot) -> bool:
        """Give a registered sequence the snapshot's state and run it; with no room, queue it for recompute."""
        if not self.kv.load(seq, snapshot):
            self.scheduler.add(seq)  # no room now: recompute it from its tokens when there is
            return False
        self.scheduler.add_running(seq)
        return True

    def resume(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        output_token_ids: SequenceOf[int],
        sampling_params: SamplingParams,
        seed: int,
        images: SequenceOf[ImageSpan] = (),
    ) -> None:
        """Continue a request whose state is not at hand, by recomputing it from its tokens.

        Gives the same tokens as if it had never stopped: the state is a function of the
        tokens, and sampling draws from (seed, position).
        """
        seq = self._resumed_sequence(request_id, prompt_token_ids, output_token_ids, sampling_params, seed, images)
        self.scheduler.add(seq)

    def _resumed_sequence(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        output_token_ids: SequenceOf[int],
        sampling_params: SamplingParams,
        seed: int,
        images: SequenceOf[ImageSpan] = (),
    ) -> Sequence:
        """A checked, registered sequence that already has some output tokens."""
        prompt, outputs = self._checked_request(
            request_id, prompt_token_ids, sampling_params, output_token_ids, images=images
        )
        return self._new_sequence(request_id, prompt, sampling_params, seed, outputs=outputs, images=images)

    def _new_sequence(
        self,
        request_id: str,
        prompt: list[int],
        sampling_params: SamplingParams,
        seed: int,
        *,
        outputs: list[int] | None = None,
        snapshot_at: SequenceOf[int] = (),
        images: SequenceOf[ImageSpan] = (),
    ) -> Sequence:
        """A registered sequence of a request `_checked_request` passed, with no state yet, not queued."""
        seq = Sequence(request_id, prompt, sampling_params, seed=seed, arrival=next(self._arrivals))
        seq.output_token_ids = outputs if outputs is not None else []
        seq.matcher = self._matcher(sampling_params, seq.output_token_ids)
        seq.snapshot_at = _snapshot_positions(snapshot_at, len(prompt))
        seq.images = sorted(images, key=lambda image: image.start)
        self._register(seq)
        return seq

    def _request_seed(self, params: SamplingParams) -> int:
        """The request's seed, or one drawn for it: sampling draws from (seed, position) only."""
        return params.seed if params.seed is not None else self._seed_source.getrandbits(63)

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
        self.last_step_drafted = self.last_step_accepted = self.last_step_verified = 0
        sampled = [seq for seq in computed if seq in self.scheduler.running]  # not preempted to make room
        rows = [seq.last_hidden for seq in sampled]
        decoded = None  # what the compiled decode step computed, if this step ran it
        drafting = batch is not None and self._drafts_this_step(batch)
        # sequences with drafts, their rows' hidden states and (where the step computed them) logits
        verified: list[tuple[Sequence, torch.Tensor, torch.Tensor | None]] = []
        if batch is not None:
            starts = [seq.num_computed for seq in batch.seqs]
            if drafting:
                drafts = [[] if batch.is_prefill else seq.drafts for seq in batch.seqs]
                all_rows, streams, all_logits = self.runner.forward_rows(batch.seqs, batch.num_tokens, drafts)
                last = torch.stack([r[n - 1] for r, n in zip(all_rows, batch.num_tokens, strict=True)])
            else:
                last, decoded = self.runner.forward(batch.seqs, batch.num_tokens)
            for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
                if drafting and seq.drafts and not batch.is_prefill:  # computed as far as the target accepts
                    verified.append((seq, all_rows[i], all_logits[i] if all_logits is not None else None))
                    continue
                seq.num_computed += n
                seq.last_hidden = last[i]
                if seq.snapshot_at and seq.num_computed == seq.snapshot_at[0]:
                    seq.snapshot_at.pop(0)
                    prefix = self.kv.snapshot(seq, prefix_only=True)
                    outputs.append(RequestOutput(seq.request_id, [], [], False, None, prefix_state=prefix))
                if seq.num_computed == seq.num_tokens:
                    sampled.append(seq)
                    rows.append(last[i])
        if sampled:
            outputs += self._sample(sampled, rows, batch.seqs if batch else [], decoded)
        if verified:
            outputs += self._accept_drafts(verified)
        if drafting:
            self._draft(batch.seqs, streams, starts)
        elif batch is not None:
            for seq in batch.seqs:
                seq.drafts = []
            if self.drafter is not None:  # DSpark's main keys were stored all the same
                self.drafter.keep_up(batch.seqs, starts)
        return outputs

    def _sample(
        self, sampled: list[Sequence], rows: list[torch.Tensor], step_seqs: list[Sequence], decoded: object
    ) -> list[RequestOutput]:
        """Choose each sampled sequence's next token, from its last hidden state `rows`."""
        matchers = [seq.matcher for seq in sampled]
        grammars = self.grammars.step(matchers) if any(m is not None for m in matchers) else None
        tokens, logprobs, tops = self.runner.sample(sampled, rows, grammars, step_seqs, decoded)
        outputs = []
        for seq, token, logprob, top in zip(sampled, tokens, logprobs, tops, strict=True):
            if seq.matcher is not None:
                consume(seq.matcher, token)
            outputs.append(self._emit(seq, [token], [logprob], [top]))
        return outputs

    def _emit(
        self,
        seq: Sequence,
        tokens: list[int],
        logprobs: list[float],
        tops: list[list[tuple[int, float]] | None],
        verified_rows: torch.Tensor | None = None,
    ) -> RequestOutput:
        """Append a step's new tokens to a sequence, up to the first that ends it, and finish it there.
        `verified_rows`: the hidden states of a verify step's rows, of which the pending token's and
        the kept drafts' (all but the last new token's) are now computed."""
        reason = None
        for count, token in enumerate(tokens, 1):
            seq.output_token_ids.append(token)
            seq.output_logprobs.append(logprobs[count - 1])
            if reason := self._finish_reason(seq, token):
                break
        if verified_rows is not None:
            seq.num_computed, seq.last_hidden = seq.num_computed + count, verified_rows[count - 1]
        final_state = None
        if reason:
            if seq.params.keep_final_state:  # everything but the last token, which was never computed
                final_state = self.kv.snapshot(seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
            self.scheduler.remove(seq)
            del self.seqs[seq.request_id]
        return RequestOutput(
            seq.request_id,
            tokens[:count],
            logprobs[:count],
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=len(seq.prompt_token_ids),
            final_state=final_state,
            new_top_logprobs=tops[:count] if tops[0] is not None else None,
        )

    # -- speculative decoding -----------------------------------------------------------------

    def _drafts_this_step(self, batch: object) -> bool:
        """Whether this step runs with the drafter: it computes every row's streams for it, and in a
        decode step verifies the drafts."""
        if self.drafter is None:
            return False
        if batch.is_prefill:
            return not self.speculation.is_off
        return self.speculation.speculates(len(batch.seqs))

    def _accept_drafts(self, verified: list[tuple[Sequence, torch.Tensor, torch.Tensor | None]]) -> list[RequestOutput]:
        """Verify each sequence's drafts against the target's rows [1 + k, hidden] (its pending token's,
        then each draft's): the drafts it accepts and the token it adds after them are the step's
        new tokens (engine/speculation.py), and the rows up to the last accepted draft its computed ones."""
        outputs = []
        for seq, hidden, logits in verified:
            logits = self.model.compute_logits(hidden) if logits is None else logits
            drafts, params = seq.drafts, seq.params
            if params.greedy:
                verdict = verify_greedy(logits.argmax(dim=-1).tolist(), drafts)
            else:
                target = torch.stack([target_probabilities(row, params) for row in logits])  # one row at a time
                verdict = verify_sampled(target, drafts, None, seq.seed, seq.num_tokens)
            normalizer = logits.logsumexp(dim=-1)
            rows = torch.arange(len(verdict.tokens))
            chosen = logits[rows, torch.tensor(verdict.tokens)] - normalizer[rows]
            tops = top_logprobs(logits[rows], normalizer[rows], [seq] * len(rows))
            outputs.append(self._emit(seq, verdict.tokens, chosen.tolist(), tops, verified_rows=hidden))
            self.last_step_drafted += len(drafts)
            self.last_step_accepted += verdict.accepted
        self.last_step_verified = len(verified)
        self.speculation.record(self.last_step_drafted, self.last_step_accepted, len(verified))
        return outputs

    def _draft(self, seqs: list[Sequence], streams: list[torch.Tensor], starts: list[int]) -> None:
        """Give the drafter the rows this step computed that the target keeps; it drafts the next
        step's tokens of the sequences still running."""
        running = [i for i, seq in enumerate(seqs) if not seq.is_finished]
        kept = [streams[i][: seqs[i].num_computed - starts[i]] if streams else None for i in running]
        wanted = [self._draft_count(seqs[i]) for i in running]
        self.drafter.advance([seqs[i] for i in running], kept, [starts[i] for i in running], wanted)

    def _draft_count(self, seq: Sequence) -> int:
        """How many tokens to draft for a sequence: none where the target's choice must be made one
        token at a time (a grammar, a token still held back by min_tokens), and no draft past
        max_tokens or the model length. (A sampled row draws the token a step without drafts
        would: engine/speculation.py.)"""
        params = seq.params
        generated = len(seq.output_token_ids)
        if params.grammar is not None or generated < params.min_tokens:
            return 0
        room = min(params.max_tokens - generated, self.max_model_len - seq.num_tokens) - 1
        return max(0, min(self.speculative_tokens, room))

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
        images: SequenceOf[SequenceOf[ImageSpan]] | None = None,
    ) -> list[CompletionOutput]:
        """Run the prompts to completion, batched together; outputs in prompt order. `images`:
        each prompt's images (add_request's)."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else sampling_params
        if len(params) != len(prompts):
            raise InvalidRequestError("one SamplingParams, or one per prompt")
        ids = [f"generate-{next(self._arrivals)}" for _ in prompts]
        seqs = []
        try:
            for i, (request_id, prompt, p) in enumerate(zip(ids, prompts, params, strict=True)):
                self.add_request(request_id, prompt, p, images=images[i] if images else ())
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
        tokens = self._scored_tokens(token_ids)
        with self.kv.scratch_state(len(tokens)) as (slot, blocks):
            return self.runner.score(tokens, slot, blocks)

    def prompt_logprobs(self, token_ids: SequenceOf[int], top: int) -> list[TokenLogprobs | None]:
        """Per prompt position, the logprob of its token given the ones before it and the `top`
        most likely tokens there (None at position 0: nothing comes before it). One pass over
        the prompt, out of the scheduler (as `score`), keeping one chunk's logits at a time."""
        tokens = self._scored_tokens(token_ids)
        with self.kv.scratch_state(len(tokens)) as (slot, blocks):
            return self.runner.prompt_logprobs(tokens, top, slot, blocks)

    # -- checks -------------------------------------------------------------------------------

    def _checked_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        sampling_params: SamplingParams,
        output_token_ids: SequenceOf[int] = (),
        images: SequenceOf[ImageSpan] = (),
    ) -> tuple[list[int], list[int]]:
        """A new request's prompt and output so far, as lists, once it passes what every way in
        (add_request, resume, the imports) checks: an id not in use, tokens of the vocabulary,
        max_tokens not reached yet, and prompt + max_tokens within the model's context and within
        this engine's state."""
        if request_id in self.seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt = self._validate_tokens(prompt_token_ids, images)
        outputs = self._validate_tokens(output_token_ids) if output_token_ids else []
        if len(outputs) >= sampling_params.max_tokens:
            raise InvalidRequestError(f"request {request_id!r} already has {len(outputs)} of its max_tokens")
        total = len(prompt) + sampling_params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({sampling_params.max_tokens}) = {total} "
                f"exceeds the model's context of {self.max_model_len} tokens"
            )
        if not self.kv.can_ever_hold(total):
            raise InvalidRequestError(
                f"{total} tokens need more state than this engine holds ({self.cache.num_blocks} blocks)"
            )
        return prompt, outputs

    def _scored_tokens(self, token_ids: SequenceOf[int]) -> list[int]:
        """A prompt to score, checked: its tokens, and its length within the model's context."""
        tokens = self._validate_tokens(token_ids)
        if len(tokens) > self.max_model_len:
            raise InvalidRequestError(f"{len(tokens)} tokens exceed the model's context of {self.max_model_len}")
        return tokens

    def _validate_tokens(self, token_ids: SequenceOf[int], images: SequenceOf[ImageSpan] = ()) -> list[int]:
        """The tokens as a list: ids of the vocabulary, and image ids exactly where `images` has rows."""
        tokens = list(token_ids)
        if not tokens:
            raise InvalidRequestError("the prompt is empty")
        in_image = self._image_positions(tokens, images)
        vocab = self.config.vocab_size
        bad = [
            t
            for i, t in enumerate(tokens)
            if not isinstance(t, int)
            or isinstance(t, bool)
            or not (0 <= t < vocab or (i in in_image and t >= IMAGE_ID_BASE))
        ]
        if bad:
            raise InvalidRequestError(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        return tokens

    def _image_positions(self, tokens: list[int], images: SequenceOf[ImageSpan]) -> set[int]:
        """The prompt positions `images` covers, once they are checked: inside the prompt, apart,
        rows of the model's width, every covered position an image id and every image id covered."""
        covered: set[int] = set()
        for image in images:
            if not self.accepts_images:
                raise InvalidRequestError("this model does not read images")
            span = range(image.start, image.end)
            if image.start < 0 or image.end > len(tokens) or covered.intersection(span):
                raise InvalidRequestError(
                    f"an image span [{image.start}, {image.end}) overlaps another or the prompt's end"
                )
            if image.rows.dim() != 2 or image.rows.shape[1] != self.config.hidden_size:
                raise InvalidRequestError(
                    f"an image's rows are {tuple(image.rows.shape)}, not [n, {self.config.hidden_size}]"
                )
            covered.update(span)
        marked = {i for i, t in enumerate(tokens) if isinstance(t, int) and t >= IMAGE_ID_BASE}
        if marked != covered:
            missing, misplaced = len(marked - covered), len(covered - marked)
            raise InvalidRequestError(f"{missing} image positions without rows, {misplaced} rows at text positions")
        return covered

    @property
    def accepts_images(self) -> bool:
        """Whether the model reads image rows in its prompts (DeepSeek-V4.1)."""
        return isinstance(self.config, V41Config)

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
        entry = self.resident.longest(namespace, token_ids, self.reusable_prefix(len(token_ids)))
        return 0 if entry is None else entry.num_tokens

    def reusable_prefix(self, prompt_len: int) -> int:
        """The longest prefix of a prompt of this length whose stored state a request may start from.

        All of it for DeepSeek-V4. For V4.1 with prompt truncation, the prompt's last
        `prefill_keep_tokens` rows are what its YOCO consumer layers compute, and their window must
        see only those rows: they are always computed, never taken from a stored state, which is
        what makes a replay from a cached prefix exact (engine/config_v41.py)."""
        keep = self.prompt_keep_tokens
        return max(0, prompt_len - keep) if keep else prompt_len

    @property
    def prompt_keep_tokens(self) -> int:
        """A prompt's last tokens this engine always computes itself (reusable_prefix; 0: none)."""
        return getattr(self.config, "prefill_keep_tokens", 0)

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


def drafting_method(model: torch.nn.Module, mode: str) -> str | None:
    """Which drafter the engine runs: "mtp" (V4's multi-token-prediction module) or "dspark"
    (V4.1's draft model), each only with the checkpoint's weights; "auto" picks the one the
    checkpoint has; None: the engine does not draft."""
    if mode not in SPECULATIVE_MODES:
        raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {mode!r}")
    has = "mtp" if isinstance(model, DeepseekV4ForCausalLM) else "dspark"
    if not len(model.mtp):
        has = None
    if mode in ("mtp", "dspark") and has != mode:
        weights = "a multi-token-prediction module (mtp.0.*)" if mode == "mtp" else "DSpark's stages (mtp.N.*)"
        family = "DeepSeek-V4" if mode == "mtp" else "DeepSeek-V4.1"
        raise ValueError(f"--speculative {mode} needs a {family} checkpoint with {weights}")
    return None if mode == "off" else has
