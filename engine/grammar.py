"""Constrained decoding: a grammar per request, enforced by masking every token it does not allow.

llguidance compiles the grammar (a JSON schema, a regular expression or a Lark grammar, as the
JSON text `LLMatcher.grammar_from_*` writes) against the model's tokenizer. Each step, every
constrained sequence's matcher writes the tokens it allows as a bitmask row (one bit per token);
the sampler sets the logits of the others to -inf, so a greedy or sampled choice is always one
the grammar takes, and the matcher then consumes it. Unconstrained rows of the same batch are
untouched. Why llguidance and not xgrammar: README, "Structured outputs".

A matcher is a function of the tokens it consumed: an engine that continues a request from its
tokens (a hand-over, a replay after a kill) feeds it the output so far, and the request goes on
exactly where it was.
"""

from __future__ import annotations

from pathlib import Path

import llguidance
import llguidance.torch
import torch

from engine.errors import InvalidRequestError

_BITS = torch.arange(32, dtype=torch.int32)


class GrammarCompiler:
    """The model's tokenizer as llguidance sees it, and matchers made with it."""

    def __init__(self, tokenizer_file: str | Path, vocab_size: int, eos_token_id: int):
        # `slices` speed the mask up for JSON, which is most of what is constrained
        self.tokenizer = llguidance.LLTokenizer(
            str(tokenizer_file), n_vocab=vocab_size, eos_token=eos_token_id, slices=llguidance.LLTokenizer.json_slices()
        )
        self.vocab_size = vocab_size
        self.executor = llguidance.LLExecutor(num_threads=2)

    def matcher(self, grammar: str, consumed: list[int]) -> llguidance.LLMatcher:
        """A matcher for `grammar` that has taken `consumed` (the request's output so far)."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"the output constraint cannot be compiled: {matcher.get_error()}")
        if consumed and not matcher.consume_tokens(consumed):
            raise InvalidRequestError(f"the output so far does not match its constraint: {matcher.get_error()}")
        return matcher

    def constrain(self, logits: torch.Tensor, matchers: list[llguidance.LLMatcher | None]) -> None:
        """Set, in place, the logits of every token a row's grammar does not allow to -inf (rows
        without a matcher unchanged)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        work = [(matchers[i], n) for n, i in enumerate(rows)]
        llguidance.torch.fill_next_token_bitmask_par(self.executor, work, bitmask)
        bitmask = bitmask.to(logits.device)
        if rows == list(range(len(rows))) and logits.shape[1] == words * 32:
            self._mask_blocks(logits[: len(rows)].view(len(rows), words, 32), bitmask)  # in place: a view
            return
        index = torch.tensor(rows, device=logits.device)
        shared = min(logits.shape[1], words * 32)
        blocks = torch.full((len(rows), words * 32), float("-inf"), dtype=logits.dtype, device=logits.device)
        blocks[:, :shared] = logits[index, :shared]
        self._mask_blocks(blocks.view(len(rows), words, 32), bitmask)
        chosen = torch.full((len(rows), logits.shape[1]), float("-inf"), dtype=logits.dtype, device=logits.device)
        chosen[:, :shared] = blocks[:, :shared]  # tokens past the tokenizer's: never allowed
        logits[index] = chosen

    @staticmethod
    def _mask_blocks(blocks: torch.Tensor, bitmask: torch.Tensor) -> None:
        """`blocks` [rows, words, 32]: bit j of word w is token 32w + j. Most words of a mask are
        all refused (0) or all allowed (-1): whole words at once, then the few mixed ones' bits."""
        blocks.masked_fill_((bitmask == 0).unsqueeze(-1), float("-inf"))
        mixed = ((bitmask != 0) & (bitmask != -1)).nonzero(as_tuple=True)
        if len(mixed[0]):
            bits = (bitmask[mixed].unsqueeze(1) >> _BITS.to(bitmask.device)) & 1
            blocks[mixed] = blocks[mixed].masked_fill(bits == 0, float("-inf"))


def consume(matcher: llguidance.LLMatcher, token: int) -> None:
    """The sampled token, which the mask allowed; a matcher that refuses it anyway is a bug."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"the grammar refused token {token} it allowed: {matcher.get_error()}")
