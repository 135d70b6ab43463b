"""Engram: DeepSeek-V4.1's hashed n-gram embeddings.

Each token's window of the last n tokens (n = 2 .. engram_max_ngram_size) is hashed, per Engram
layer and per head, into a row of that layer's table; the rows' embeddings, projected, are added
to the residual streams through a per-stream gate before the layer's attention.

The hash is DeepInfer's and SGLang's (they must agree bit for bit with the tables): token ids
are first mapped to a compressed vocabulary (ids whose normalised text is the same share one),
multiplied by odd per-layer constants from a seeded generator, XOR-ed over the window and taken
modulo a distinct prime per (layer, n, head); each prime owns a segment of the table.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import nn

from common.images import IMAGE_ID_BASE
from engine.checkpoint.quant import scale_values
from engine.config_v41 import V41Config
from engine.errors import UnsupportedCheckpointError
from engine.model.step_input import StepInput

SCALE_GROUP = 32  # FP8 tables: one power-of-two scale per 32 columns of a row
GATE_FLOOR = 1e-6  # |dot| is clamped to this before its square root


@lru_cache(maxsize=4)
def compressed_vocabulary(tokenizer_file: str) -> tuple[tuple[int, ...], int]:
    """Token id -> compressed id, and the compressed vocabulary's size, for a tokenizer.json.

    A token's key is its decoded text normalised (NFKC, NFD, accents stripped, lower case, runs
    of whitespace as one space, stripped, a lone space kept); a token whose text is a partial
    UTF-8 sequence is keyed by its raw form. Keys get ids in first-seen order."""
    from tokenizers import Regex, Tokenizer, normalizers

    sentinel = "\ue000"  # keeps a lone-space token from stripping to ""
    normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    tokenizer = Tokenizer.from_file(tokenizer_file)
    keys: dict[str, int] = {}
    lookup = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        partial_utf8 = "\ufffd" in text
        key = tokenizer.id_to_token(token_id) if partial_utf8 else normalizer.normalize_str(text) or text
        lookup.append(keys.setdefault(key, len(keys)))
    return tuple(lookup), len(keys)


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def table_primes(config: V41Config) -> list[list[list[int]]]:
    """[layer][n - 2][head]: distinct primes drawn in (layer, n, head) order, each run of heads
    starting again above engram_vocab_size - 1."""
    seen: set[int] = set()
    out = []
    for _ in config.engram_layer_ids:
        per_ngram = []
        for _ in config.engram_ngram_sizes:
            current, sizes = config.engram_vocab_size - 1, []
            for _ in range(config.engram_n_heads):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                sizes.append(current)
            per_ngram.append(sizes)
        out.append(per_ngram)
    return out


def hash_multipliers(layer_ids: list[int], max_ngram_size: int, vocab_size: int) -> torch.Tensor:
    """[layers, max_ngram_size]: odd constants from numpy's generator seeded 10007 * layer id,
    bounded so that a compressed id times one fits in int64."""
    bound = max(1, (np.iinfo(np.int64).max // vocab_size) // 2)
    rows = [
        np.random.default_rng(10007 * layer).integers(0, bound, size=max_ngram_size, dtype=np.int64)
        for layer in layer_ids
    ]
    return torch.from_numpy(np.stack(rows) * 2 + 1)


class NgramHasher(nn.Module):
    """Every token's table rows for every Engram layer: [T, layers, (max_ngram_size - 1) * heads]."""

    def __init__(self, config: V41Config, tokenizer_file: str | Path | None):
        super().__init__()
        if tokenizer_file is None or not Path(tokenizer_file).is_file():
            raise UnsupportedCheckpointError(
                f"Engram layers {config.engram_layer_ids} hash the checkpoint's own tokenizer.json, "
                f"which is missing ({tokenizer_file})"
            )
        lookup, size = compressed_vocabulary(str(tokenizer_file))
        expected = config.engram_compressed_vocab_size
        if expected and size != expected:
            raise UnsupportedCheckpointError(
                f"{tokenizer_file} normalises to {size} distinct tokens but engram_compressed_vocab_size is "
                f"{expected}: every Engram hash depends on it (is this the checkpoint's tokenizer?)"
            )
        if len(lookup) < config.vocab_size:  # ids the tokenizer never produces: hashed as padding
            lookup = lookup + (lookup[config.engram_pad_token_id],) * (config.vocab_size - len(lookup))
        primes = table_primes(config)
        # computed on the CPU even while the model is built on the meta device
        flat = torch.tensor([[p for sizes in layer for p in sizes] for layer in primes], dtype=torch.long, device="cpu")
        self.max_ngram_size = config.engram_max_ngram_size
        self.pad = lookup[config.engram_pad_token_id]
        self.register_buffer("token_map", torch.tensor(lookup, dtype=torch.long, device="cpu"), persistent=False)
        self.register_buffer(
            "multipliers", hash_multipliers(config.engram_layer_ids, self.max_ngram_size, size), persistent=False
        )
        self.register_buffer("primes", torch.tensor(primes, dtype=torch.long, device="cpu"), persistent=False)
        self.register_buffer("offsets", flat.cumsum(1) - flat, persistent=False)  # [L, (n - 1) * heads]

    def forward(self, step: StepInput) -> torch.Tensor:
        if step.ngram_context is None:
            raise ValueError("a model with Engram layers needs the step's ngram_context")
        window = torch.cat([step.input_ids.unsqueeze(1), step.ngram_context[:, : self.max_ngram_size - 1]], dim=1)
        # a window reads padding before the sequence's start and, from the first image position
        # it reaches on (the token itself included), padding too (SGLang's `hash_windows`)
        blocked = ((window < 0) | (window >= IMAGE_ID_BASE)).int().cummax(dim=1).values.bool()
        compressed = torch.where(blocked, self.pad, self.token_map[window.masked_fill(blocked, 0)])
        products = compressed.unsqueeze(1) * self.multipliers  # [T, L, n]
        rolling, hashes = products[..., 0], []
        for i in range(1, self.max_ngram_size):
            rolling = torch.bitwise_xor(rolling, products[..., i])  # the (i + 1)-gram's hash
            hashes.append(rolling.unsqueeze(-1) % self.primes[:, i - 1])
        return torch.cat(hashes, dim=-1) + self.offsets


class EngramTable(nn.Module):
    """One layer's table, [rows, dim]: FP8 with a scale per 32 columns as stored, or plain floats.
    The loader leaves a stored table where it is (memory-mapped), so only looked-up rows are read."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, dim), requires_grad=False)
        self.scale: torch.Tensor | None = None

    def forward(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        values = self.weight[rows.reshape(-1)].float()
        if self.scale is not None:
            scales = scale_values(self.scale[rows.reshape(-1)])
            values = (values.unflatten(-1, (-1, SCALE_GROUP)) * scales.unsqueeze(-1)).flatten(-2)
        return values.to(dtype).view(*rows.shape, -1)


class Engram(nn.Module):
    def __init__(self, config: V41Config, layer: int):
        super().__init__()
        self.hash_index = config.engram_layer_ids.index(layer)
        primes = table_primes(config)[self.hash_index]
        columns = len(config.engram_ngram_sizes) * config.engram_n_heads
        h, m = config.hidden_size, config.hc_mult
        self.embed = EngramTable(sum(p for sizes in primes for p in sizes), config.engram_head_dim)
        self.wkv = nn.Linear(columns * config.engram_head_dim, (m + 1) * h, bias=False)
        self.q_weight = nn.Parameter(torch.ones(m, h))
        self.k_weight = nn.Parameter(torch.ones(m, h))
        self.eps = config.rms_norm_eps

    def forward(
        self, streams: torch.Tensor, rows: torch.Tensor, image_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """streams [T, hc, D] plus each stream's gated share of the n-gram value; an image's
        positions (`image_rows`) get nothing."""
        m, d = streams.shape[1:]
        kv = self.wkv(self.embed(rows[:, self.hash_index], streams.dtype).flatten(1))
        key, value = kv.split([m * d, d], dim=-1)
        key = key.float().unflatten(-1, (m, d))
        h = streams.float()
        weight = self.q_weight.float() * self.k_weight.float()
        # normalised per (token, stream) over the hidden size, not across streams
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * weight * key).sum(-1) * rstd * d**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_FLOOR).sqrt(), dot))
        out = (h + gate.unsqueeze(-1) * value.float().unsqueeze(1)).to(streams.dtype)
        return out if image_rows is None else torch.where(image_rows[:, None, None], streams, out)
