"""The decode step as one compiled graph per batch-size bucket.

torch.compile traces the model's decode forward (embedding to logits) into a single graph:
every shape in it depends on the batch size and the block-table width only, never on the
routing, on which windows close or on other values (the model code keeps it so), and the per-layer
state is written in place. Batches are padded to a bucket (powers of two up
to the engine's max_num_seqs); the padding rows compute token 0 at position 0 in the
cache's scratch slot and scratch block, so they touch no sequence's state. The block-table
width is a dynamic dimension (padded to a minimum: `min_width`), so one graph per bucket
serves every sequence length.

Compiling takes minutes a bucket on two cores (about two for the tiny preset), so it happens
behind the engine, not before it: `start` compiles the buckets on a thread of their own,
smallest first, while the engine decodes eager; each bucket's steps switch to its graph once it
is compiled (`is_ready`). Both paths compute the same tokens (tests/system/test_compiled_decode.py),
so a request that crosses the switch reads as if it had run on either. The compiling thread only
compiles: a graph first runs on the engine's thread (`compile_only`). Inductor keeps what it
compiled on disk (TORCHINDUCTOR_CACHE_DIR, .cache/torchinductor unless set: engine/__init__.py):
a later start with the same model shape, torch and model code loads the graphs instead of
compiling them, in seconds."""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from typing import NamedTuple, Self

import torch

from engine.backends import mark_graph_constants
from engine.model import DeepseekV4ForCausalLM, StepInput
from engine.model.dspark import draft_blocks
from engine.model.v41 import DeepseekV41ForCausalLM
from engine.state_cache import StateCache

DecodeModel = DeepseekV4ForCausalLM | DeepseekV41ForCausalLM

log = logging.getLogger(__name__)


class DecodeOutput(NamedTuple):
    """A compiled decode step's rows: the output projection and what sampling reads of it are in the graph."""

    hidden: torch.Tensor  # [B, hidden]
    logits: torch.Tensor  # [B, vocab] fp32 (a transposed view)
    normalizer: torch.Tensor  # [B]: the logits' logsumexp
    argmax: torch.Tensor  # [B]
    streams: torch.Tensor | None = None  # [B, hc_mult, hidden] before the final collapse, for a drafter


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two below max_batch, then max_batch itself: [1, 2, 4, ..., max_batch]."""
    buckets, size = [], 1
    while size < max_batch:
        buckets.append(size)
        size *= 2
    return [*buckets, max_batch]


def min_width(cache: StateCache) -> int:
    """The narrowest block table a graph takes. Tracing specialises a dynamic size wherever the code
    compares it with a constant, which would bind the graph to the width it was traced at: a width
    of 1 is always specialised, and a CSA layer whose entries are as many as its indexer keeps
    (top-k) compares them. Padded to 2 blocks and to more entries than top-k, no comparison can
    come out otherwise for a wider table, and every width at least this one runs the same graph."""
    width = 2
    for state in cache.indexers.values():
        width = max(width, cache.config.index_topk // state.entries_per_block + 1)
    return width


def _decode(
    model: DecodeModel,
    cache: StateCache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    ngram_context: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    step = StepInput(input_ids, positions, slots=slots, block_tables=block_tables, ngram_context=ngram_context)
    return _sampled_from(model, model(step, cache))


def _decode_with_streams(
    model: DeepseekV4ForCausalLM,
    cache: StateCache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    ngram_context: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """_decode, also giving the residual streams the final hidden state collapses (the MTP drafter's input)."""
    step = StepInput(input_ids, positions, slots=slots, block_tables=block_tables, ngram_context=ngram_context)
    hidden, streams = model.forward_with_streams(step, cache)
    return *_sampled_from(model, hidden), streams


def _sampled_from(model: DecodeModel, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The final hidden states [B, hidden], then the logits [B, vocab] and what sampling reads of them."""
    columns = model.lm_head.backend.logit_columns(hidden, model.lm_head.weight)  # [vocab, B]
    return hidden, columns.T, columns.logsumexp(dim=0), columns.argmax(dim=0)


def draft_rows(
    model: DeepseekV4ForCausalLM,
    cache: StateCache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    floors: torch.Tensor,
    streams: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The MTP module's rows (engine/drafter.py) as one decode step, eager or as a bucket's draft
    graph: each row's most likely next token and the module's own streams."""
    step = StepInput(input_ids, positions, slots=slots, keep_from=floors)
    embeds = model.model.embed_tokens(input_ids)
    hidden, own = model.mtp[0].draft(embeds, streams, step, model.model.rope(positions, embeds.dtype), cache)
    columns = model.lm_head.backend.logit_columns(hidden, model.lm_head.weight)  # [vocab, B]
    return columns.argmax(dim=0), own


def _decode_function(size: int, streams: bool = False) -> Callable[..., tuple[torch.Tensor, ...]]:
    """_decode under a code object of its own. Dynamo keeps compiled graphs per code object and
    picks one by checking the call against each graph's guards in turn: one graph per bucket
    behind its own code object is one graph to pick from."""
    return renamed_copy(_decode_with_streams if streams else _decode, f"batch_{size}")


def renamed_copy(function: Callable, label: str) -> Callable[..., tuple[torch.Tensor, ...]]:
    """`function` under a code object of its own, named `function`_`label`."""
    code = function.__code__.replace(co_name=f"{function.__name__}_{label}")
    return types.FunctionType(code, function.__globals__, code.co_name)


def _shapes(inputs: tuple[torch.Tensor | int | None, ...]) -> str:
    return ", ".join(str(tuple(tensor.shape)) for tensor in inputs if isinstance(tensor, torch.Tensor))


BACKEND: str | Callable = "inductor"  # what decode graphs compile with (a torch.compile backend)


class _NotRun(Exception):
    """Raised in place of a compiled graph's run on a thread that only compiles (`compile_only`)."""


_only_compiling = threading.local()  # .active on the thread compiling graphs: it runs none of them


def _trace_inductors_dummy_module() -> None:
    """Inductor traces one function with torch.fx's symbolic tracer once a process, as it lowers its
    first graph (the dummy module of torch._inductor.loop_body.InterpreterShim, cached). That
    tracer replaces nn.Module.__call__ process-wide for its ~3 ms: an eager step on the engine's
    thread meanwhile failed (NameError: module is not installed as a submodule), and its jobs were
    done again. Done here, on the thread that makes the engine, before any step runs beside the
    compiling thread. A torch without that function loses only this."""
    with contextlib.suppress(ImportError, AttributeError):
        from torch._inductor.loop_body import InterpreterShim

        InterpreterShim._dummy_gm()


def compile_only(backend: str | Callable) -> Callable[[torch.fx.GraphModule, list], Callable[..., object]]:
    """`backend`, whose graphs refuse to run (_NotRun) on a thread that only compiles.

    A graph's first call compiles it, then runs it. Functionalized, as AOTAutograd makes every graph
    for Inductor, a write into a state tensor can become a copy of the whole tensor back at the
    graph's end: run on the compiling thread, that copy would undo whatever an eager step on the
    engine's thread wrote into the tensor meanwhile (a request's keys, a loaded prefix). So the
    compiling thread makes the graph and Dynamo's code for it, and the engine's thread runs it."""
    from torch._dynamo.backends.registry import lookup_backend

    mark_graph_constants()
    _trace_inductors_dummy_module()
    compile_graph = lookup_backend(backend)

    def compile_and_guard(graph: torch.fx.GraphModule, example_inputs: list) -> Callable[..., object]:
        run = compile_graph(graph, example_inputs)

        def run_unless_only_compiling(*args: object) -> object:
            if getattr(_only_compiling, "active", False):
                raise _NotRun
            return run(*args)

        return run_unless_only_compiling

    return compile_and_guard


def compile_without_running(call: Callable[[], object]) -> None:
    """Make `call`, a call of a function compiled through `compile_only`'s backend, compile its graph
    (or pass the guards of one compiled before) on this thread, running no graph."""
    _only_compiling.active = True
    try:
        call()
    except _NotRun:
        pass
    finally:
        _only_compiling.active = False


def compiled_code(compiled: Callable) -> Callable[..., tuple[torch.Tensor, ...]] | None:
    """The function Dynamo made of a torch.compile'd function's one graph (loading its inputs, then
    calling the compiled graph), callable without Dynamo; None where this torch does not expose it
    or the function holds more than one graph."""
    try:
        function = compiled._torchdynamo_orig_callable
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(function.__code__)
    except (AttributeError, RuntimeError, TypeError):
        return None
    if len(entries) != 1:
        return None
    return types.FunctionType(entries[0].code, function.__globals__, function.__name__)


def compiler_available() -> str | None:
    """Why torch.compile cannot run here (no C++ compiler for Inductor's CPU code), or None."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as error:  # any failure means no compiler
        return f"{type(error).__name__}: {error}"
    return None


class _SwitchInterval:
    """While graphs compile, threads hand the GIL over every 0.5 ms instead of every 5. Compiling is
    long stretches of Python; an eager step is hundreds of short kernels, each giving the GIL up and
    waiting to get it back: at 5 ms a wait, the engine's steps would crawl beside a compile. Counted,
    so that engines compiling at once restore the interval only when the last one is done."""

    def __init__(self, while_compiling: float = 0.0005):
        self.while_compiling = while_compiling
        self.lock = threading.Lock()
        self.compiling = 0
        self.previous = sys.getswitchinterval()

    @contextlib.contextmanager
    def shortened(self) -> Iterator[None]:
        with self.lock:
            if self.compiling == 0:
                self.previous = sys.getswitchinterval()
                sys.setswitchinterval(min(self.previous, self.while_compiling))
            self.compiling += 1
        try:
            yield
        finally:
            with self.lock:
                self.compiling -= 1
                if self.compiling == 0:
                    sys.setswitchinterval(self.previous)


_switch_interval = _SwitchInterval()


_compiling: weakref.WeakSet[BucketGraphs] = weakref.WeakSet()  # what compiles graphs in this process


def compiling_anywhere(kind: type[BucketGraphs] | None = None) -> bool:
    """Whether a decode graph or prefill piece (`kind`: one of that class) of this process is
    compiling now (or waiting to)."""
    return any(compiled.compiling and isinstance(compiled, kind or BucketGraphs) for compiled in list(_compiling))


@atexit.register
def _finish_compiling_before_exit() -> None:
    """A process that exits while a graph compiles would tear the compiler down under its thread,
    and the C++ runtime aborts the process: let the graph being compiled finish, compile no other."""
    for compiled in list(_compiling):
        if compiled.compiling:
            log.info("exit waits for the graph being compiled (no further one starts)")
        compiled.stop()


class BucketGraphs:
    """Graphs compiled a bucket at a time, smallest first, on a thread of their own while the engine
    steps eager; a step runs through its bucket's graphs once that bucket is ready. Subclasses say
    how a bucket compiles (`_compile`, which adds it to `_ready`)."""

    what = "decode"  # what the thread and the log lines name

    def __init__(self, buckets: list[int]):
        self.buckets = buckets
        self._ready: set[int] = set()  # buckets a step may run: written by the compiling thread only
        self._finished = threading.Event()  # every bucket ready, or compiling gave up
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: str | None = None  # why compiling gave up, if it did
        self.warm_up_seconds = 0.0  # compiling (or loading) the buckets

    @classmethod
    def create(cls, *args: object, **kwargs: object) -> Self | None:
        """The graphs (`cls(*args, **kwargs)`), compiling in the background from now on; None (and one
        log line) where compiling is unavailable."""
        reason = compiler_available()
        if reason is not None:
            logging.getLogger(cls.__module__).warning(
                "%s runs eager: torch.compile is unavailable here (%s)", cls.what, reason
            )
            return None
        compiled = cls(*args, **kwargs)
        compiled.start()
        return compiled

    def start(self) -> None:
        """Compile (or load from the disk cache) every bucket's graphs on a thread of their own."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._compile_all, name=f"compile-{self.what}", daemon=True)
            _compiling.add(self)
            self._thread.start()

    def stop(self) -> None:
        """Compile no further bucket; the one compiling now finishes first (Inductor cannot be interrupted)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every bucket is ready (True), compiling gave up or stopped, or `timeout` (False)."""
        self._finished.wait(timeout)
        return self.num_ready == len(self.buckets)

    @property
    def compiling(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_ready(self) -> int:
        return len(self._ready)

    def _may_compile(self) -> bool:
        """Whether the next bucket may start compiling now (else the thread asks again shortly)."""
        return True

    @torch.inference_mode()
    def _compile_all(self) -> None:
        """Compile every bucket's graphs, smallest first, while the engine steps."""
        own_log = logging.getLogger(type(self).__module__)  # the subclass's module's
        try:
            with _switch_interval.shortened():
                for size in self.buckets:
                    while not self._may_compile() and not self._stopping.wait(0.5):
                        pass
                    if self._stopping.is_set():
                        return
                    start = time.perf_counter()
                    self._compile(size)
                    self.warm_up_seconds += time.perf_counter() - start
            own_log.info("%s graphs of %d buckets ready in %.1f s", self.what, len(self.buckets), self.warm_up_seconds)
        except Exception as error:  # a backend that cannot compile: its buckets stay eager
            self.failure = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            if threading.main_thread().is_alive():  # else the process is exiting, which stopped the compiler
                own_log.warning("%s runs eager: torch.compile is unavailable here (%s)", self.what, self.failure)
        finally:
            self._finished.set()

    def _compile(self, size: int) -> None:
        raise NotImplementedError


class CompiledDecode(BucketGraphs):
    """Runs decode steps through compiled graphs, each bucket once its graph is ready (`is_ready`);
    the engine runs a step eager where its bucket is not, and always where this is None."""

    def __init__(
        self,
        model: DecodeModel,
        cache: StateCache,
        max_batch: int,
        on_progress: Callable[[int, int], None] | None = None,
        streams: bool = False,
        dspark_block: int = 0,
    ):
        """`streams`: the graphs also give the residual streams (DecodeOutput.streams) the MTP drafter
        reads, and each bucket has a graph of the drafter's rows too (`draft`). `dspark_block`: each
        bucket also has a graph of DSpark's draft blocks of this many rows (`dspark`)."""
        self.model, self.cache, self.streams, self.dspark_block = model, cache, streams, dspark_block
        super().__init__(batch_buckets(max_batch))
        self.device = model.lm_head.weight.device
        self.min_width = min_width(cache)
        kinds = {"decode": lambda size: _decode_function(size, streams)}
        if streams:
            kinds["draft"] = lambda size: renamed_copy(draft_rows, f"batch_{size}")
        if dspark_block:
            kinds["dspark"] = lambda size: renamed_copy(draft_blocks, f"batch_{size}")
        backend = compile_only(BACKEND)
        self._graphs = {
            (kind, size): torch.compile(function(size), backend=backend, dynamic=False, fullgraph=True)
            for kind, function in kinds.items()
            for size in self.buckets
        }
        # per graph compiled: the code to call it without Dynamo, or None (see _run)
        self._direct: dict[tuple[str, int], Callable[..., tuple[torch.Tensor, ...]] | None] = {}
        self.on_progress = on_progress  # (buckets ready, buckets planned), after each bucket
        self.steps = 0  # decode steps run through a graph

    def is_ready(self, batch: int) -> bool:
        """Whether a step of `batch` sequences can run through its bucket's graph now."""
        return batch <= self.buckets[-1] and self.bucket(batch) in self._ready

    def bucket(self, batch: int) -> int:
        return next(size for size in self.buckets if size >= batch)

    @torch.inference_mode()
    def __call__(
        self,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        block_tables: list[list[int]],
        ngram_contexts: list[list[int]] | None = None,
    ) -> DecodeOutput:
        """One decode token per sequence: the final hidden states and what sampling reads of the
        logits. `ngram_contexts`: each token's n ids before it (a model with Engram layers)."""
        size, rows = self.bucket(len(token_ids)), len(token_ids)
        inputs = self._padded(size, token_ids, positions, slots, block_tables, ngram_contexts)
        outputs = self._run(("decode", size), *inputs)
        self.steps += 1
        return DecodeOutput(*(tensor[:rows] for tensor in outputs))

    @torch.inference_mode()
    def draft(
        self, token_ids: list[int], positions: list[int], slots: list[int], floors: list[int], streams: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP module's rows through the drafter's graph: each row's most likely next token [n]
        and the module's own streams [n, hc, d]. Padding rows draft in the scratch slot."""
        size, rows = self.bucket(len(token_ids)), len(token_ids)
        inputs = self._draft_inputs(size, token_ids, positions, slots, floors, streams)
        drafts, own = self._run(("draft", size), *inputs)
        return drafts[:rows], own[:rows]

    @torch.inference_mode()
    def dspark(
        self, pending: list[int], starts: list[int], slots: list[int], floors: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DSpark's blocks through the bucket's graph: each sequence's drafts [S, B] and their
        confidences [S, B]. Padding sequences draft in the scratch slot."""
        size, rows = self.bucket(len(pending)), len(pending)
        drafts, confidence = self._run(("dspark", size), *self._dspark_inputs(size, pending, starts, slots, floors))
        return drafts[:rows], confidence[:rows]

    def _longs(self, values: list) -> torch.Tensor:
        """A graph input of ids (tokens, positions, slots, blocks) on the model's device."""
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _dspark_inputs(
        self, size: int, pending: list[int], starts: list[int], slots: list[int], floors: list[int]
    ) -> tuple[torch.Tensor | int, ...]:
        pad = size - len(pending)
        return (
            self._longs(pending + [0] * pad),
            self._longs(starts + [0] * pad),
            self._longs(slots + [self.cache.scratch_slot] * pad),
            self._longs(floors + [0] * pad),
            self.dspark_block,
        )

    def _draft_inputs(
        self,
        size: int,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        floors: list[int],
        streams: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        pad = size - len(token_ids)

        config = self.model.config
        padded_streams = torch.zeros(
            size, config.hc_mult, config.hidden_size, dtype=self.model.lm_head.weight.dtype, device=self.device
        )
        if streams is not None:
            padded_streams[: len(token_ids)] = streams
        return (
            self._longs(token_ids + [0] * pad),
            self._longs(positions + [0] * pad),
            self._longs(slots + [self.cache.scratch_slot] * pad),
            self._longs(floors + [0] * pad),
            padded_streams,
        )

    def _padded(
        self,
        size: int,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        block_tables: list[list[int]],
        ngram_contexts: list[list[int]] | None = None,
    ) -> tuple[torch.Tensor | None, ...]:
        """The graph's inputs for these rows, padded to `size` rows and at least `min_width` blocks
        (the n-gram contexts None for a model without Engram layers)."""
        pad = size - len(token_ids)
        width = max([self.min_width, *map(len, block_tables)])
        scratch = self.cache.scratch_block
        tables = [table + [scratch] * (width - len(table)) for table in block_tables]
        tables += [[scratch] * width] * pad

        inputs = (
            self._longs(token_ids + [0] * pad),
            self._longs(positions + [0] * pad),
            self._longs(slots + [self.cache.scratch_slot] * pad),
            self._longs(tables),
        )
        n = getattr(self.model, "ngram_context", 0)
        if not n:
            return (*inputs, None)
        # a padding row's token is at position 0: nothing before it (-1)
        contexts = [[-1] * n] * len(token_ids) if ngram_contexts is None else ngram_contexts
        return (*inputs, self._longs([*contexts, *[[-1] * n] * pad]).view(size, n))

    def _run(self, graph: tuple[str, int], *inputs: torch.Tensor | int | None) -> tuple[torch.Tensor, ...]:
        # Once a bucket's graph is compiled, nothing Dynamo checks before a call changes: the bucket
        # fixes the batch, the weights and the state tensors are the same objects for the engine's
        # life, and the one size that varies, the block-table width, is a dynamic dimension of the
        # graph (tests/system/test_compiled_decode.py checks that wider tables pass its guards). So a
        # call runs the code Dynamo made for the graph directly: no guards, and no Dynamo hook on
        # every Python frame the call runs (1.2x the step at batch 1 here).
        direct = self._direct[graph]
        if direct is not None:
            return direct(self.model, self.cache, *inputs)
        try:  # this torch keeps no code to call: guards skipped
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self._graphs[graph](self.model, self.cache, *inputs)
        except RuntimeError as error:  # raised before the graph runs: nothing was written yet
            if "Recompilation triggered" not in str(error):
                raise
            log.warning("%s graph for batch %d compiled again (%s)", *graph, _shapes(inputs))
        return self._call(graph, inputs)

    def _call(self, graph: tuple[str, int], inputs: tuple[torch.Tensor | int | None, ...]) -> tuple[torch.Tensor, ...]:
        """Call the graph through Dynamo, which compiles it first where no compiled graph's guards pass."""
        if graph[0] == "decode":
            torch._dynamo.maybe_mark_dynamic(inputs[3], 1)  # the block-table width
        return self._graphs[graph](self.model, self.cache, *inputs)

    def _compile(self, size: int) -> None:
        """Compile the bucket's graphs on padding rows' inputs, running none of them (compile_only)."""
        start = time.perf_counter()
        graphs = {("decode", size): self._padded(size, [], [], [], [], [])}
        if self.streams:
            graphs["draft", size] = self._draft_inputs(size, [], [], [], [], None)
        if self.dspark_block:
            graphs["dspark", size] = self._dspark_inputs(size, [], [], [], [])
        for graph, inputs in graphs.items():
            compile_without_running(lambda graph=graph, inputs=inputs: self._call(graph, inputs))
            self._direct[graph] = compiled_code(self._graphs[graph])
        self._ready.add(size)
        planned = len(self.buckets)
        seconds = time.perf_counter() - start
        log.info("decode graph for batch %d ready in %.1f s (%d of %d)", size, seconds, self.num_ready, planned)
        if self.on_progress is not None:
            self.on_progress(self.num_ready, planned)
