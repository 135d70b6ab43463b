"""Self-distillation of a random-weight checkpoint's multi-token-prediction module.

A random-weight drafter accepts almost nothing, so speculative decoding cannot be measured on
the presets as made. This trains the MTP module of a checkpoint in the published layout on
the model's own greedy continuations: the main model (frozen) gives its residual streams at
each position, and the module learns to predict the token two ahead from them and the next
token, as it drafts in serving (engine/drafter.py). Minutes on a CPU for the tiny presets;
`deepmesh make-model --train-drafter` runs it and writes the trained module back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor

from engine.backends import TorchBackend
from engine.checkpoint.loader import load_model
from engine.checkpoint.make_model import _stored_tensors
from engine.model import DeepseekV4ForCausalLM, SeqSlice, StepInput
from engine.sequence import SamplingParams
from engine.state_cache import StateCache

logger = logging.getLogger(__name__)


class DifferentiableBackend(TorchBackend):
    """The serving attention (TorchBackend's) without its in-place steps, which autograd refuses."""

    @staticmethod
    def attention(
        q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        b, h, s, d = q.shape
        logits = torch.bmm((q * scaling).reshape(b, h * s, d), keys.transpose(1, 2)).view(b, h, s, -1)
        logits = logits + bias.unsqueeze(1)
        normaliser = torch.logaddexp(logits.logsumexp(dim=-1, keepdim=True), sinks.view(1, h, 1, 1).to(logits.dtype))
        probs = (logits - normaliser).exp().to(keys.dtype)
        return torch.bmm(probs.view(b, h * s, -1), keys).view(b, h, s, d).transpose(1, 2)


def greedy_sequences(
    model: DeepseekV4ForCausalLM, count: int, prompt_len: int, new_tokens: int, seed: int
) -> list[tuple[list[int], int]]:
    """(tokens, prompt length) of `count` random prompts followed by the model's greedy continuation."""
    from engine import LLMEngine

    engine = LLMEngine(model, max_num_seqs=16, max_num_batched_tokens=2048)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist() for _ in range(count)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    return [(p + out.token_ids, len(p)) for p, out in zip(prompts, engine.generate(prompts, params), strict=True)]


def _sequences_step(sequences: list[list[int]], cache: StateCache, first_position: int = 0) -> StepInput:
    """One step computing each sequence from `first_position`, sequence i in slot i."""
    per_block = cache.blocks_needed(max(len(tokens) for tokens in sequences) + first_position)
    slices, positions = [], []
    for i, tokens in enumerate(sequences):
        blocks = list(range(i * per_block, (i + 1) * per_block)) if cache.uses_blocks else []
        slices.append(SeqSlice(i, first_position, len(tokens), blocks))
        positions.extend(range(first_position, first_position + len(tokens)))
    input_ids = torch.tensor([t for tokens in sequences for t in tokens], dtype=torch.long)
    return StepInput(input_ids, torch.tensor(positions), slices)


def _scratch_cache(model: DeepseekV4ForCausalLM, sequences: int, length: int) -> StateCache:
    blocks = sequences * StateCache.blocks_needed(length)
    return StateCache(model.config, blocks, sequences, torch.float32, "cpu", draft_layers=1)


def _main_streams(model: DeepseekV4ForCausalLM, sequences: list[tuple[list[int], int]]) -> list[torch.Tensor]:
    """The main model's streams [len, hc, d] at every position of each sequence."""
    cache = _scratch_cache(model, 1, max(len(tokens) for tokens, _ in sequences))
    with torch.no_grad():
        return [
            model.forward_with_streams(_sequences_step([tokens], cache), cache)[1].float() for tokens, _ in sequences
        ]


def _examples(model: DeepseekV4ForCausalLM, sequences: list[tuple[list[int], int]]) -> list[tuple]:
    """(tokens, prompt length, the main model's streams) of each sequence."""
    streams = _main_streams(model, sequences)
    return [(tokens, n, rows) for (tokens, n), rows in zip(sequences, streams, strict=True)]


def _first_drafts(
    model: DeepseekV4ForCausalLM, batch: list[tuple[list[int], int, torch.Tensor]], cache: StateCache
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module's logits at every row of these sequences (row p: token p + 2 from token p + 1
    and the streams at p), the tokens they should give, and which rows follow generated tokens."""
    module = model.mtp[0]
    step = _sequences_step([tokens[1:-1] for tokens, _, _ in batch], cache)
    embeds = model.model.embed_tokens(step.input_ids)
    rope = model.model.rope(step.positions, embeds.dtype)
    streams = torch.cat([streams[: len(tokens) - 2] for tokens, _, streams in batch])
    hidden, _ = module.draft(embeds, streams, step, rope, cache)
    targets = torch.tensor([t for tokens, _, _ in batch for t in tokens[2:]])
    # the prompt's random tokens teach nothing: only rows predicting a generated token count
    generated = torch.cat([torch.arange(2, len(tokens)) >= prompt_len for tokens, prompt_len, _ in batch])
    return model.compute_logits(hidden), targets, generated


def train_module(
    model: torch.nn.Module, module: torch.nn.Module, steps: int, learning_rate: float, step_loss: Callable[[], Tensor]
) -> list[float]:
    """Train `module`'s parameters in place, the rest of `model` frozen: Adam with a cosine schedule
    on `step_loss()`, one batch per call. Returns the loss of every step."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    trained = [p for p in module.parameters() if p.is_floating_point()]
    for parameter in trained:
        parameter.requires_grad_(True)
    optimizer = torch.optim.Adam(trained, lr=learning_rate)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    losses = []
    for step in range(steps):
        loss = step_loss()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        if step % 50 == 0:
            logger.info("drafter step %d: loss %.3f", step, losses[-1])
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return losses


def train_mtp(
    model: DeepseekV4ForCausalLM,
    sequences: list[tuple[list[int], int]],
    steps: int = 300,
    batch_size: int = 8,
    learning_rate: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    """Train model.mtp[0] in place; the main model stays frozen. Returns the loss of every step."""
    module = model.mtp[0]
    module.self_attn.backend = DifferentiableBackend()
    examples = _examples(model, sequences)
    cache = _scratch_cache(model, batch_size, max(len(tokens) for tokens, _ in sequences))
    order = torch.Generator().manual_seed(seed)

    def step_loss() -> Tensor:
        picked = torch.randint(len(examples), (batch_size,), generator=order).tolist()
        cache.window = [ring.detach() for ring in cache.window]  # the last step's keys are not this one's graph
        logits, targets, generated = _first_drafts(model, [examples[i] for i in picked], cache)
        return F.cross_entropy(logits[generated], targets[generated])

    return train_module(model, module, steps, learning_rate, step_loss)


def draft_accuracy(model: DeepseekV4ForCausalLM, examples: list[tuple]) -> float:
    """How often the module's first draft is the model's greedy token, over the generated positions
    of these examples (`_examples`)."""
    cache = _scratch_cache(model, 1, max(len(tokens) for tokens, _, _ in examples))
    right = total = 0
    with torch.no_grad():
        for example in examples:
            logits, targets, generated = _first_drafts(model, [example], cache)
            right += int((logits.argmax(dim=-1) == targets)[generated].sum())
            total += int(generated.sum())
    return right / max(total, 1)


def train_checkpoint_drafter(
    path: str | Path, steps: int = 2000, seed: int = 0, learning_rate: float = 3e-3
) -> tuple[float, float]:
    """Train the MTP module of the checkpoint at `path` (published layout, unquantized) and write it
    back into its safetensors file. Returns the first draft's accuracy before and after, on
    continuations it was not trained on. One continuation per step is made to train on: with
    fewer, the module learns them by heart (400 continuations for 3,000 steps: 28% right on
    others, 2,000: 37%)."""
    path = Path(path)
    model = load_model(path, dtype=torch.float32)
    if not len(model.mtp):
        raise ValueError(f"{path} has no multi-token-prediction module (write it with --format deepseek)")
    train = greedy_sequences(model, max(steps, 64), 16, 112, seed)
    held_out = _examples(model, greedy_sequences(model, 16, 16, 112, seed + 1))  # the main model's: frozen
    before = draft_accuracy(model, held_out)
    train_mtp(model, train, steps, learning_rate=learning_rate, seed=seed)
    after = draft_accuracy(model, held_out)
    weights = path / "model.safetensors"
    stored = load_file(weights)
    trained = {name: value.detach() for name, value in model.mtp.state_dict(prefix="mtp.").items()}
    for name, value in _stored_tensors(trained, set(), None, "deepseek").items():
        if name not in stored:
            raise ValueError(f"{weights} has no {name} to write the trained module into")
        stored[name] = value.to(stored[name].dtype).contiguous()
    save_file(stored, str(weights), metadata={"format": "pt"})
    return before, after
