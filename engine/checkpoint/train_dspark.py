"""Self-distillation of a random-weight V4.1 checkpoint's DSpark stages (engine/model/dspark.py).

As engine/checkpoint/train_drafter.py does for V4's MTP module: the target (frozen) generates
greedy continuations of random prompts and gives its features at every position once; the
stages then learn to draft a block as they do in serving. Each example is an anchor a: main
keys of positions a - W + 1 .. a from the target's features (through the stages' own
projections, which train too), a block of the token at a + 1 and noise tokens, and row j's logits
with the Markov bias of the true token before it, against the true token at a + 2 + j
(cross-entropy); the confidence head learns whether the row's argmax is that token. The block
runs through the serving code (`block_rows`), over a scratch state cache.
`deepmesh make-model D --preset tiny-v41-dspark --train-drafter STEPS` runs it.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.checkpoint.loader import load_model
from engine.checkpoint.make_model_v41 import _stored
from engine.checkpoint.train_drafter import DifferentiableBackend, greedy_sequences, train_module
from engine.model import SeqSlice, StepInput, ngram_context
from engine.model.dspark import block_rows, draft_blocks, markov_step, store_main_keys
from engine.state_cache import StateCache


def target_features(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """The target's DSpark features [len, hidden * targets] at every position of one sequence."""
    cache = StateCache(model.config, StateCache.blocks_needed(len(tokens)), 1, torch.float32, "cpu")
    step = StepInput.of(torch.tensor(tokens), [SeqSlice(0, 0, len(tokens), list(range(cache.num_blocks)))])
    if model.ngram_context:
        step.ngram_context = ngram_context([], tokens, model.ngram_context)
    out: list[torch.Tensor] = []
    with torch.no_grad():
        model(step, cache, features_out=out)
    return out[0]


Example = tuple[list[int], int, torch.Tensor]  # tokens, prompt length, features


def _anchors(
    examples: list[Example], picks: list[tuple[int, int]], cache: StateCache, size: int, model: torch.nn.Module
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Main keys of each picked (example, anchor a) into slot i's rings. Returns, per pick, the
    tokens at a + 1 .. a + B (each block row's token before the one it predicts) and at
    a + 2 .. a + B + 1 (what the rows should predict), [S, B] each, and each block's start a + 1."""
    window = model.config.sliding_window
    slices, rows, positions = [], [], []
    for slot, (i, a) in enumerate(picks):
        low = max(0, a - window + 1)
        slices.append(SeqSlice(slot, low, a + 1 - low, []))
        rows.append(examples[i][2][low : a + 1])
        positions.extend(range(low, a + 1))
    step = StepInput(torch.zeros(len(positions), dtype=torch.long), torch.tensor(positions), slices)
    store_main_keys(model.mtp, cache, torch.cat(rows), step, model.rotary["main"](step.positions, torch.float32))
    before = torch.tensor([examples[i][0][a + 1 : a + 1 + size] for i, a in picks])
    targets = torch.tensor([examples[i][0][a + 2 : a + 2 + size] for i, a in picks])
    return before, targets, torch.tensor([a + 1 for _, a in picks])


def _pick(examples: list[Example], count: int, size: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """Random anchors whose first drafted position is a generated token and whose block fits."""
    picks = []
    for i in torch.randint(len(examples), (count,), generator=gen).tolist():
        tokens, prompt_len, _ = examples[i]
        low, high = prompt_len - 2, len(tokens) - size - 2
        picks.append((i, int(torch.randint(low, high + 1, (1,), generator=gen))))
    return picks


def train_dspark(
    model: torch.nn.Module,
    sequences: list[tuple[list[int], int]],
    steps: int = 1000,
    batch_size: int = 8,
    learning_rate: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    """Train model.mtp (every stage) in place; the target stays frozen. Returns each step's loss."""
    size = model.config.dspark_block_size
    for stage in model.mtp:
        stage.attn.backend = DifferentiableBackend()
    examples = _examples(model, sequences)
    cache = _scratch(model, batch_size, size)
    gen = torch.Generator().manual_seed(seed)

    def step_loss() -> torch.Tensor:
        cache.window = [ring.detach() for ring in cache.window]  # the last step's keys are not this one's graph
        before, targets, starts = _anchors(examples, _pick(examples, batch_size, size, gen), cache, size, model)
        slots = torch.arange(batch_size)
        logits, hidden = block_rows(model, cache, before[:, 0], starts, slots, torch.zeros_like(slots), size)
        loss = torch.zeros(())
        for j in range(size):
            corrected, sure = markov_step(model, logits[:, j], hidden[:, j], before[:, j])
            loss = loss + F.cross_entropy(corrected, targets[:, j])
            right = (corrected.argmax(dim=-1) == targets[:, j]).float()
            loss = loss + 0.1 * F.binary_cross_entropy(sure.clamp(1e-6, 1 - 1e-6), right)
        return loss / size

    return train_module(model, model.mtp, steps, learning_rate, step_loss)


def _scratch(model: torch.nn.Module, sequences: int, size: int) -> StateCache:
    config = model.config
    return StateCache(config, 1, sequences, torch.float32, "cpu", lookahead=size, draft_layers=len(model.mtp))


def block_accuracy(model: torch.nn.Module, examples: list[Example], anchors: int = 64) -> tuple[float, float]:
    """Over random anchors of these continuations: how often the first draft is the target's greedy
    token, and the mean number of drafts, from the first, that are (what greedy verification accepts)."""
    size = model.config.dspark_block_size
    picks = _pick(examples, anchors, size, torch.Generator().manual_seed(1))
    cache = _scratch(model, len(picks), size)
    with torch.no_grad():
        before, targets, starts = _anchors(examples, picks, cache, size, model)
        slots = torch.arange(len(picks))
        drafts, _ = draft_blocks(model, cache, before[:, 0], starts, slots, torch.zeros_like(slots), size)
    right = drafts == targets
    accepted = right.int().cumprod(dim=1).sum(dim=1).float()
    return float(right[:, 0].float().mean()), float(accepted.mean())


def _examples(model: torch.nn.Module, sequences: list[tuple[list[int], int]]) -> list[Example]:
    return [(tokens, n, target_features(model, tokens)) for tokens, n in sequences]


def train_checkpoint_dspark(
    path: str | Path,
    steps: int = 1000,
    seed: int = 0,
    learning_rate: float = 3e-3,
    continuations: int | None = None,
    new_tokens: int = 112,
    held_out: int = 16,
    anchors: int = 64,
) -> tuple:
    """Train the DSpark stages of the V4.1 checkpoint at `path` (unquantized) on `continuations`
    greedy continuations (default: one per 4 steps, at least 64) and write them back. Returns
    (first draft right, mean drafts accepted) at `anchors` places of `held_out` other
    continuations, before and after."""
    path = Path(path)
    model = load_model(path, dtype=torch.float32)
    if not len(model.mtp) or not model.config.has_dspark:
        raise ValueError(f"{path} has no DSpark stages (write it with --preset tiny-v41-dspark)")
    train = greedy_sequences(model, continuations or max(steps // 4, 64), 16, new_tokens, seed)
    others = _examples(model, greedy_sequences(model, held_out, 16, new_tokens, seed + 1))  # the target's: frozen
    before = block_accuracy(model, others, anchors)
    train_dspark(model, train, steps, learning_rate=learning_rate, seed=seed)
    after = block_accuracy(model, others, anchors)
    weights = path / "model.safetensors"
    stored = load_file(weights)
    for name, value in model.mtp.state_dict(prefix="mtp.").items():
        for stored_name, tensor in _stored(name, value.detach(), None).items():
            if stored_name not in stored:
                raise ValueError(f"{weights} has no {stored_name} to write the trained stages into")
            stored[stored_name] = tensor.to(stored[stored_name].dtype).contiguous()
    save_file(stored, str(weights), metadata={"format": "pt"})
    return before, after
