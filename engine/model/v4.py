"""The DeepSeek-V4 architecture over paged state.

Parameter names and shapes match transformers' `DeepseekV4ForCausalLM`, so its checkpoints
load directly. The forward pass is ours: it runs on a flat list of tokens from many
sequences (a `StepInput`), reads and writes the paged `StateCache`, and never
materialises a per-request cache object.

A step is either a prefill step (one or more sequences, each with a chunk of new tokens)
or a decode step (many sequences, one token each). Everything but the attention core is
token-wise and runs on all tokens at once; the attention core is vectorised across
sequences for decode and runs per sequence chunk for prefill.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.backends import TorchBackend, clamped_swiglu
from engine.config import CSA, SLIDING, ModelConfig
from engine.model.rope import RotaryEmbedding, apply_rope_
from engine.model.step_input import SeqSlice, StepInput
from engine.state_cache import CompressorState, StateCache

NEG_INF = float("-inf")


Rope = dict[str, tuple[torch.Tensor, torch.Tensor]]  # rope type -> (cos, sin) at the step's positions


class Projected(NamedTuple):
    """An attention layer's inputs to its core, computed token-wise (Attention.project)."""

    x: torch.Tensor  # [T, hidden]: the layer's normed input (the indexer weighs its heads by it)
    q: torch.Tensor  # [T, H, d]
    kv: torch.Tensor  # [T, d]
    compressed: tuple[torch.Tensor, torch.Tensor] | None  # the compressor's kv and gate inputs [T, width]
    indexed: tuple[torch.Tensor, torch.Tensor] | None  # the indexer's (CSA layers)
    index_queries: torch.Tensor | None  # [T, index heads, index dim] (CSA layers)


class RMSNorm(nn.Module):
    """RMSNorm whose weight stays in fp32; the product is cast back to the input dtype once."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class MergedProjections:
    """Projections of the same input as one matrix product: once the model's weights are in place,
    `merge` stacks theirs and makes each projection's weight a view of its rows (the weights are
    held once, and the modules keep their parameters and names). Until then each runs alone."""

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules  # each with a weight [out, in]
        self.merged: torch.Tensor | None = None
        self.sizes: list[int] = []

    def merge(self) -> None:
        if self.merged is not None:
            return
        weights = [module.weight for module in self.modules]
        merged = torch.cat([weight.detach() for weight in weights])
        start = 0
        for weight in weights:
            weight.data = merged[start : start + weight.shape[0]]
            start += weight.shape[0]
        self.merged, self.sizes = merged, [weight.shape[0] for weight in weights]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.merged is None:
            return [F.linear(x, module.weight) for module in self.modules]
        return list(F.linear(x, self.merged).split(self.sizes, dim=-1))


class GroupedLinear(nn.Linear):
    """Block-diagonal projection: each of `n_groups` head groups is projected on its own."""

    def __init__(self, in_per_group: int, out_features: int, n_groups: int):
        super().__init__(in_per_group, out_features, bias=False)
        self.n_groups = n_groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, G, in] -> [T, G * out / G]
        w = self.weight.view(self.n_groups, -1, x.shape[-1])
        return torch.einsum("tgi,gri->tgr", x, w).flatten(1)


class Compressor(nn.Module):
    """Pools every `rate` tokens into one compressed key/value entry (HCA), or, with `overlap`,
    pools two interleaved series over windows of 2 * rate tokens with stride rate (CSA).

    Entry w covers tokens [w*rate, (w+1)*rate) (plus the previous window's first series
    when overlapping), gets RoPE at position w*rate, and becomes visible to a query at
    position p once p >= (w+1)*rate - 1.
    """

    def __init__(self, config: ModelConfig, rate: int, dim: int, overlap: bool, rotary: RotaryEmbedding):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.rate, self.dim, self.overlap = rate, dim, overlap
        self.kv_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, config.rms_norm_eps)
        self.rotary = rotary

    def with_position_bias(
        self, kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_proj's and gate_proj's outputs for tokens at these positions, the gate's bias added."""
        return kv, (gate + self.position_bias[positions % self.rate]).to(kv.dtype)

    def pool(
        self,
        kv: torch.Tensor,  # [n, rate, width]
        gate: torch.Tensor,
        prev_kv: torch.Tensor | None,  # [n, rate, dim]
        prev_gate: torch.Tensor | None,
        has_prev: torch.Tensor | None,  # [n] bool
        first_positions: torch.Tensor,  # [n]
    ) -> torch.Tensor:
        if self.overlap:
            d = self.dim
            keep = has_prev.view(-1, 1, 1)
            prev_kv = torch.where(keep, prev_kv, torch.zeros_like(prev_kv))
            prev_gate = torch.where(keep, prev_gate, torch.full_like(prev_gate, NEG_INF))
            kv = torch.cat([prev_kv, kv[..., d:]], dim=1)
            gate = torch.cat([prev_gate, gate[..., d:]], dim=1)
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        entries = self.kv_norm((kv * weights).sum(dim=1))
        cos, sin = self.rotary(first_positions, entries.dtype)
        return apply_rope_(entries, cos, sin)

    def update_prefill(self, kv: torch.Tensor, gate: torch.Tensor, s: SeqSlice, state: CompressorState) -> None:
        """Add one sequence chunk's projections to its ring; pool and write every window they close."""
        m = self.rate
        window_start = (s.start // m) * m
        kv, gate, begin = state.add_chunk(s.slot, s.start, kv, gate)  # from the earliest token a closing entry reads
        n_windows = (s.start + s.length) // m - window_start // m
        if n_windows:
            first_entry = window_start // m
            entry_ids = torch.arange(first_entry, first_entry + n_windows, device=kv.device)
            offset = window_start - begin
            prev_kv = prev_gate = has_prev = None
            if self.overlap:
                if offset < m:  # entry 0: nothing before it, masked by has_prev
                    kv, gate = F.pad(kv, (0, 0, m, 0)), F.pad(gate, (0, 0, m, 0))
                    offset += m
                d = self.dim
                prev_kv = kv[offset - m : offset - m + n_windows * m, :d].reshape(n_windows, m, d)
                prev_gate = gate[offset - m : offset - m + n_windows * m, :d].reshape(n_windows, m, d)
                has_prev = entry_ids > 0
            kv_w = kv[offset : offset + n_windows * m].reshape(n_windows, m, -1)
            gate_w = gate[offset : offset + n_windows * m].reshape(n_windows, m, -1)
            entries = self.pool(kv_w, gate_w, prev_kv, prev_gate, has_prev, entry_ids * m)
            block_table = torch.tensor(s.block_table, device=kv.device)
            state.store(block_table[state.block_index(entry_ids)], entry_ids, entries)

    def update_decode(
        self, kv: torch.Tensor, gate: torch.Tensor, step: StepInput, state: CompressorState, scratch_block: int
    ) -> None:
        """Add each sequence's new token's projections to its ring; pool the windows it closes.

        Every row pools its window as if it closed and only the rows whose window did close keep
        the entry (the others write it to the scratch block): the same work whoever closes, so
        the step has no data-dependent shape for a compiler to break on.
        """
        m = self.rate
        window_kv, window_gate = state.add_rows(step.slots, step.positions, kv, gate)  # [B, lookback + m, width]
        closing = step.positions % m == m - 1
        entry_ids = step.positions // m
        prev_kv = prev_gate = has_prev = None
        if self.overlap:
            d = self.dim
            prev_kv, prev_gate, has_prev = window_kv[:, :m, :d], window_gate[:, :m, :d], entry_ids > 0
            window_kv, window_gate = window_kv[:, m:], window_gate[:, m:]
        entries = self.pool(window_kv, window_gate, prev_kv, prev_gate, has_prev, entry_ids * m)
        block_ids = step.block_tables.gather(1, state.block_index(entry_ids).unsqueeze(1)).squeeze(1)
        state.store(torch.where(closing, block_ids, scratch_block), entry_ids, entries)


def prefill_window_keys(
    ring: torch.Tensor, s: SeqSlice, kv: torch.Tensor, window: int, floor: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prompt chunk's sliding-window keys: the ring's earlier positions from `floor` on (read
    before this chunk overwrites the ring), then the chunk's own [S, d]; their bias [S, K] (0 or
    -inf: each query sees the last `window` positions up to itself) and the chunk's positions."""
    size, device = ring.shape[1], kv.device
    n_prior = max(0, min(s.start - floor, window - 1))
    prior_positions = torch.arange(s.start - n_prior, s.start, device=device)
    keys = torch.cat([ring[s.slot, prior_positions % size], kv])
    key_positions = torch.arange(s.start - n_prior, s.start + s.length, device=device)
    query_positions = torch.arange(s.start, s.start + s.length, device=device)
    distance = query_positions.unsqueeze(1) - key_positions.unsqueeze(0)
    bias = torch.zeros(distance.shape, dtype=kv.dtype, device=device)
    bias.masked_fill_((distance < 0) | (distance >= window), NEG_INF)
    return keys, bias, query_positions


def store_prefill_window(ring: torch.Tensor, s: SeqSlice, kv: torch.Tensor, positions: torch.Tensor) -> None:
    """Write a prompt chunk's keys into its ring: the last ring-size of them are all later tokens can see."""
    keep = min(s.length, ring.shape[1])
    ring[s.slot, positions[-keep:] % ring.shape[1]] = kv[-keep:]


def decode_window_keys(
    ring: torch.Tensor, step: StepInput, kv: torch.Tensor, window: int, floor: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's new key into its ring, then its ring as the keys [B, ring, d] and their bias
    [B, ring]: a ring slot counts when it holds one of the last `window` positions up to the
    token's, one that exists (and is at or past `floor` [B], if given). A ring longer than the
    window (room for drafts) holds older positions, or a rejected draft's, that it masks."""
    size, positions = ring.shape[1], step.positions
    ring[step.slots, positions % size] = kv
    keys = ring[step.slots]
    slots = torch.arange(size, device=kv.device)
    # ring slot j holds position p - ((p - j) mod size), or a later one's that a rejected draft wrote
    held = positions.unsqueeze(1) - (positions.unsqueeze(1) - slots) % size
    hidden = (held < 0) | (held <= positions.unsqueeze(1) - window)
    if floor is not None:
        hidden |= held < floor.unsqueeze(1)
    bias = torch.zeros(keys.shape[:2], dtype=kv.dtype, device=kv.device).masked_fill_(hidden, NEG_INF)
    return keys, bias


QUERY_TILE = 128  # the most queries of a long prompt chunk one attention call takes (prefill_attention)


def prefill_attention(
    backend: object,
    q: torch.Tensor,  # [S, H, d]
    keys: torch.Tensor,  # [K, d]: the window's keys in position order (the chunk's own last), then entries
    bias: torch.Tensor,  # [S, K]
    sinks: torch.Tensor,
    scaling: float,
    window_keys: int,
    window: int,
) -> torch.Tensor:
    """A prompt chunk's attention [S, H, d]. A long chunk goes in tiles of QUERY_TILE queries (at
    least a window's), each against the window keys its queries can see (`window` positions back
    from each) and the entry columns one of its queries attends (a top-k's picks): the columns a
    tile leaves out are -inf in all its rows, so the result is the whole chunk's. The scores then
    cost S x (tile + window + picked entries) instead of S x (S + entries): a 1,024-token chunk with
    a 128-token window computes a quarter as many. (The picked entries alone: 1.03x the step at
    2,048 tokens on small, 1.05x on small-v41 and 1.09x at 8,192, where random weights pick widely;
    a tile's queries that pick alike leave more columns out.)"""

    def attend(rows: slice, tile_keys: torch.Tensor, tile_bias: torch.Tensor) -> torch.Tensor:
        queries = q[rows].transpose(0, 1).unsqueeze(0)
        return backend.attention(queries, tile_keys.unsqueeze(0), tile_bias.unsqueeze(0), sinks, scaling)[0]

    n = q.shape[0]
    tile = max(QUERY_TILE, window)
    if n <= 2 * tile:
        return attend(slice(0, n), keys, bias)
    prior = window_keys - n  # the window's keys from before the chunk
    outs = []
    for begin in range(0, n, tile):
        rows = slice(begin, min(n, begin + tile))
        seen = slice(max(0, prior + begin - window + 1), prior + rows.stop)  # from what its first query sees
        entry_bias = bias[rows, window_keys:]
        used = (entry_bias > NEG_INF).any(dim=0).nonzero().squeeze(1)  # the entries some query of the tile attends
        tile_keys = torch.cat([keys[seen], keys[window_keys:][used]])
        tile_bias = torch.cat([bias[rows, seen], entry_bias[:, used]], dim=1)
        outs.append(attend(rows, tile_keys, tile_bias))
    return torch.cat(outs)


def with_entries(
    keys: torch.Tensor, bias: torch.Tensor, entries: torch.Tensor, attended: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Window keys [..., K, d] and bias [..., S, K] extended by compressed entries [..., n, d], each
    query attending to those `attended` [..., S, n] marks."""
    entry_bias = torch.zeros(attended.shape, dtype=bias.dtype, device=bias.device).masked_fill_(~attended, NEG_INF)
    return torch.cat([keys, entries], dim=-2), torch.cat([bias, entry_bias], dim=-1)


def gather_entries(state: CompressorState, block_table: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` entries of one sequence, [count, dim]."""
    n_blocks = -(-count // state.entries_per_block)
    return state.entries[block_table[:n_blocks]].flatten(0, 1)[:count]


def select_topk(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` best entries per row of `scores` [..., n], best first.

    ReLU makes exact ties common (an entry every head scores negative gets exactly 0),
    and `torch.topk` breaks ties differently for different tensor lengths. Ties go to the
    earlier entry, so the choice never depends on chunking, padding or batching: cached,
    chunked and batched runs all select the same entries. That is a stable descending
    sort's first `count`; a top-k over keys that no two entries share is the same choice
    at a fraction of the sort's cost: the score's bits turned into an integer of the same
    order, then the entry's place from the end.
    """
    length = scores.shape[-1]
    bits = torch.where(scores == 0, 0.0, scores).view(torch.int32)  # -0.0 becomes +0.0: the two tie
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # negative floats count down
    later = torch.arange(length - 1, -1, -1, device=scores.device)
    return (ordered * (1 << 32) + later).topk(count, dim=-1).indices


SCORE_BATCH = 1 << 24  # the most [query, head, entry] products a prompt chunk's indexer holds at once (64 MB)


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """The lightning indexer's scores, sum_h weights[h] * scale * relu(q_h . k), in fp32: q [..., H, dI]
    against keys [..., T, dI] (decode rows, each its own) or [T, dI] (a prompt chunk's, shared by its
    queries), weights [..., H] -> [..., T]. The steps after the product run in place on it (the same
    values as out of place, 2.5x faster for a 1,024-token chunk). A chunk's queries go a slice at a
    time, its products never more than SCORE_BATCH: at 131,072 entries, all of a 1,024-token
    chunk's at once would be 17 GB with 32 heads. Each slice's rows are computed as they would be
    all at once."""
    if keys.dim() == 2:
        rows = max(1, SCORE_BATCH // max(1, q.shape[-2] * keys.shape[0]))
        if q.shape[0] > rows:
            slices = range(0, q.shape[0], rows)
            return torch.cat([index_scores(q[b : b + rows], keys, weights[b : b + rows], scale) for b in slices])
    raw = torch.matmul(q.float(), keys.float().transpose(-1, -2)).relu_()  # [..., H, T]
    if scale != 1.0:
        raw.mul_(scale)
    return raw.mul_(weights.float().unsqueeze(-1)).sum(dim=-2)


class IndexerScorer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.weights_proj = nn.Linear(config.hidden_size, config.index_n_heads, bias=False)


class Indexer(Compressor):
    """Lightning indexer: its own compressed keys at index_head_dim, scored against per-token
    queries as sum_h w_h * relu(q_h . k); each query keeps its top-k compressed entries."""

    def __init__(self, config: ModelConfig, rate: int, rotary: RotaryEmbedding):
        super().__init__(config, rate, config.index_head_dim, overlap=True, rotary=rotary)
        self.num_heads, self.topk = config.index_n_heads, config.index_topk
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.dim, bias=False)
        self.scorer = IndexerScorer(config)
        self.softmax_scale = self.dim**-0.5
        self.weights_scaling = self.num_heads**-0.5

    def queries(self, projected: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q_b_proj's output [T, heads * dim] -> rotated queries [T, heads, dim]."""
        q = projected.reshape(projected.shape[0], self.num_heads, self.dim)
        return apply_rope_(q, cos.unsqueeze(1), sin.unsqueeze(1))

    def select(self, scores: torch.Tensor, count: int) -> torch.Tensor:
        return select_topk(scores, count)

    def scores(self, q: torch.Tensor, keys: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """q [..., H, dI], keys [..., T, dI] or a chunk's [T, dI], x [..., hidden] -> [..., T] (index_scores)."""
        weights = self.scorer.weights_proj(x).float() * self.weights_scaling  # [..., H]
        return index_scores(q, keys, weights, self.softmax_scale)


class CSACompressor(Compressor):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding):
        rate = config.compress_rates[CSA]
        super().__init__(config, rate, config.head_dim, overlap=True, rotary=rotary)
        self.indexer = Indexer(config, rate, rotary)


class Attention(nn.Module):
    """Shared-KV multi-query attention over a sliding window plus compressed entries, with
    per-head attention sinks and a grouped low-rank output projection."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: dict[str, RotaryEmbedding]):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.state_index = layer_idx  # which of the cache's window rings and compressors are this layer's
        self.layer_type = config.layer_types[layer_idx]
        self.rope_type = "main" if self.layer_type == SLIDING else "compress"
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.window = config.sliding_window
        self.scaling = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.kv_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_a_proj = GroupedLinear(
            self.num_heads * self.head_dim // config.o_groups, config.o_groups * config.o_lora_rank, config.o_groups
        )
        self.o_b_proj = nn.Linear(config.o_groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.backend = TorchBackend()
        self.compressor: Compressor | None = None
        if self.layer_type == CSA:
            self.compressor = CSACompressor(config, rotary["compress"])
        elif self.layer_type != SLIDING:
            rate = config.compress_rate(layer_idx)
            self.compressor = Compressor(config, rate, self.head_dim, overlap=False, rotary=rotary["compress"])
        # what reads the layer's input, and what reads the query's low-rank residual
        inputs, queries = [self.q_a_proj, self.kv_proj], [self.q_b_proj]
        if self.compressor is not None:
            inputs += [self.compressor.kv_proj, self.compressor.gate_proj]
        if self.layer_type == CSA:
            inputs += [self.compressor.indexer.kv_proj, self.compressor.indexer.gate_proj]
            queries.append(self.compressor.indexer.q_b_proj)
        self.input_projections, self.query_projections = MergedProjections(inputs), MergedProjections(queries)

    def forward(self, x: torch.Tensor, step: StepInput, rope: Rope, cache: StateCache) -> torch.Tensor:
        return self.output(self.attend(self.project(x, step.positions, rope), step, cache), rope)

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope) -> Projected:
        """The token-wise part before the attention core: every token's query, key and compressor
        inputs, computed for all sequences at once."""
        n_tokens = x.shape[0]
        cos, sin = rope[self.rope_type]
        q_a, kv, *compressor_inputs = self.input_projections(x)
        q_residual = self.q_a_norm(q_a)
        q, *index_q = self.query_projections(q_residual)
        q = q.reshape(n_tokens, self.num_heads, self.head_dim)
        q = apply_rope_(unweighted_rms_norm(q, self.eps), cos.unsqueeze(1), sin.unsqueeze(1))
        kv = apply_rope_(self.kv_norm(kv), cos, sin)
        compressed = indexed = index_queries = None
        if self.compressor is not None:
            compressed = self.compressor.with_position_bias(*compressor_inputs[:2], positions)
            if self.layer_type == CSA:
                indexed = self.compressor.indexer.with_position_bias(*compressor_inputs[2:], positions)
                index_queries = self.compressor.indexer.queries(index_q[0], *rope["compress"])
        return Projected(x, q, kv, compressed, indexed, index_queries)

    def attend(self, projected: Projected, step: StepInput, cache: StateCache) -> torch.Tensor:
        """The attention core [T, H, d]: writes the step's keys and compressed entries into the state
        and attends over it, vectorised across sequences for decode, per sequence chunk for prefill."""
        x, q, kv, compressed, indexed, index_queries = projected
        compressor = cache.compressors.get(self.state_index)
        indexer = cache.indexers.get(self.state_index)
        if step.is_decode:
            if compressed is not None:
                self.compressor.update_decode(*compressed, step, compressor, cache.scratch_block)
            if indexed is not None:
                self.compressor.indexer.update_decode(*indexed, step, indexer, cache.scratch_block)
            return self._decode(q, kv, x, index_queries, step, cache)
        outs, begin = [], 0
        for s in step.slices:
            chunk = slice(begin, end := begin + s.length)
            if compressed is not None:
                self.compressor.update_prefill(compressed[0][chunk], compressed[1][chunk], s, compressor)
            if indexed is not None:
                self.compressor.indexer.update_prefill(indexed[0][chunk], indexed[1][chunk], s, indexer)
            chunk_queries = index_queries[chunk] if index_queries is not None else None
            outs.append(self._prefill(q[chunk], kv[chunk], x[chunk], chunk_queries, s, cache))
            begin = end
        return torch.cat(outs)

    def output(self, out: torch.Tensor, rope: Rope) -> torch.Tensor:
        """The token-wise part after the attention core: its output [T, H, d] projected back to [T, hidden]."""
        cos, sin = rope[self.rope_type]
        # K = V, so the values carry RoPE too: rotate the output back by the query position.
        out = apply_rope_(out, cos.unsqueeze(1), -sin.unsqueeze(1))
        grouped = self.o_a_proj(out.reshape(out.shape[0], self.config.o_groups, -1))
        return self.o_b_proj(grouped)

    def _prefill(
        self,
        q: torch.Tensor,  # [S, H, d]
        kv: torch.Tensor,  # [S, d]
        x: torch.Tensor,
        index_queries: torch.Tensor | None,  # [S, index heads, index dim] on CSA layers
        s: SeqSlice,
        cache: StateCache,
    ) -> torch.Tensor:
        device = q.device
        window = cache.window[self.state_index]
        keys, bias, query_positions = prefill_window_keys(window, s, kv, self.window, s.keep_from)
        window_keys = keys.shape[0]

        if self.compressor is not None:
            rate = self.compressor.rate
            count = (s.start + s.length) // rate
            block_table = torch.tensor(s.block_table, dtype=torch.long, device=device)
            entries = gather_entries(cache.compressors[self.state_index], block_table, count)
            visible = torch.arange(count, device=device).unsqueeze(0) < ((query_positions + 1) // rate).unsqueeze(1)
            if self.layer_type == CSA and count:
                indexer = self.compressor.indexer
                index_keys = gather_entries(cache.indexers[self.state_index], block_table, count)
                scores = indexer.scores(index_queries, index_keys, x)
                scores = scores.masked_fill(~visible, NEG_INF)
                top = indexer.select(scores, min(indexer.topk, count))
                chosen = torch.zeros_like(visible).scatter_(1, top, True)
                visible = visible & chosen
            keys, bias = with_entries(keys, bias, entries, visible)

        out = prefill_attention(self.backend, q, keys, bias, self.sinks, self.scaling, window_keys, self.window)
        store_prefill_window(window, s, kv, query_positions)
        return out

    def _decode(
        self,
        q: torch.Tensor,  # [B, H, d]
        kv: torch.Tensor,  # [B, d]
        x: torch.Tensor,
        index_queries: torch.Tensor | None,  # [B, index heads, index dim] on CSA layers
        step: StepInput,
        cache: StateCache,
    ) -> torch.Tensor:
        positions = step.positions
        keys, bias = decode_window_keys(cache.window[self.state_index], step, kv, self.window, step.keep_from)

        if self.compressor is not None:
            state = cache.compressors[self.state_index]
            rate = self.compressor.rate
            counts = (positions + 1) // rate  # [B]
            all_entries = state.entries[step.block_tables].flatten(1, 2)  # [B, blocks * per_block, d]
            entry_ids = torch.arange(all_entries.shape[1], device=q.device)
            visible = entry_ids.unsqueeze(0) < counts.unsqueeze(1)
            if self.layer_type == CSA:
                indexer = self.compressor.indexer
                index_keys = cache.indexers[self.state_index].entries[step.block_tables].flatten(1, 2)
                scores = indexer.scores(index_queries, index_keys, x).masked_fill(~visible, NEG_INF)
                top = indexer.select(scores, min(indexer.topk, all_entries.shape[1]))  # [B, k]
                visible = visible.gather(1, top)
                all_entries = all_entries.gather(1, top.unsqueeze(-1).expand(-1, -1, all_entries.shape[-1]))
            keys, bias = with_entries(keys, bias, all_entries, visible)

        out = self.backend.attention(q.unsqueeze(2), keys, bias.unsqueeze(1), self.sinks, self.scaling)  # [B, 1, H, d]
        return out.squeeze(1)


class MLP(nn.Module):
    """The shared expert: SwiGLU with the gate clamped from above and the up projection clamped both ways."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.moe_intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.moe_intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.moe_intermediate_size, config.hidden_size, bias=False)
        self.limit = config.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.from_projections(self.gate_proj(x), self.up_proj(x))

    def from_projections(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The output, given gate_proj's and up_proj's."""
        return self.down_proj(clamped_swiglu(gate, up, self.limit))


class Experts(nn.Module):
    """Routed experts stored as 3-D tensors, [E, 2I, D] (gate rows then up rows) and [E, D, I]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        e, d, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.zeros(e, d, i))
        self.limit = config.swiglu_limit

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.backend.routed_experts(x, indices, weights, self.gate_up_proj, self.down_proj, self.limit)


class Router(nn.Module):
    """Learned top-k router (`moe`) or a frozen token-id -> experts table (`hash_moe`); both weight
    the chosen experts by normalised scores."""

    def __init__(self, config: ModelConfig, hashed: bool):
        super().__init__()
        self.hashed = hashed
        self.top_k = config.num_experts_per_tok
        self.scoring = config.scoring_func
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen experts and their weights, from the router's logits (x @ weight^T)."""
        if self.scoring == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.scoring == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        if self.hashed:
            indices = self.tid2eid[input_ids].long()
        else:
            indices = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        return indices, routing_weights(scores, indices, self.scaling)


def routing_weights(scores: torch.Tensor, indices: torch.Tensor, scaling: float) -> torch.Tensor:
    """The chosen experts' weights: their scores normalised to sum 1, times the routed scaling factor."""
    weights = scores.gather(1, indices)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scaling


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.gate = Router(config, hashed=config.mlp_layer_types[layer_idx] == "hash_moe")
        self.experts = Experts(config)
        self.shared_experts = MLP(config)
        shared = self.shared_experts
        self.input_projections = MergedProjections([self.gate, shared.gate_proj, shared.up_proj])

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        router_logits, gate, up = self.input_projections(x)
        indices, weights = self.gate(router_logits, input_ids)
        return self.experts(x, indices, weights) + self.shared_experts.from_projections(gate, up)


class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connection: from the hc_mult residual streams, compute how to
    collapse them into the block input (pre), spread the block output back (post) and mix
    the streams (comb, projected onto doubly stochastic matrices by Sinkhorn-Knopp)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        n = config.hc_mult
        self.n, self.iters, self.eps, self.norm_eps = n, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * config.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pre, post, comb = hc_mixes(streams, self.fn, self.base, self.scale, self.iters, self.eps, self.norm_eps)
        return post, comb, collapse(pre, streams)


def hc_mixes(
    streams: torch.Tensor,  # [T, n, D]
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A hyper-connection's weights for these streams: pre [T, n] (collapse into the block input),
    post [T, n] (spread the block output) and comb [T, n, n] (doubly stochastic by Sinkhorn-Knopp)."""
    n = streams.shape[1]
    mixes = normalized_projection(streams, fn, norm_eps)
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def normalized_projection(streams: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.linear(rms_normalise(streams flattened), weight) in fp32.

    The RMS scale is one scalar per token, so it is applied after the (tiny) projection
    instead of to the full-width input: the same value without a copy of the streams.
    """
    flat = streams.flatten(1).float()
    mean_square = torch.linalg.vector_norm(flat, dim=-1, keepdim=True).square() / flat.shape[1]
    return F.linear(flat, weight) * torch.rsqrt(mean_square + eps)


def collapse(weights: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * streams[t, j]: [T, n] x [T, n, D] -> [T, D]."""
    return torch.einsum("tn,tnd->td", weights, streams.float()).to(streams.dtype)


class HyperHead(nn.Module):
    """Final collapse of the residual streams into one hidden state."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        n = config.hc_mult
        self.eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * config.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = normalized_projection(streams, self.hc_fn, self.norm_eps)
        return collapse(torch.sigmoid(mixes * self.hc_scale + self.hc_base) + self.eps, streams)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: dict[str, RotaryEmbedding]):
        super().__init__()
        self.self_attn = Attention(config, layer_idx, rotary)
        self.mlp = SparseMoeBlock(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, streams: torch.Tensor, step: StepInput, rope: Rope, cache: StateCache) -> torch.Tensor:
        post, comb, projected = self.before_attention(streams, step.positions, rope)
        out = self.self_attn.attend(projected, step, cache)
        return self.after_attention(streams, post, comb, out, rope, step.input_ids)

    # The layer apart from its attention core: token-wise, so the same for any mix of sequences in a
    # step, and what a compiled prefill step compiles (engine/compiled_prefill.py).

    def before_attention(
        self, streams: torch.Tensor, positions: torch.Tensor, rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor, Projected]:
        """The attention block's hyper-connection weights (post, comb) and its projected inputs."""
        post, comb, collapsed = self.attn_hc(streams)
        return post, comb, self.self_attn.project(self.input_layernorm(collapsed), positions, rope)

    def after_attention(
        self,
        streams: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        out: torch.Tensor,
        rope: Rope,
        input_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The new residual streams, from the attention core's output: the attention block's
        output projection and mix, then the MoE block."""
        streams = expand_and_mix(post, self.self_attn.output(out, rope), comb, streams)
        post, comb, collapsed = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(collapsed), input_ids)
        return expand_and_mix(post, out, comb, streams)


def expand_and_mix(post: torch.Tensor, out: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """New streams: the block output spread by `post`, plus the old streams mixed by comb^T
    (stream k gets sum_j comb[j, k] * streams[j]; Sinkhorn's comb is not symmetric)."""
    dtype = streams.dtype
    spread = post.to(dtype).unsqueeze(-1) * out.unsqueeze(1)
    return torch.baddbmm(spread, comb.to(dtype).transpose(-1, -2), streams)


class MultiTokenPrediction(DecoderLayer):
    """A multi-token-prediction module of the published checkpoints (`mtp.N.*`), the drafter of
    speculative decoding (engine/drafter.py): a sliding-window decoder layer whose row at position
    p takes token p + 1's embedding (e_proj) added to each of the main model's residual streams
    at p (h_proj), and predicts token p + 2 through a head of its own and the main model's output
    projection. Its window ring is its own, after the main layers' (`state_index`)."""

    def __init__(self, config: ModelConfig, rotary: dict[str, RotaryEmbedding], index: int = 0):
        block = replace(config, num_hidden_layers=1, layer_types=[SLIDING], mlp_layer_types=["moe"])
        super().__init__(block, 0, rotary)
        self.self_attn.state_index = config.num_hidden_layers + index
        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.hc_head = HyperHead(config)
        self.norm = RMSNorm(d, eps)

    def draft(
        self, embeds: torch.Tensor, streams: torch.Tensor, step: StepInput, rope: Rope, cache: StateCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [T, d] of the next tokens and the streams [T, n, d] before them -> (the final
        hidden state [T, d] that predicts the token after, this module's own streams [T, n, d])."""
        combined = self.e_proj(self.enorm(embeds)).unsqueeze(1) + self.h_proj(self.hnorm(streams))
        out = self.forward(combined, step, rope, cache)
        return self.norm(self.hc_head(out)), out


class DeepseekV4Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        rope_dim, max_pos = config.rope_head_dim, config.max_position_embeddings
        self.rotary = {
            label: RotaryEmbedding(config.rope_parameters[label], rope_dim, max_pos) for label in ("main", "compress")
        }
        # built on the meta device and filled from the checkpoint: given its (empty) weight, the
        # embedding skips a random init whose meta-device path imports Dynamo (~3 s a process)
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i, self.rotary) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(config)

    def forward(self, step: StepInput, cache: StateCache) -> torch.Tensor:
        return self.norm(self.hc_head(self.streams(step, cache)))

    def streams(self, step: StepInput, cache: StateCache) -> torch.Tensor:
        """The residual streams [T, hc_mult, hidden] after the last layer, before the final collapse."""
        embeds = self.embed_tokens(step.input_ids)
        rope = self.rope(step.positions, embeds.dtype)
        streams = embeds.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, step, rope, cache)
        return streams

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        return {label: rotary(positions, dtype) for label, rotary in self.rotary.items()}


# Parameters that stay in fp32 whatever the checkpoint dtype (as in the reference).
FP32_PARAMETER_SUFFIXES = (
    "attn_hc.fn",
    "attn_hc.base",
    "attn_hc.scale",
    "ffn_hc.fn",
    "ffn_hc.base",
    "ffn_hc.scale",
    "hc_head.hc_fn",
    "hc_head.hc_base",
    "hc_head.hc_scale",
    "sinks",
    "position_bias",
    "e_score_correction_bias",
    "norm.weight",
    "layernorm.weight",
)


class DeepseekV4ForCausalLM(nn.Module):
    fp32_parameter_suffixes = FP32_PARAMETER_SUFFIXES

    def __init__(self, config: ModelConfig, mtp_modules: int = 0):
        super().__init__()
        self.config = config
        self.model = DeepseekV4Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.backend = TorchBackend()
        self.mtp = nn.ModuleList(MultiTokenPrediction(config, self.model.rotary, i) for i in range(mtp_modules))

    def forward(self, step: StepInput, cache: StateCache) -> torch.Tensor:
        """Final hidden states [T, hidden] of every token in the step."""
        return self.model(step, cache)

    def forward_with_streams(self, step: StepInput, cache: StateCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states [T, hidden] and the residual streams [T, hc_mult, hidden] they
        collapse (what the multi-token-prediction module drafts from)."""
        streams = self.model.streams(step, cache)
        return self.model.norm(self.model.hc_head(streams)), streams

    def merge_projections(self) -> None:
        """Projections of the same input become one matrix product each (MergedProjections); once the
        weights are in place, before the model runs. Idempotent."""
        for module in self.modules():
            for projections in (getattr(module, "input_projections", None), getattr(module, "query_projections", None)):
                if projections is not None:
                    projections.merge()

    def use_backend(self, backend: object) -> None:
        """Route the attention core and the routed experts of every layer through `backend`."""
        for module in self.modules():
            if isinstance(module, (Attention, Experts)):
                module.backend = backend
        self.lm_head.backend = backend

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] in fp32."""
        return self.lm_head.backend.output_logits(hidden, self.lm_head.weight)
