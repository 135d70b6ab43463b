"""Constrained decoding: a grammar per request, enforced by choosing only tokens it allows.

llguidance compiles the grammar (a JSON schema, a regular expression or a Lark grammar, as the
JSON text `LLMatcher.grammar_from_*` writes) against the model's tokenizer. Each step the
sampler (engine/sampler.py) asks a constrained sequence's matcher whether it allows the token
chosen as if free, then a few more likely ones; only when it allows none of them does the
matcher write every token it allows, as a bitmask row (one bit per token), and the choice is
made among those. The matcher then consumes the token. Unconstrained rows of the same batch
are untouched. Why llguidance and not xgrammar: docs/api.md, "Structured outputs".

A matcher is a function of the tokens it consumed: an engine that continues a request from its
tokens (a hand-over, a replay after a kill) feeds it the output so far, and the request goes on
exactly where it was.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path

import llguidance
import torch

from engine.errors import InvalidRequestError

_BITS = torch.arange(32, dtype=torch.int32)


@functools.cache
def _llg_tokenizer(tokenizer_file: str, version: tuple[int, int], vocab_size: int, eos_token_id: int):
    """Read once per process and file version (~2 s for a 129k vocabulary) and shared by its
    engines: it is immutable. `slices` speed the mask up for JSON, most of what is constrained."""
    return llguidance.LLTokenizer(
        tokenizer_file, n_vocab=vocab_size, eos_token=eos_token_id, slices=llguidance.LLTokenizer.json_slices()
    )


class GrammarCompiler:
    """The model's tokenizer as llguidance sees it, and matchers made with it."""

    def __init__(self, tokenizer_file: str | Path, vocab_size: int, eos_token_id: int):
        stat = Path(tokenizer_file).stat()  # a file written again at the same path is read again
        self.tokenizer = _llg_tokenizer(str(tokenizer_file), (stat.st_mtime_ns, stat.st_size), vocab_size, eos_token_id)
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.executor = llguidance.LLExecutor(num_threads=2)

    def matcher(self, grammar: str, consumed: list[int]) -> llguidance.LLMatcher:
        """A matcher for `grammar` that has taken `consumed` (the request's output so far)."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"the output constraint cannot be compiled: {matcher.get_error()}")
        if consumed and not matcher.consume_tokens(consumed):
            raise InvalidRequestError(f"the output so far does not match its constraint: {matcher.get_error()}")
        return matcher

    def step(self, matchers: list[llguidance.LLMatcher | None]) -> StepGrammars:
        """The grammars of one step's rows (None: a row without one), as the sampler uses them."""
        return StepGrammars(self, matchers)

    def allowed(self, matchers: list[llguidance.LLMatcher]) -> list[torch.Tensor]:
        """The ids of the tokens each matcher allows next, ascending (from its bitmask: bit j of
        word w is token 32w + j)."""
        if not matchers:
            return []
        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros((len(matchers), words), dtype=torch.int32)
        # what llguidance.torch.fill_next_token_bitmask_par does, without importing that module:
        # its import compiles a kernel with torch.compile, which loads Dynamo and Inductor (~5 s
        # at every service's start) for a function the engine never calls
        self.executor.unsafe_compute_mask_ptr(
            [(m, n) for n, m in enumerate(matchers)], bitmask.data_ptr(), words * 4, len(matchers)
        )
        allowed = []
        for row in bitmask:
            (used,) = row.nonzero(as_tuple=True)  # most words allow none of their 32 tokens, or all
            bits = ((row[used].unsqueeze(1) >> _BITS) & 1).bool()
            ids = (used.unsqueeze(1) * 32 + _BITS)[bits]
            allowed.append(ids[ids < self.vocab_size])
        return allowed


class StepGrammars:
    """One step's rows under a grammar: what engine/sampler.py asks of them."""

    def __init__(self, compiler: GrammarCompiler, matchers: list[llguidance.LLMatcher | None]):
        self.compiler = compiler
        self.matchers = matchers
        self.rows = [i for i, matcher in enumerate(matchers) if matcher is not None]

    def first_allowed(self, row: int, candidates: Iterable[int]) -> int | None:
        matcher = self.matchers[row]
        # where the grammar forces text, its mask allows one token, the text's own (canonical)
        # tokenization, while validate_tokens takes any spelling of it ("fore" "cas" "t"): a
        # forced token is the answer, whatever the candidates
        if forced := matcher.compute_ff_tokens():
            return forced[0]
        return next((token for token in candidates if self._allows(matcher, token)), None)

    def _allows(self, matcher: llguidance.LLMatcher, token: int) -> bool:
        """As its mask would: the end of sequence once the output may end (validate_tokens refuses it)."""
        if token == self.compiler.eos_token_id:
            return matcher.is_accepting()
        return matcher.validate_tokens([token]) == 1

    def allowed(self, rows: list[int]) -> list[torch.Tensor]:
        return self.compiler.allowed([self.matchers[i] for i in rows])


def consume(matcher: llguidance.LLMatcher, token: int) -> None:
    """The sampled token, which the mask allowed; a matcher that refuses it anyway is a bug."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"the grammar refused token {token} it allowed: {matcher.get_error()}")
