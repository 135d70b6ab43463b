"""DSpark, DeepSeek-V4.1's draft model (`mtp.{i}.*`; DeepInfer's `mtp/dflash.py`, "DFlash").

A few window-only stages that draft a block of tokens in one forward, from what the target model
leaves in their key rings rather than from a hidden state handed over:

- Every target step, for every row it computes, the streams' mean at the attention input of each
  of `dspark_target_layer_ids` (after Engram) is concatenated, projected (`main_proj`,
  `main_norm`), and each stage's key projection (`attn.wkv`, `kv_norm`, RoPE) of it is stored at
  the row's position in that stage's ring: the "main keys".
- A draft block for a sequence whose last computed position is a: the pending token at a + 1,
  then `dspark_noise_token_id` at a + 2 .. a + B (a fixed embedding). Each stage is a V4.1 decoder
  layer (shifted hyper-connections, a MoE of its own size) whose attention stores the block's keys
  at their positions and lets every row of the block read the window [a - W + 1, a + B]: the main
  keys up to a and the whole block, in both directions.
- The last stage's collapse, normed, through the target's head gives each row's logits; row j
  predicts position a + 2 + j. A Markov head adds a low-rank bias from the token before
  (`markov_head.head(markov_head.embed(previous))`), which makes choosing the drafts sequential;
  a confidence head gives each draft's probability of being accepted,
  sigmoid([hidden, markov embedding] . w / T).

Rejected verify rows leave main keys past the accepted position; the next block's keys land on
exactly those positions before anything reads them (the ring has the engine's room for drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.config_v41 import V41Config
from engine.model.step_input import StepInput
from engine.model.v4 import collapse
from engine.state_cache import StateCache

CONFIDENCE_TEMPERATURE = 1.0  # DeepInfer's DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE default


@dataclass
class DraftRows:
    """The rows of a step of draft blocks, B per sequence: each row's slot and position, and the
    window every row of its block reads, [first, last] (`first` also above the sequence's floor)."""

    slots: torch.Tensor  # [R]
    positions: torch.Tensor  # [R]
    first: torch.Tensor  # [R]
    last: torch.Tensor  # [R]
    image_rows = None  # draft rows are never an image's positions (the stages' MoE has no bias_vl)


def block_window(rows: DraftRows, size: int) -> torch.Tensor:
    """[R, size]: which slots of its sequence's ring of `size` each row reads: those holding a
    position in [first, last] (ring slot j holds the latest position <= last that is j mod size)."""
    slots = torch.arange(size, device=rows.last.device)
    held = rows.last.unsqueeze(1) - (rows.last.unsqueeze(1) - slots) % size
    return (held >= 0) & (held >= rows.first.unsqueeze(1))


class MarkovHead(nn.Module):
    """A rank-r bias on the next token's logits from the token before it."""

    def __init__(self, config: V41Config):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.dspark_markov_rank)
        self.head = nn.Linear(config.dspark_markov_rank, config.vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, config: V41Config):
        super().__init__()
        self.proj = nn.Linear(config.hidden_size + config.dspark_markov_rank, 1, bias=False)

    def forward(self, hidden: torch.Tensor, markov: torch.Tensor, temperature: float) -> torch.Tensor:
        """[n, d] and [n, r] -> each draft's probability of being accepted [n] (fp32)."""
        logit = torch.cat([hidden, markov], dim=-1).float() @ self.proj.weight.float().t()
        return torch.sigmoid((logit.squeeze(-1) / temperature).clamp(-60.0, 60.0))


def store_main_keys(
    stages: nn.ModuleList,
    cache: StateCache,
    features: torch.Tensor,
    step: StepInput,
    rope: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """Each stage's main keys of the step's rows, from the target features [T, d * targets], into
    its ring. A prompt chunk longer than the ring stores only its last `ring` rows."""
    size = cache.window[stages[0].attn.ring].shape[1]
    cos, sin = rope
    if step.is_decode:
        slots, positions = step.slots, step.positions
    else:
        rows, slot_ids, begin = [], [], 0
        for s in step.slices:
            first = max(0, s.length - size)
            rows.append(torch.arange(begin + first, begin + s.length))
            slot_ids += [s.slot] * (s.length - first)
            begin += s.length
        kept = torch.cat(rows).to(features.device)
        slots = torch.tensor(slot_ids, dtype=torch.long, device=features.device)
        positions, features, cos, sin = step.positions[kept], features[kept], cos[kept], sin[kept]
    main = stages[0].main_norm(stages[0].main_proj(features))
    for stage in stages:
        cache.window[stage.attn.ring][slots, positions % size] = stage.attn.keys(main, cos, sin)


def block_rows(
    model: nn.Module,
    cache: StateCache,
    pending: torch.Tensor,  # [S] each sequence's pending token
    starts: torch.Tensor,  # [S] its position (the last computed one + 1)
    slots: torch.Tensor,  # [S]
    floors: torch.Tensor,  # [S] the first position whose main keys this engine wrote
    size: int,  # B: rows per block
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's block through the stages: its rows' logits before the Markov bias [S, B, V]
    (fp32) and their hidden states before the norm [S, B, d]. Row j predicts position start + 1 + j."""
    config: V41Config = model.config
    stages = model.mtp
    n_seqs, device = pending.shape[0], pending.device
    tokens = torch.full((n_seqs, size), config.dspark_noise_token_id, dtype=torch.long, device=device)
    tokens[:, 0] = pending
    positions = (starts.unsqueeze(1) + torch.arange(size, device=device)).flatten()
    rows = DraftRows(
        slots=slots.repeat_interleave(size),
        positions=positions,
        first=torch.maximum(starts - config.sliding_window, floors).repeat_interleave(size),
        last=(starts + size - 1).repeat_interleave(size),
    )
    embeds = model.embed(tokens.flatten())
    streams = embeds.unsqueeze(1).expand(-1, config.hc_mult, -1).contiguous()
    pre = torch.zeros(streams.shape[:2], dtype=torch.float32, device=device)
    pre[:, 0] = 1.0  # the first sublayer reads stream 0
    rope = {"main": model.rotary["main"](positions, embeds.dtype)}
    for stage in stages:
        streams, pre = stage(streams, pre, rows, rope, cache, None, None)
    hidden = collapse(pre, streams)  # before the norm: what the confidence head reads
    logits = model.compute_logits(stages[-1].norm(hidden)).float().view(n_seqs, size, -1)
    return logits, hidden.view(n_seqs, size, -1)


def markov_step(
    model: nn.Module, logits: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of each block, given the token before it: its logits with the Markov bias [S, V]
    and its draft's confidence [S]."""
    head_stage = model.mtp[-1]
    markov = head_stage.markov_head.embed(previous)
    corrected = logits + head_stage.markov_head.head(markov).float()
    return corrected, head_stage.confidence_head(hidden, markov, CONFIDENCE_TEMPERATURE)


def draft_blocks(
    model: nn.Module,
    cache: StateCache,
    pending: torch.Tensor,
    starts: torch.Tensor,
    slots: torch.Tensor,
    floors: torch.Tensor,
    size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft `size` tokens after each sequence's pending one (arguments as `block_rows`'): the most
    likely token of each row with the Markov bias from the draft before it (greedy drafts: the
    verify step's rule needs no draft distribution for them), and each draft's confidence.
    -> ([S, B] ids, [S, B] fp32). Every shape is S's and B's: it is also a compiled graph per
    bucket of S (engine/compiled_decode.py)."""
    logits, hidden = block_rows(model, cache, pending, starts, slots, floors, size)
    drafts, confidence = [], []
    previous = pending
    for j in range(size):
        corrected, sure = markov_step(model, logits[:, j], hidden[:, j], previous)
        previous = corrected.argmax(dim=-1)
        drafts.append(previous)
        confidence.append(sure)
    return torch.stack(drafts, dim=1), torch.stack(confidence, dim=1)
