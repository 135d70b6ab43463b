"""Prefill steps with everything but the attention core compiled, one set of graphs per token count.

A prefill step is any mix of sequence chunks: any lengths, starting anywhere. Only the attention
core depends on that mix (which keys a chunk sees, which compressor windows it closes, what it
writes into the state); everything else in a layer is token-wise: the hyper-connections, the
norms, the projections, RoPE, the MoE block. So, as vLLM compiles a model "piecewise" around its
attention, the step runs as compiled pieces between eager attention cores:

    embed -> [before_attention -> attention core (eager) -> after_attention] per layer -> head

Each piece is one graph per token-count bucket (powers of two, `token_buckets`) and kind of layer
(`layer_kind`): what the traced code reads of a layer is the same for every layer of a kind, so
they share the graph (the small preset's six layers are four kinds: ten graphs a bucket with the
embedding and the head), each under a code object of its own, which a step calls without
Dynamo once compiled. A step's tokens are padded to a bucket (`row_groups`); a step longer than
the largest bucket runs as several, whole buckets first. The padding rows are token 0 at position
0, and since every piece is token-wise, they change no real row. The attention core sees only the
real rows and writes only their sequences' state, so the pieces write no state at all.

The graphs compile on a thread of their own, each bucket once no decode graph of the process is
compiling (engine/compiled_decode.py: the same backend, the same rule that the compiling thread
runs no graph): a busy replica runs decode steps most. Until every bucket a step needs is ready,
the step runs eager, and both paths compute the same rows (tests/system/test_compiled_prefill.py).
Inductor's disk cache serves them as it serves the decode graphs.

DeepSeek-V4's pieces come first below; DeepSeek-V4.1's (`CompiledPrefillV41`) split its layers the
same way, and differ where its model does (the YOCO boundary's kept rows, Engram, DSpark's keys)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_map, tree_map_only

from engine import compiled_decode
from engine.backends import picks_per_expert_while_tracing
from engine.compiled_decode import (
    BucketGraphs,
    CompiledDecode,
    compile_only,
    compile_without_running,
    compiled_code,
    renamed_copy,
)
from engine.model import DeepseekV4ForCausalLM, StepInput
from engine.model.dspark import store_main_keys
from engine.model.v4 import DecoderLayer
from engine.model.v41 import DecoderLayer as DecoderLayerV41
from engine.model.v41 import DeepseekV41ForCausalLM, StepContext, kept_rows, stream_mean
from engine.state_cache import StateCache

log = logging.getLogger(__name__)

SMALLEST_BUCKET = 16
# The engine's default step (max_num_batched_tokens) in one bucket: split in two 512-token groups,
# every piece's outputs are joined again, and a 1,024-token step ran 1.07x slower (small and
# tiny-vocab). Past it, a step's matrix products outweigh what compiling saves around them.
LARGEST_BUCKET = 1024
# The routed experts a pick at a time up to this many picks an expert, grouped past it (a decode
# graph's limit is 16). A prompt's tokens pick experts many times over, and every pick reads its
# expert's weights again. The small preset's pieces (experts of 1.5 MB), grouped against a pick at
# a time, medians of 21 alternated rounds: at 64 and 128 tokens (8 and 16 picks an expert) 0.82x
# to 0.84x and 0.76x to 0.78x the time on one torch thread, 0.88x to 1.02x and 0.86x to 0.87x on
# two; at 32 (4) 0.91x to 1.08x; at 16 (2) 0.98x to 1.04x on one thread but 1.12x to 1.18x on two.
PICKS_PER_EXPERT = 2


def token_buckets(max_tokens: int) -> list[int]:
    """Powers of two from SMALLEST_BUCKET up to the first that holds `max_tokens` (at most LARGEST_BUCKET)."""
    buckets = [SMALLEST_BUCKET]
    while buckets[-1] < min(max_tokens, LARGEST_BUCKET):
        buckets.append(2 * buckets[-1])
    return buckets


def row_groups(tokens: int, buckets: list[int]) -> list[int]:
    """The buckets a step of `tokens` rows runs as, in row order: the one bucket that holds them
    where one does; else the largest bucket as often as it fits, then each smaller one the rest
    needs, the last padded (fewer padding rows than the smallest bucket)."""
    if tokens <= buckets[-1]:
        return [next(size for size in buckets if size >= tokens)]
    groups, rest = [], tokens
    for size in reversed(buckets):
        while rest >= size:
            groups.append(size)
            rest -= size
    return groups + [buckets[0]] * (rest > 0)


# The pieces. Module-level functions of (module, row tensors...), so that Dynamo keeps one graph
# per piece, bucket and kind of layer, whichever layer runs it.


def _embed(model: DeepseekV4ForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple:
    embeds = model.model.embed_tokens(input_ids)
    streams = embeds.unsqueeze(1).expand(-1, model.config.hc_mult, -1).contiguous()
    return streams, model.model.rope(positions, embeds.dtype)


def _before_attention(layer: DecoderLayer, streams: torch.Tensor, positions: torch.Tensor, rope: dict) -> tuple:
    return layer.before_attention(streams, positions, rope)


def _after_attention(
    layer: DecoderLayer,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    out: torch.Tensor,
    rope: dict,
    input_ids: torch.Tensor,
) -> torch.Tensor:
    return layer.after_attention(streams, post, comb, out, rope, input_ids)


def _head(model: DeepseekV4ForCausalLM, streams: torch.Tensor) -> torch.Tensor:
    return model.model.norm(model.model.hc_head(streams))


PIECES: dict[str, Callable] = {
    "embed": _embed,
    "before": _before_attention,
    "after": _after_attention,
    "head": _head,
}


def layer_kind(layer: DecoderLayer) -> str:
    """What a layer's pieces specialise on: its attention type and compression rate, and its MoE's
    routing. The layers of a kind run the same graphs."""
    attention = layer.self_attn
    rate = attention.compressor.rate if attention.compressor is not None else 0
    return f"{attention.layer_type}_{rate}_{'hash' if layer.mlp.gate.hashed else 'routed'}"


def _padded(rows: torch.Tensor, length: int) -> torch.Tensor:
    """A copy of `rows` with zero rows appended up to `length`: made in inference mode, as the graphs'
    inputs were (a tensor made outside it would fail their guards)."""
    padded = rows.new_zeros((length, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    return padded


def _rows_of(tensors: object, index: torch.Tensor | slice) -> object:
    """The rows `index` of each tensor."""
    return tree_map_only(torch.Tensor, lambda rows: rows[index], tensors)


class CompiledPrefill(BucketGraphs):
    """Runs prefill steps (and decode steps no decode graph takes) through compiled pieces, once
    every bucket the step needs is ready (`is_ready`); the engine runs a step eager otherwise."""

    what = "prefill"
    pieces = PIECES  # by name: the functions a step's graphs are compiled from

    @staticmethod
    def create_for(model: torch.nn.Module, cache: StateCache, max_tokens: int) -> CompiledPrefill | None:
        """The family's compiled prefill (`create`: None where compiling is unavailable)."""
        graphs = CompiledPrefillV41 if isinstance(model, DeepseekV41ForCausalLM) else CompiledPrefill
        return graphs.create(model, cache, max_tokens)

    def __init__(self, model: DeepseekV4ForCausalLM, cache: StateCache, max_tokens: int):
        """`max_tokens`: the most tokens a step computes (the engine's max_num_batched_tokens)."""
        super().__init__(token_buckets(max_tokens))
        self.model, self.cache = model, cache
        self._backend = compile_only(compiled_decode.BACKEND)
        self._kinds = [self.kind_of(layer) for layer in self.layers]
        # per piece, bucket and kind of layer ("model" for embed and head): its torch.compile'd
        # function, and once compiled, the code to call its one graph without Dynamo (or None)
        self._graphs: dict[tuple[str, int, str], Callable] = {}
        self._direct: dict[tuple[str, int, str], Callable | None] = {}
        self.steps = 0  # steps run through the pieces
        self.eager_pieces = 0  # piece calls that ran eager because no graph's guards passed

    @property
    def layers(self) -> torch.nn.ModuleList:
        return self.model.model.layers

    @staticmethod
    def kind_of(layer: torch.nn.Module) -> str:
        return layer_kind(layer)

    def is_ready(self, tokens: int) -> bool:
        """Whether a step of `tokens` rows can run through compiled pieces now."""
        return all(size in self._ready for size in row_groups(tokens, self.buckets))

    @torch.inference_mode()
    def __call__(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's final hidden states [T, hidden] and residual streams [T, hc_mult, hidden], as
        the model's forward_with_streams computes them."""
        real = len(step.input_ids)
        groups = row_groups(real, self.buckets)
        length = sum(groups)
        input_ids, positions = _padded(step.input_ids, length), _padded(step.positions, length)
        streams, rope = self._rows(("embed", "model"), groups, self.model, input_ids, positions)
        for layer, kind in zip(self.model.model.layers, self._kinds, strict=True):
            post, comb, projected = self._rows(("before", kind), groups, layer, streams, positions, rope)
            out = layer.self_attn.attend(_rows_of(projected, slice(real)), step, self.cache)
            out = _padded(out, length)
            streams = self._rows(("after", kind), groups, layer, streams, post, comb, out, rope, input_ids)
        hidden = self._rows(("head", "model"), groups, self.model, streams)
        self.steps += 1
        return hidden[:real], streams[:real]

    def _rows(self, piece: tuple[str, str], groups: list[int], module: torch.nn.Module, *rows: object) -> object:
        """The piece (its name and kind of layer) over every row group of the step: each group's
        rows through its bucket's graph, the groups' outputs joined."""
        if len(groups) == 1:
            return self._call((piece[0], groups[0], piece[1]), module, rows)
        outputs, begin = [], 0
        for size in groups:
            group = tree_map_only(torch.Tensor, lambda t, b=begin, s=size: t[b : b + s], rows)
            outputs.append(self._call((piece[0], size, piece[1]), module, group))
            begin += size
        return tree_map(lambda *parts: None if parts[0] is None else torch.cat(parts), *outputs)

    def _call(self, graph: tuple[str, int, str], module: torch.nn.Module, rows: tuple) -> object:
        # As the decode graphs (CompiledDecode._run): a piece of one bucket and kind of layer is one
        # graph, whose inputs always pass its guards, so the code Dynamo made for it runs directly.
        direct = self._direct[graph]
        if direct is not None:
            return direct(module, *rows)
        piece = graph[0]
        try:  # a piece no compiled graph's guards pass would compile on this thread, mid-step: eager instead
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._graphs[graph](module, *rows)
        except RuntimeError as error:  # raised before the graph runs; the pieces write no state
            if "recompil" not in str(error).lower():
                raise
            self.eager_pieces += 1
            if self.eager_pieces == 1:
                log.warning("prefill piece %s ran eager (no compiled graph fits): %s", graph, error)
            return self.pieces[piece](module, *rows)

    def _may_compile(self) -> bool:
        return not compiled_decode.compiling_anywhere(CompiledDecode)

    def _compile(self, size: int) -> None:
        """Compile the bucket's pieces for every layer (a layer of a kind already compiled only
        passes its graph's guards), each piece's inputs computed eager: the pieces write no state."""
        start = time.perf_counter()
        model = self.model
        input_ids = torch.zeros(size, dtype=torch.long, device=model.lm_head.weight.device)
        positions = torch.zeros_like(input_ids)
        streams, rope = self._compiled_then_eager(("embed", size, "model"), model, input_ids, positions)
        for layer, kind in zip(model.model.layers, self._kinds, strict=True):
            post, comb, _ = self._compiled_then_eager(("before", size, kind), layer, streams, positions, rope)
            attention = layer.self_attn
            out = streams.new_zeros(size, attention.num_heads, attention.head_dim)
            streams = self._compiled_then_eager(("after", size, kind), layer, streams, post, comb, out, rope, input_ids)
        self._compiled_then_eager(("head", size, "model"), model, streams)
        self._finish_bucket(size, start)

    def _finish_bucket(self, size: int, start: float) -> None:
        """The bucket's graphs, every piece compiled: called directly from now on, and ready."""
        for graph, compiled in self._graphs.items():
            if graph[1] == size:  # every layer of the kind passed the graph's guards: one graph
                self._direct[graph] = compiled_code(compiled)
        self._ready.add(size)
        seconds = time.perf_counter() - start
        ready, planned = self.num_ready, len(self.buckets)
        log.info("prefill graphs for %d tokens ready in %.1f s (%d of %d)", size, seconds, ready, planned)

    def _compiled_then_eager(self, graph: tuple[str, int, str], module: torch.nn.Module, *rows: object) -> object:
        """Compile the piece's graph for these inputs (or pass the one compiled for an earlier layer
        of the kind's guards), then compute its output eager: the next piece's example inputs."""
        piece, size, kind = graph
        if graph not in self._graphs:
            function = renamed_copy(self.pieces[piece], f"{kind}_tokens_{size}")
            self._graphs[graph] = torch.compile(function, backend=self._backend, dynamic=False, fullgraph=True)
        with picks_per_expert_while_tracing(PICKS_PER_EXPERT):
            compile_without_running(lambda: self._graphs[graph](module, *rows))
        return self.pieces[piece](module, *rows)


# DeepSeek-V4.1 (engine/model/v41.py): the same split, around its attention core (the compressor's
# entries, the window, the shared top-k). Its layers hand on the collapse weights (`pre`) with the
# streams, an Engram layer reads the step's hashed n-grams, and from the YOCO boundary on a
# truncated prompt's layers run its kept rows only: the pieces after the boundary run on those rows,
# padded to their own bucket, as the eager model runs them (`kept_rows`). A step with images runs
# eager (the model runner sends it there).


def _embed_v41(model: DeepseekV41ForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple:
    return model.first_streams(model.embed(input_ids), positions)


def _before_attention_v41(
    layer: DecoderLayerV41, streams: torch.Tensor, pre: torch.Tensor, rope: dict, ngram_rows: torch.Tensor | None
) -> tuple:
    streams, x, attn_pre, post, comb = layer.before_attention(streams, pre, ngram_rows)
    return streams, x, attn_pre, post, comb, layer.attn.project(x, rope)


def _after_attention_v41(
    layer: DecoderLayerV41,
    streams: torch.Tensor,
    attn_pre: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    out: torch.Tensor,
    rope: dict,
) -> tuple:
    out = layer.attn.output(out, *rope[layer.attn.rope_type])
    return layer.after_attention(streams, attn_pre, post, comb, out)


def _head_v41(model: DeepseekV41ForCausalLM, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return model.final_hidden(streams, pre)


PIECES_V41: dict[str, Callable] = {
    "embed": _embed_v41,
    "before": _before_attention_v41,
    "after": _after_attention_v41,
    "head": _head_v41,
}


def layer_kind_v41(layer: DecoderLayerV41) -> str:
    """What a V4.1 layer's pieces specialise on: its RoPE (compressed layers have their own), whether
    it has an indexer, and its Engram table (one a layer, with its own hash columns)."""
    attention = layer.attn
    engram = f"_engram{layer.layer}" if layer.engram is not None else ""
    return f"{attention.rope_type}_{'indexed' if attention.indexer is not None else 'plain'}{engram}"


def _kept(tensors: object, index: torch.Tensor, length: int) -> object:
    """The rows `index` of each tensor, padded to `length`."""
    return tree_map_only(torch.Tensor, lambda rows: _padded(rows[index], length), tensors)


class CompiledPrefillV41(CompiledPrefill):
    """CompiledPrefill for DeepSeek-V4.1's prefill steps."""

    pieces = PIECES_V41
    model: DeepseekV41ForCausalLM

    @property
    def layers(self) -> torch.nn.ModuleList:
        return self.model.layers

    @staticmethod
    def kind_of(layer: torch.nn.Module) -> str:
        return layer_kind_v41(layer)

    @torch.inference_mode()
    def __call__(self, step: StepInput) -> tuple[torch.Tensor, None]:
        """The step's final hidden states [T, hidden], as the model's forward computes them (rows a
        truncated prompt kept out of the consumer layers are 0); no residual streams (V4's drafter
        reads those)."""
        model, cache, config = self.model, self.cache, self.model.config
        real = len(step.input_ids)
        groups = row_groups(real, self.buckets)
        length = sum(groups)
        input_ids, positions = _padded(step.input_ids, length), _padded(step.positions, length)
        streams, pre, rope = self._rows(("embed", "model"), groups, model, input_ids, positions)
        ngram_rows = _padded(model.hasher(step), length) if model.hasher is not None else None
        context, full, index, shared_hidden = StepContext(), step, None, None
        # DSpark's main keys, where the engine drafts with it: its cache has the stages' rings
        features = {} if model.mtp and len(cache.window) > config.num_hidden_layers else None
        for i, (layer, kind) in enumerate(zip(model.layers, self._kinds, strict=True)):
            if i == config.yoco_boundary:
                shared_hidden = layer.attn_input(streams[:real], pre[:real])  # every row, eager
                kept = kept_rows(step)
                if kept is not None:  # from here on, the kept rows, padded to their own bucket
                    step, index = kept
                    real = len(index)
                    groups = row_groups(real, self.buckets) if real else []
                    length = sum(groups)
                    # (every Engram layer comes before the boundary: V41Config refuses others)
                    streams, pre, rope = _kept((streams, pre, rope), index, length)
            if i >= config.yoco_boundary and layer.attn.compressor is not None:
                layer.attn.compress(shared_hidden, full, cache)  # YOCO: from every row of the step
            if not real:
                continue
            rows = (streams, pre, rope, ngram_rows if layer.engram is not None else None)
            streams, x, attn_pre, post, comb, projected = self._rows(("before", kind), groups, layer, *rows)
            if features is not None and i in config.dspark_target_layer_ids:
                features[i] = stream_mean(streams[:real])
            out = layer.attn.attend(x[:real], _rows_of(projected, slice(real)), step, cache, context)
            rows = (streams, attn_pre, post, comb, _padded(out, length), rope)
            streams, pre = self._rows(("after", kind), groups, layer, *rows)
        if real:
            if features is not None:
                main_rope = _rows_of(rope["main"], slice(real))
                store_main_keys(model.mtp, cache, model.joined_features(features, index), step, main_rope)
            hidden = self._rows(("head", "model"), groups, model, streams, pre)[:real]
        else:
            hidden = streams.new_zeros(0, config.hidden_size)
        if index is not None:
            hidden = hidden.new_zeros(len(full.input_ids), hidden.shape[-1]).index_copy_(0, index, hidden)
        self.steps += 1
        return hidden, None

    def _compile(self, size: int) -> None:
        """As CompiledPrefill._compile, with V4.1's pieces."""
        start = time.perf_counter()
        model = self.model
        input_ids = torch.zeros(size, dtype=torch.long, device=model.lm_head.weight.device)
        positions = torch.zeros_like(input_ids)
        streams, pre, rope = self._compiled_then_eager(("embed", size, "model"), model, input_ids, positions)
        ngram_rows = None
        if model.hasher is not None:  # the hashes of n-grams of token 0
            context = input_ids.new_zeros(size, model.ngram_context)
            ngram_rows = model.hasher(StepInput(input_ids, positions, [], ngram_context=context))
        for layer, kind in zip(model.layers, self._kinds, strict=True):
            rows = (streams, pre, rope, ngram_rows if layer.engram is not None else None)
            streams, x, attn_pre, post, comb, _ = self._compiled_then_eager(("before", size, kind), layer, *rows)
            attention = layer.attn
            out = x.new_zeros(size, attention.num_heads, attention.head_dim)
            rows = (streams, attn_pre, post, comb, out, rope)
            streams, pre = self._compiled_then_eager(("after", size, kind), layer, *rows)
        self._compiled_then_eager(("head", size, "model"), model, streams, pre)
        self._finish_bucket(size, start)
