"""The DeepSeek-V4.1 architecture (`deepseek_v41`, the model DeepInfer runs) over paged state.

Module and parameter names are the checkpoint's own (`layers.3.attn.wq_a.weight`), as DeepInfer's
and SGLang's loaders read them; routed experts are fused into 3-D tensors as in the V4 model.
The math follows DeepInfer 0.1.0 (its plain-torch `*_ref` kernels and its modules), SGLang
0.5.23 where DeepInfer calls kernels whose source it does not ship.

What differs from V4 (engine/model/v4.py), layer by layer:
- attention: no per-head query norm; compression ratios 0 / 1 / 2 with no position bias and no
  overlapping windows; every compressed layer is sparse (top-`index_topk` entries); index keys
  are projected from the compressed latent (`indexer.wk`, `k_norm`), not from a compressor of
  their own; KV, index keys and top-k are shared across layers (`*_source_layer_ids`); a
  candidate-source layer picks blocks of entries that later indexers search within;
- YOCO: from the first ratio-1 layer on, the compressed KV a layer owns is projected from that
  boundary layer's normalised input (the "shared hidden"); with prefill truncation a prompt's
  rows before its last `prefill_keep_tokens` skip those layers (their window never reaches
  before that point), which keeps a prefix's state exact to replay;
- hyper-connections are shifted: each sublayer collapses the streams with the `pre` weights its
  predecessor computed, and the final collapse uses the last one's (there is no HC head);
- Engram layers add hashed n-gram embeddings to the residual streams before attention;
- MoE has no hash-routed layers and a second correction bias (`bias_vl`) for image tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.backends import TorchBackend, clamped_swiglu
from engine.config_v41 import V41Config
from engine.model.dspark import ConfidenceHead, DraftRows, MarkovHead, block_window, store_main_keys
from engine.model.engram import Engram, NgramHasher
from engine.model.rope import RotaryEmbedding, apply_rope_
from engine.model.step_input import SeqSlice, StepInput
from engine.model.v4 import (
    NEG_INF,
    Experts,
    GroupedLinear,
    RMSNorm,
    collapse,
    decode_window_keys,
    expand_and_mix,
    gather_entries,
    hc_mixes,
    index_scores,
    prefill_attention,
    prefill_window_keys,
    routing_weights,
    select_topk,
    store_prefill_window,
    with_entries,
)
from engine.state_cache import CompressorState, StateCache

Rope = dict[str, tuple[torch.Tensor, torch.Tensor]]


class Projected(NamedTuple):
    """An attention layer's token-wise inputs to its core (`Attention.project`)."""

    q: torch.Tensor  # [T, H, d]
    kv: torch.Tensor  # [T, d]
    index_q: torch.Tensor | None
    index_w: torch.Tensor | None


@dataclass
class StepContext:
    """What the attention layers of one step hand each other, per prefill slice (decode: one, the
    batch): an index source's choice of entries (`chosen`, [rows, entries] masks by layer) and the
    candidate source's blocks (`candidates`), which later index sources search within."""

    chosen: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    candidates: list[torch.Tensor] = field(default_factory=list)


class Compressor(nn.Module):
    """Ratio r in {1, 2}: entry j is the r tokens [j*r, (j+1)*r) pooled with a per-channel
    softmax over their scores (ratio 1: the token's projection itself), RMS-normalised. The
    normalised entry is kept un-rotated for the index keys; the attention key gets RoPE at j*r."""

    def __init__(self, config: V41Config, rate: int):
        super().__init__()
        self.rate = rate
        self.wkv = nn.Linear(config.hidden_size, config.head_dim, bias=False)
        if rate > 1:
            self.wgate = nn.Linear(config.hidden_size, config.head_dim, bias=False)
        self.norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.wkv(x), (self.wgate(x) if self.rate > 1 else None)

    def pool(self, latent: torch.Tensor, score: torch.Tensor | None) -> torch.Tensor:
        """[n, rate, d] windows -> [n, d] normalised entries (before RoPE)."""
        if score is None:
            return self.norm(latent[:, 0])
        weights = score.softmax(dim=1, dtype=torch.float32)
        return self.norm((latent.float() * weights).sum(dim=1).to(latent.dtype))

    def close_prefill(
        self, latent: torch.Tensor, score: torch.Tensor | None, s: SeqSlice, state: CompressorState
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Add a chunk's projections to the sequence's ring; (entry ids, entries) of the windows it closes."""
        r = self.rate
        window_start = (s.start // r) * r
        if r > 1:  # from the window open at the chunk's start (ratio 1 has none)
            latent, score, _ = state.add_chunk(s.slot, s.start, latent, score)
        n = (s.start + s.length) // r - window_start // r
        if not n:
            return None
        windows = latent[: n * r].view(n, r, -1)
        scores = score[: n * r].view(n, r, -1) if score is not None else None
        first = window_start // r
        return torch.arange(first, first + n, device=latent.device), self.pool(windows, scores)

    def close_decode(
        self, latent: torch.Tensor, score: torch.Tensor | None, step: StepInput, state: CompressorState
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each sequence's new token into its ring: (entry ids, entries, which rows closed one).
        Every row pools as if it closed, so the step's shapes do not depend on the data."""
        r = self.rate
        entry_ids = step.positions // r
        if r == 1:
            return entry_ids, self.pool(latent.unsqueeze(1), None), torch.ones_like(entry_ids, dtype=torch.bool)
        entries = self.pool(*state.add_rows(step.slots, step.positions, latent, score))
        return entry_ids, entries, step.positions % r == r - 1


class Indexer(nn.Module):
    """Scores compressed entries for each query: sum over heads of relu(q_h . k) * w_h
    (`index_scores`), with the head weights w from the layer input. Index keys (`wk`, `k_norm`)
    exist on index-key sources."""

    def __init__(self, config: V41Config, owns_keys: bool):
        super().__init__()
        self.num_heads, self.dim = config.index_n_heads, config.index_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)
        if owns_keys:
            self.wk = nn.Linear(config.head_dim, self.dim, bias=False)
            self.k_norm = RMSNorm(self.dim, config.rms_norm_eps)

    def keys(self, pre_rope: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope_(self.k_norm(self.wk(pre_rope)), cos, sin)

    def queries(self, q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.wq_b(q_residual).view(q_residual.shape[0], self.num_heads, self.dim)
        return apply_rope_(q, cos.unsqueeze(1), sin.unsqueeze(1))


def candidate_mask(scores: torch.Tensor, counts: torch.Tensor, block_size: int, topk_blocks: int) -> torch.Tensor:
    """The candidate source's choice: blocks of `block_size` entries scored by their best entry,
    the block holding the newest visible entry always kept; the best `topk_blocks` blocks' entries.

    scores [rows, n] (-inf where not visible), counts [rows] visible entries -> mask [rows, n]."""
    n = scores.shape[-1]
    n_blocks = -(-n // block_size)
    padded = F.pad(scores, (0, n_blocks * block_size - n), value=NEG_INF)
    block_scores = padded.view(scores.shape[0], n_blocks, block_size).amax(dim=-1)
    valid_blocks = -(-counts // block_size)  # [rows]
    block_ids = torch.arange(n_blocks, device=scores.device)
    block_scores = block_scores.masked_fill(block_ids == (valid_blocks - 1).unsqueeze(1), float("inf"))
    block_scores = block_scores.masked_fill(block_ids >= valid_blocks.unsqueeze(1), NEG_INF)
    top = select_topk(block_scores, min(topk_blocks, n_blocks))
    chosen = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(1, top, True)
    chosen &= block_ids < valid_blocks.unsqueeze(1)
    return chosen.repeat_interleave(block_size, dim=1)[:, :n]


class AttentionProjections(nn.Module):
    """The projections of a V4.1 attention (its layers' and DSpark's stages'): a low-rank query, one
    shared key-value head with RoPE, per-head sinks and a grouped low-rank output."""

    def __init__(self, config: V41Config):
        super().__init__()
        self.config = config
        self.num_heads, self.head_dim, self.window = config.num_attention_heads, config.head_dim, config.sliding_window
        self.scaling = self.head_dim**-0.5
        h, rq = config.hidden_size, config.q_lora_rank
        self.wq_a = nn.Linear(h, rq, bias=False)
        self.q_norm = RMSNorm(rq, config.rms_norm_eps)
        self.wq_b = nn.Linear(rq, self.num_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(h, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.wo_a = GroupedLinear(
            self.num_heads * self.head_dim // config.o_groups, config.o_groups * config.o_lora_rank, config.o_groups
        )
        self.wo_b = nn.Linear(config.o_groups * config.o_lora_rank, h, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.backend = TorchBackend()

    def queries(self, q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The heads' queries [T, H, d] from the low-rank residual `q_norm(wq_a(x))`."""
        q = self.wq_b(q_residual).view(q_residual.shape[0], self.num_heads, self.head_dim)
        return apply_rope_(q, cos.unsqueeze(1), sin.unsqueeze(1))

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope_(self.kv_norm(self.wkv(x)), cos, sin)

    def output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Heads' outputs [T, H, d] -> [T, hidden]. K = V, so the values carry RoPE too: the output
        is rotated back by the query position first."""
        out = apply_rope_(out, cos.unsqueeze(1), -sin.unsqueeze(1))
        return self.wo_b(self.wo_a(out.reshape(out.shape[0], self.config.o_groups, -1)))


class Attention(AttentionProjections):
    """Shared-KV multi-query attention over a sliding window of this layer's own keys plus, on
    compressed layers, the top-k entries of its KV source, with per-head sinks and a grouped
    low-rank output projection."""

    def __init__(self, config: V41Config, layer: int, rotary: RotaryEmbedding):
        super().__init__(config)
        self.layer = layer
        self.rotary = rotary  # the compressed layers' RoPE, for the entries' positions
        self.rate = config.compress_rate(layer)
        self.rope_type = "compress" if self.rate else "main"
        self.compressor = Compressor(config, self.rate) if config.owns_compressor(layer) else None
        self.indexer = Indexer(config, config.owns_index_keys(layer)) if config.owns_indexer(layer) else None
        self.owns_index_keys = config.owns_index_keys(layer)
        self.kv_source = config.kv_source(layer) if self.rate else None
        self.index_source = config.index_source(layer) if self.rate else None
        self.is_candidate_source = self.rate > 0 and config.candidate_source == layer
        self.uses_candidates = self.rate > 0 and config.uses_candidates(layer)

    def forward(
        self, x: torch.Tensor, step: StepInput, rope: Rope, cache: StateCache, ctx: StepContext
    ) -> torch.Tensor:
        out = self.attend(x, self.project(x, rope), step, cache, ctx)
        return self.output(out, *rope[self.rope_type])

    # The attention apart from its core: token-wise, so the same for any mix of sequences in a step,
    # and what a compiled prefill step compiles (engine/compiled_prefill.py).

    def project(self, x: torch.Tensor, rope: Rope) -> Projected:
        """Every row's queries, key, and index queries and weights (None without an indexer)."""
        cos, sin = rope[self.rope_type]
        q_residual = self.q_norm(self.wq_a(x))
        index_q = index_w = None
        if self.indexer is not None:
            index_q = self.indexer.queries(q_residual, cos, sin)
            index_w = self.indexer.weights_proj(x)
        return Projected(self.queries(q_residual, cos, sin), self.keys(x, cos, sin), index_q, index_w)

    def attend(
        self, x: torch.Tensor, projected: Projected, step: StepInput, cache: StateCache, ctx: StepContext
    ) -> torch.Tensor:
        """The attention core [T, H, d]: compresses the layer's input rows `x` into its entries
        (a consumer layer's come from the shared hidden: see the model), writes the window's keys
        and attends, vectorised across sequences for decode, per sequence chunk for prefill."""
        q, kv, index_q, index_w = projected
        if self.compressor is not None and not self.config.is_consumer(self.layer):
            self.compress(x, step, cache)
        if step.is_decode:
            return self._decode(q, kv, index_q, index_w, step, cache, ctx)
        outs, begin = [], 0
        for i, s in enumerate(step.slices):
            rows = slice(begin, begin + s.length)
            iq, iw = (index_q[rows], index_w[rows]) if index_q is not None else (None, None)
            outs.append(self._prefill(q[rows], kv[rows], iq, iw, i, s, cache, ctx))
            begin += s.length
        return torch.cat(outs)

    # -- compressed state --------------------------------------------------------------------------

    def compress(self, x: torch.Tensor, step: StepInput, cache: StateCache) -> None:
        """New entries (and index keys) of this KV source from its input rows `x` of `step`."""
        latent, score = self.compressor.project(x)
        state = cache.compressors[self.layer]
        if step.is_decode:
            entry_ids, entries, closed = self.compressor.close_decode(latent, score, step, state)
            block_ids = step.block_tables.gather(1, state.block_index(entry_ids).unsqueeze(1)).squeeze(1)
            self._store(torch.where(closed, block_ids, cache.scratch_block), entry_ids, entries, cache)
            return
        begin = 0
        for s in step.slices:
            rows = slice(begin, begin + s.length)
            begin += s.length
            closed = self.compressor.close_prefill(latent[rows], score[rows] if score is not None else None, s, state)
            if closed is not None:
                entry_ids, entries = closed
                table = torch.tensor(s.block_table, dtype=torch.long, device=x.device)
                self._store(table[state.block_index(entry_ids)], entry_ids, entries, cache)

    def _store(
        self, block_ids: torch.Tensor, entry_ids: torch.Tensor, pre_rope: torch.Tensor, cache: StateCache
    ) -> None:
        cos, sin = self.rotary(entry_ids * self.rate, pre_rope.dtype)
        if self.owns_index_keys:
            cache.indexers[self.layer].store(block_ids, entry_ids, self.indexer.keys(pre_rope, cos, sin))
        cache.compressors[self.layer].store(block_ids, entry_ids, apply_rope_(pre_rope.clone(), cos, sin))

    # -- which entries each query attends to --------------------------------------------------------

    def _select(
        self,
        scores: torch.Tensor | None,  # [rows, n] fp32, -inf where not visible (index sources)
        visible: torch.Tensor,  # [rows, n]
        counts: torch.Tensor,  # [rows] visible entries
        key: int,  # the prefill slice (0 in decode: the batch is one)
        ctx: StepContext,
    ) -> torch.Tensor:
        """The entries each row attends to [rows, n] bool: its own top-k, or its index source's."""
        if scores is None:
            return ctx.chosen[self.index_source][key]
        if self.uses_candidates:
            scores = scores.masked_fill(~ctx.candidates[key], NEG_INF)
        n = scores.shape[-1]
        top = select_topk(scores, min(self.config.index_topk, n))
        chosen = torch.zeros_like(visible).scatter_(1, top, True) & (scores > NEG_INF)
        ctx.chosen.setdefault(self.layer, []).append(chosen)
        if self.is_candidate_source:
            block_size = self.config.candidate_block_size_for(self.layer)
            blocks = candidate_mask(scores, counts, block_size, self.config.candidate_topk_blocks)
            ctx.candidates.append(blocks)
        return chosen

    def _prefill(
        self,
        q: torch.Tensor,  # [S, H, d]
        kv: torch.Tensor,  # [S, d]
        index_q: torch.Tensor | None,
        index_w: torch.Tensor | None,
        key: int,
        s: SeqSlice,
        cache: StateCache,
        ctx: StepContext,
    ) -> torch.Tensor:
        device = q.device
        window = cache.window[self.layer]
        # a consumer layer's window never reaches before the rows the prompt keeps for it
        floor = s.keep_from if self.config.is_consumer(self.layer) else 0
        keys, bias, query_positions = prefill_window_keys(window, s, kv, self.window, floor)
        window_keys = keys.shape[0]
        if self.rate:
            count = (s.start + s.length) // self.rate
            table = torch.tensor(s.block_table, dtype=torch.long, device=device)
            entries = gather_entries(cache.compressors[self.kv_source], table, count)
            counts = (query_positions + 1) // self.rate
            visible = torch.arange(count, device=device).unsqueeze(0) < counts.unsqueeze(1)
            scores = None
            if self.indexer is not None:
                index_keys = gather_entries(cache.indexers[self.kv_source], table, count)
                scores = index_scores(index_q, index_keys, index_w).masked_fill(~visible, NEG_INF)
            keys, bias = with_entries(keys, bias, entries, self._select(scores, visible, counts, key, ctx) & visible)

        out = prefill_attention(self.backend, q, keys, bias, self.attn_sink, self.scaling, window_keys, self.window)
        store_prefill_window(window, s, kv, query_positions)
        return out

    def _decode(
        self,
        q: torch.Tensor,  # [B, H, d]
        kv: torch.Tensor,  # [B, d]
        index_q: torch.Tensor | None,
        index_w: torch.Tensor | None,
        step: StepInput,
        cache: StateCache,
        ctx: StepContext,
    ) -> torch.Tensor:
        positions = step.positions
        floor = step.keep_from if self.config.is_consumer(self.layer) else None
        keys, bias = decode_window_keys(cache.window[self.layer], step, kv, self.window, floor)
        if self.rate:
            entries = cache.compressors[self.kv_source].entries[step.block_tables].flatten(1, 2)  # [B, n, d]
            counts = (positions + 1) // self.rate
            visible = torch.arange(entries.shape[1], device=q.device).unsqueeze(0) < counts.unsqueeze(1)
            scores = None
            if self.indexer is not None:
                index_keys = cache.indexers[self.kv_source].entries[step.block_tables].flatten(1, 2)
                scores = index_scores(index_q, index_keys, index_w).masked_fill(~visible, NEG_INF)
            keys, bias = with_entries(keys, bias, entries, self._select(scores, visible, counts, 0, ctx) & visible)
        out = self.backend.attention(q.unsqueeze(2), keys, bias.unsqueeze(1), self.attn_sink, self.scaling)
        return out.squeeze(1)


class Gate(nn.Module):
    """The MoE router: sqrt(softplus) scores, top-k by score plus a correction bias (`bias_vl` for
    image tokens), weights from the unbiased scores."""

    def __init__(self, config: V41Config):
        super().__init__()
        self.top_k, self.scaling = config.num_experts_per_tok, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, image_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.softplus(F.linear(x, self.weight).float()).sqrt()
        bias = self.bias if image_rows is None else torch.where(image_rows.unsqueeze(1), self.bias_vl, self.bias)
        indices = torch.topk(scores + bias, self.top_k, dim=-1, sorted=False).indices
        return indices, routing_weights(scores, indices, self.scaling)


class SharedExpert(nn.Module):
    def __init__(self, config: V41Config):
        super().__init__()
        h, i = config.hidden_size, config.moe_intermediate_size * config.n_shared_experts
        self.w1, self.w3 = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.w2 = nn.Linear(i, h, bias=False)
        self.limit = config.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class MoE(nn.Module):
    def __init__(self, config: V41Config):
        super().__init__()
        self.gate = Gate(config)
        self.experts = Experts(config)
        self.shared_experts = SharedExpert(config)

    def forward(self, x: torch.Tensor, image_rows: torch.Tensor | None = None) -> torch.Tensor:
        indices, weights = self.gate(x, image_rows)
        return self.experts(x, indices, weights) + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, config: V41Config, layer: int, rotary: RotaryEmbedding):
        super().__init__()
        self.config, self.layer = config, layer
        self.add_norms_and_mixes(config)
        self.attn = Attention(config, layer, rotary)
        self.ffn = MoE(config)
        self.engram = Engram(config, layer) if layer in config.engram_layer_ids else None

    def add_norms_and_mixes(self, config: V41Config) -> None:
        """The sublayers' input norms and hyper-connection weights."""
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        mixes, width = (2 + config.hc_mult) * config.hc_mult, config.hc_mult * config.hidden_size
        for sublayer in ("attn", "ffn"):
            self.register_parameter(f"hc_{sublayer}_fn", nn.Parameter(torch.zeros(mixes, width, dtype=torch.float32)))
            self.register_parameter(f"hc_{sublayer}_base", nn.Parameter(torch.zeros(mixes, dtype=torch.float32)))
            self.register_parameter(f"hc_{sublayer}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def mixes(self, sublayer: str, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.config
        fn, base, scale = (getattr(self, f"hc_{sublayer}_{part}") for part in ("fn", "base", "scale"))
        return hc_mixes(streams, fn, base, scale, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)

    def attn_input(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The attention sublayer's input: the streams collapsed by the previous sublayer's `pre`."""
        return self.attn_norm(collapse(pre, streams))

    def forward(
        self,
        streams: torch.Tensor,  # [T, hc, D]
        pre: torch.Tensor,  # [T, hc]: the previous sublayer's collapse weights
        step: StepInput,
        rope: Rope,
        cache: StateCache,
        ctx: StepContext,
        ngram_rows: torch.Tensor | None,
        features: dict[int, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        streams, x, attn_pre, post, comb = self.before_attention(streams, pre, ngram_rows, step.image_rows)
        if features is not None:  # a DSpark target layer: its attention input, the streams' mean
            features[self.layer] = stream_mean(streams)
        out = self.attn(x, step, rope, cache, ctx)
        return self.after_attention(streams, attn_pre, post, comb, out, step.image_rows)

    # The layer apart from its attention: token-wise, so the same for any mix of sequences in a
    # step, and what a compiled prefill step compiles (engine/compiled_prefill.py).

    def before_attention(
        self,
        streams: torch.Tensor,
        pre: torch.Tensor,
        ngram_rows: torch.Tensor | None,
        image_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The streams with the layer's Engram added, the attention's input, and the attention
        sublayer's hyper-connection weights (pre, post, comb)."""
        if self.engram is not None:
            streams = self.engram(streams, ngram_rows, image_rows)
        x = self.attn_input(streams, pre)
        attn_pre, post, comb = self.mixes("attn", streams)
        return streams, x, attn_pre, post, comb

    def after_attention(
        self,
        streams: torch.Tensor,
        attn_pre: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        out: torch.Tensor,  # [T, hidden]: the attention's output
        image_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The new streams and the MoE sublayer's `pre` (the next one's collapse weights)."""
        streams = expand_and_mix(post, out, comb, streams)
        x = self.ffn_norm(collapse(attn_pre, streams))
        ffn_pre, post, comb = self.mixes("ffn", streams)
        streams = expand_and_mix(post, self.ffn(x, image_rows), comb, streams)
        return streams, ffn_pre


def stream_mean(streams: torch.Tensor) -> torch.Tensor:
    """A DSpark target layer's feature of each row: the mean of its residual streams."""
    return streams.float().mean(dim=1).to(streams.dtype)


class DraftAttention(AttentionProjections):
    """A DSpark stage's attention: a window-only V4.1 attention whose keys go to a ring of its own
    (`cache.window[ring]`), every row of a draft block reading the same window
    (engine/model/dspark.py)."""

    def __init__(self, config: V41Config, ring: int):
        super().__init__(config)
        self.ring = ring

    def forward(self, x: torch.Tensor, rows: DraftRows, rope: Rope, cache: StateCache, ctx: object) -> torch.Tensor:
        cos, sin = rope["main"]
        q = self.queries(self.q_norm(self.wq_a(x)), cos, sin)
        ring = cache.window[self.ring]
        size = ring.shape[1]
        ring[rows.slots, rows.positions % size] = self.keys(x, cos, sin)
        visible = block_window(rows, size)
        bias = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill_(~visible, NEG_INF)
        out = self.backend.attention(q.unsqueeze(2), ring[rows.slots], bias.unsqueeze(1), self.attn_sink, self.scaling)
        return self.output(out.squeeze(1), cos, sin)


class DSparkStage(DecoderLayer):
    """DSpark's draft stage i (`mtp.{i}.*`, engine/model/dspark.py): a window-only decoder layer
    with a MoE of the draft model's size, its keys in a ring of its own (`ring`, past the
    layers'). Stage 0 also projects the target's features (`main_proj`, `main_norm`); the last
    one holds the norm before the head, the Markov head and the confidence head."""

    def __init__(self, config: V41Config, stage: int, ring: int):
        nn.Module.__init__(self)
        self.config, self.layer = config, ring
        self.add_norms_and_mixes(config)
        self.attn = DraftAttention(config, ring)
        self.ffn = MoE(config.dspark_stage_config())
        # draft rows are never image tokens: no image bias to route them by (a checkpoint's, if it
        # has one, is named unused rather than required)
        del self.ffn.gate.bias_vl
        self.engram = None
        h, targets = config.hidden_size, len(config.dspark_target_layer_ids)
        if stage == 0:
            self.main_proj = nn.Linear(h * targets, h, bias=False)
            self.main_norm = RMSNorm(h, config.rms_norm_eps)
        if stage == config.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(h, config.rms_norm_eps)
            self.markov_head = MarkovHead(config)
            self.confidence_head = ConfidenceHead(config)


def kept_rows(step: StepInput) -> tuple[StepInput, torch.Tensor] | None:
    """The step the YOCO consumer layers run: each prompt slice from its `keep_from` on, and the
    rows of `step` that are in it; None when every row is kept."""
    if step.is_decode or all(s.keep_from <= s.start for s in step.slices):
        return None
    rows, slices, begin = [], [], 0
    for s in step.slices:
        start = max(s.start, s.keep_from)
        if start < s.start + s.length:
            slices.append(SeqSlice(s.slot, start, s.start + s.length - start, s.block_table, s.keep_from))
            rows.append(torch.arange(begin + start - s.start, begin + s.length))
        begin += s.length
    index = torch.cat(rows).to(step.input_ids.device) if rows else step.input_ids.new_zeros(0)
    kept = StepInput(step.input_ids[index], step.positions[index], slices)
    if step.image_rows is not None:
        kept.image_rows = step.image_rows[index]
    return kept, index


class DeepseekV41ForCausalLM(nn.Module):
    # parameters that stay in fp32 whatever the checkpoint dtype
    fp32_parameter_suffixes = ("_fn", "_base", "_scale", "attn_sink", "gate.bias", "gate.bias_vl", "norm.weight")

    def __init__(self, config: V41Config, tokenizer_file: str | None = None, draft_stages: int = 0):
        """`draft_stages`: build the checkpoint's DSpark stages (`mtp.*`, engine/model/dspark.py)."""
        super().__init__()
        self.config = config
        rope_dim, max_pos = config.rope_head_dim, config.max_position_embeddings
        main = {"rope_type": "default", "rope_theta": config.rope_theta}
        compress = {**(config.rope_scaling or {}), "rope_theta": config.compress_rope_theta}
        compress["rope_type"] = "yarn" if config.rope_scaling else "default"
        compress.setdefault("attention_factor", 1.0)  # DeepInfer: YaRN without cos/sin scaling (mscale off)
        self.rotary = {
            "main": RotaryEmbedding(main, rope_dim, max_pos),
            "compress": RotaryEmbedding(compress, rope_dim, max_pos),
        }
        self.embed = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.rotary["compress"]) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.head.backend = TorchBackend()
        self.mtp = nn.ModuleList()
        if draft_stages:
            n = config.num_hidden_layers
            self.mtp.extend(DSparkStage(config, i, ring=n + i) for i in range(draft_stages))
        self.hasher = NgramHasher(config, tokenizer_file) if config.engram_layer_ids else None

    @property
    def lm_head(self) -> nn.Linear:
        return self.head

    @property
    def ngram_context(self) -> int:
        """How many earlier token ids each token's Engram window needs (StepInput.ngram_context)."""
        return self.config.engram_max_ngram_size - 1 if self.hasher is not None else 0

    def forward(self, step: StepInput, cache: StateCache, features_out: list | None = None) -> torch.Tensor:
        """Final hidden states [T, hidden]; rows a prompt's truncation kept out of the consumer layers are 0.
        `features_out`: gets DSpark's target features [kept rows, hidden * targets] appended (to
        train its stages: engine/checkpoint/train_dspark.py)."""
        cfg = self.config
        streams, pre, rope = self.first_streams(self.embed_step(step), step.positions)
        ngram_rows = self.hasher(step) if self.hasher is not None else None
        ctx, full, index, shared_hidden = StepContext(), step, None, None
        # DSpark's main keys, where the engine drafts with it: its cache has the stages' rings
        stores_keys = bool(self.mtp) and len(cache.window) > cfg.num_hidden_layers
        features = {} if stores_keys or features_out is not None else None
        targets = set(cfg.dspark_target_layer_ids)
        for i, layer in enumerate(self.layers):
            if i == cfg.yoco_boundary:
                shared_hidden = layer.attn_input(streams, pre)  # every row
                kept = kept_rows(step)
                if kept is not None:
                    step, index = kept
                    streams, pre = streams[index], pre[index]
                    rope = {label: (cos[index], sin[index]) for label, (cos, sin) in rope.items()}
            if i >= cfg.yoco_boundary and layer.attn.compressor is not None:
                # YOCO: every row of the step, kept or not, from the boundary layer's input
                layer.attn.compress(shared_hidden, full, cache)
            if step.input_ids.shape[0]:
                wanted = features if features is not None and i in targets else None
                streams, pre = layer(streams, pre, step, rope, cache, ctx, ngram_rows, wanted)
        if features is not None and step.input_ids.shape[0]:
            joined = self.joined_features(features, index)
            if features_out is not None:
                features_out.append(joined)
            if stores_keys:
                store_main_keys(self.mtp, cache, joined, step, rope["main"])
        hidden = self.final_hidden(streams, pre)
        if index is None:
            return hidden
        return hidden.new_zeros(full.input_ids.shape[0], hidden.shape[-1]).index_copy_(0, index, hidden)

    # The model apart from its layers: token-wise, compiled as pieces too (engine/compiled_prefill.py).

    def first_streams(self, embeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Rope]:
        """The residual streams the first layer reads (each the row's embedding), the collapse
        weights that read stream 0, and the rows' RoPE."""
        rope = {label: rotary(positions, embeds.dtype) for label, rotary in self.rotary.items()}
        streams = embeds.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        pre = torch.zeros(streams.shape[:2], dtype=torch.float32, device=streams.device)
        pre[:, 0] = 1.0  # the first sublayer reads stream 0
        return streams, pre, rope

    def final_hidden(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The final hidden states: the streams collapsed by the last sublayer's weights, normalised."""
        return self.norm(collapse(pre, streams))

    def embed_step(self, step: StepInput) -> torch.Tensor:
        """The step's input rows: token embeddings, and at an image's positions the vision
        encoder's rows (DeepInfer's `replace_input_embeds`: the i-th image row takes the i-th)."""
        if step.image_rows is None:
            return self.embed(step.input_ids)
        embeds = self.embed(step.input_ids.masked_fill(step.image_rows, 0))
        embeds[step.image_rows] = step.image_embeds.to(embeds.dtype)
        return embeds

    def joined_features(self, features: dict[int, torch.Tensor], index: torch.Tensor | None) -> torch.Tensor:
        """DSpark's features of the rows the last layer computed (a truncated prompt's kept rows):
        the target layers' in `dspark_target_layer_ids` order, those of layers before the YOCO
        boundary cut to the kept rows."""
        boundary = self.config.yoco_boundary
        parts = [
            features[i][index] if index is not None and i < boundary else features[i]
            for i in self.config.dspark_target_layer_ids
        ]
        return torch.cat(parts, dim=-1)

    def merge_projections(self) -> None:
        """Nothing merged yet: each projection runs alone."""

    def use_backend(self, backend: object) -> None:
        for module in self.modules():
            if isinstance(module, (Attention, DraftAttention, Experts)):
                module.backend = backend
        self.head.backend = backend

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.backend.output_logits(hidden, self.head.weight)
