"""Token selection: greedy, or temperature with top-k / top-p, from a counter-based random stream.

A sampled token draws one uniform number from hash(seed, position), never from a shared
generator, so the same seed and prompt give the same tokens whatever else is batched
with them, and a preempted request resumes on exactly the stream it left.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.sequence import Sequence

_MASK64 = (1 << 64) - 1


def counter_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) from (seed, position) by the splitmix64 finaliser."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


class Sampler:
    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], constrain: Callable[[torch.Tensor], None] | None = None
    ) -> tuple[list[int], list[float], list[list[tuple[int, float]] | None]]:
        """logits [B, V] (fp32) for the next token of each sequence -> (token ids, their logprobs,
        and for sequences that ask (params.logprobs) the most likely tokens with theirs).
        `constrain`: sets the logits of the tokens grammars refuse to -inf, in place (engine/grammar.py).

        Logprobs are those of the model's own distribution, before temperature, filters and grammars.
        """
        normalizer = logits.logsumexp(dim=-1)  # before a grammar masks anything
        tops = _top_logprobs(logits, normalizer, seqs)
        if constrain is not None:
            constrain(logits)  # the chosen token is always an allowed one: its logit stays as it was
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            temperatures = torch.tensor([seqs[i].params.temperature for i in random_rows], device=logits.device)
            scaled = logits[rows] / temperatures.unsqueeze(1)
            for row, i in enumerate(random_rows):
                scaled[row] = _filter(scaled[row], seqs[i].params.top_k, seqs[i].params.top_p)
            cdf = scaled.softmax(dim=-1).cumsum(dim=-1)
            # the position of the token being sampled identifies its draw
            u = [counter_uniform(seqs[i].seed, seqs[i].num_tokens) for i in random_rows]
            u = torch.tensor(u, dtype=cdf.dtype, device=logits.device).unsqueeze(1) * cdf[:, -1:]
            picked = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=logits.shape[1] - 1)
            # float rounding at the edge of the cdf can land on a refused token: the best allowed one then
            refused = logits[rows].gather(1, picked.unsqueeze(1)).squeeze(1).isinf()
            picked = torch.where(refused, tokens[rows], picked)
            tokens[rows] = picked
        chosen = logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - normalizer
        return tokens.tolist(), chosen.tolist(), tops


def _top_logprobs(
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
