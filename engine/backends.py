"""Kernel backends: the hot operations of the model, swappable per device.

The PyTorch reference backend is the default and is correct on every device. A faster
backend (Triton, FlashMLA, DeepGEMM on a GPU) registers itself with a `supports(device)`
check, so it is chosen only where its imports succeed and the hardware fits; any backend
must give the same results as the reference within the parity tests' tolerance.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.errors import EngineError


def keep_freed_memory_in_process() -> bool:
    """Ask glibc to keep freed memory for reuse instead of returning it to the kernel.

    Every step allocates and frees the same few-megabyte activations. By default glibc
    serves those with fresh mmap()s and unmaps them on free, so each step pays page faults
    and zeroing for all of them again: about a quarter of prefill time on a 2-core CPU.
    Raising the mmap and trim thresholds makes freed chunks stay in the heap for the next
    step (the effect LD_PRELOAD=jemalloc has). Process-wide; a no-op where glibc is absent.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    ok = mallopt(m_mmap_threshold, 32 << 20)  # glibc's largest allowed threshold on 64-bit
    ok &= mallopt(m_trim_threshold, 1 << 30)
    ok &= mallopt(m_top_pad, 64 << 20)
    return bool(ok)


class TorchBackend:
    """Reference implementations in plain PyTorch."""

    name = "torch"

    @staticmethod
    def attention(
        q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Shared-KV attention with one sink logit per head.

        q [B, H, S, d], keys [B, K, d] (the single KV head: keys and values at once),
        bias [B, S, K] (0 or -inf) -> [B, S, H, d].
        """
        if q.shape[2] >= FUSED_MIN_QUERIES and q.device.type == "cpu":
            return fused_cpu_attention(q, keys, bias, sinks, scaling)
        return unfused_attention(q, keys, bias, sinks, scaling)

    @staticmethod
    def output_logits(hidden: torch.Tensor, weight: torch.Tensor, rows_per_slice: int = 4096) -> torch.Tensor:
        """hidden [T, D] @ weight[V, D]^T -> fp32 logits [T, V].

        On the CPU the vocabulary (129,280 rows) is done a slice at a time, each slice's
        weight @ hidden^T transposed into the output while it is still in cache: at batch 32
        on two cores that is about 25% faster than one hidden @ weight^T. One row is padded
        to two, because MKL's matrix-vector path runs on a single thread (3x slower).
        """
        if hidden.device.type != "cpu":
            return F.linear(hidden, weight).float()
        rows = hidden.shape[0]
        hidden = _at_least_two_rows(hidden)
        out = torch.empty(hidden.shape[0], weight.shape[0], dtype=torch.float32)
        for start in range(0, weight.shape[0], rows_per_slice):
            out[:, start : start + rows_per_slice] = (weight[start : start + rows_per_slice] @ hidden.T).T
        return out[:rows]

    @staticmethod
    def logit_columns(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """weight[V, D] @ hidden[T, D]^T -> fp32 logits transposed, [V, T]: a compiled step's output
        projection, its logsumexp and argmax then reduce over the vocabulary in place. On the CPU it
        is one MKL call with the vocabulary as its long side (no slices for a compiler to copy back
        together: 1.4x output_logits at batch 1, 1.17x at batch 32, 129,280 x 512 here), one row
        padded to two as in output_logits."""
        if hidden.device.type != "cpu":
            return F.linear(hidden, weight).float().T
        return torch.mm(weight, _at_least_two_rows(hidden).T)[:, : hidden.shape[0]].float()

    @staticmethod
    def routed_experts(
        x: torch.Tensor,  # [T, D]
        indices: torch.Tensor,  # [T, k] expert ids
        weights: torch.Tensor,  # [T, k]
        gate_up: torch.Tensor,  # [E, 2I, D]: gate rows, then up rows
        down: torch.Tensor,  # [E, D, I]
        limit: float,
    ) -> torch.Tensor:
        """Clamped-SwiGLU experts: the (token, expert) pairs sorted by expert, each expert's run of
        rows multiplied by its weights in one grouped matmul. Every shape depends on the number of
        tokens only, not on the routing: no host sync, nothing for a compiler to break on.

        On a CPU, F.grouped_mm is a loop of one matrix product per expert, each with a host sync for
        its run's length. With no more picks than experts, each pick is instead its own row times its
        expert's weights, one batched product for them all (no more weights read). In a decode
        graph that holds up to PICKS_PER_EXPERT picks per expert (every decode step): 2-4x faster
        than the loop at batch 1 to 128 here, though it reads an expert's weights once per pick.
        Eager, the weights' copies past one pick per expert cost more than the loop (0.54x at batch 32),
        and so do the re-reads in the compiled prefill's pieces past a few picks an expert
        (`picks_per_expert_while_tracing`)."""
        top_k, n_experts = indices.shape[1], gate_up.shape[0]
        # is_dynamo_compiling, not is_compiling: the latter is a process-wide flag, held for a whole compile,
        # so an eager step running while decode graphs compile on another thread would read it too
        picks_per_expert = _traced_picks_per_expert() if torch.compiler.is_dynamo_compiling() else 1
        if x.device.type == "cpu" and indices.numel() <= picks_per_expert * n_experts:
            return _experts_per_pick(x, indices, weights, gate_up, down, limit)
        flat = indices.flatten()
        order = flat.argsort(stable=True)
        experts = torch.arange(n_experts, device=flat.device, dtype=flat.dtype)
        ends = torch.searchsorted(flat[order], experts, right=True).to(torch.int32)  # end of each expert's run
        tokens = order // top_k
        gate, up = F.grouped_mm(x[tokens], gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        hidden = clamped_swiglu(gate, up, limit)
        y = F.grouped_mm(hidden, down.transpose(1, 2), offs=ends) * weights.flatten()[order].unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))


def unfused_attention(
    q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor, scaling: float
) -> torch.Tensor:
    """TorchBackend.attention step by step: what a decode row runs, and what a compiled decode graph
    traces and fuses."""
    b, h, s, d = q.shape
    # heads and queries folded into one axis so the single KV head is never copied per head
    logits = torch.bmm((q * scaling).reshape(b, h * s, d), keys.transpose(1, 2)).view(b, h, s, -1)
    logits.add_(bias.unsqueeze(1))
    # the sink is one more logit per head that takes probability mass but has no value:
    # p = exp(logit - log(sum(exp(logits)) + exp(sink))), computed in place without a concatenation
    normaliser = torch.logaddexp(logits.logsumexp(dim=-1, keepdim=True), sinks.view(1, h, 1, 1).to(logits.dtype))
    probs = logits.sub_(normaliser).exp_().to(keys.dtype)
    return torch.bmm(probs.view(b, h * s, -1), keys).view(b, h, s, d).transpose(1, 2)


# From this many queries a row (a prompt chunk's), TorchBackend.attention on the CPU runs fused:
# one query (a decode row) is slower so (0.65 against 0.44 ms for 32 rows of 192 keys here)
FUSED_MIN_QUERIES = 2


def fused_cpu_attention(
    q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor, scaling: float
) -> torch.Tensor:
    """TorchBackend.attention through PyTorch's fused (flash) CPU kernel: it never writes the
    [H, S, K] logits out, and gives each row's log-sum-exp, from which the sink's share follows:
    softmax over the keys and the sink is softmax over the keys times sigmoid(lse - sink). Unfused,
    the logits' logsumexp and exp are most of a prompt chunk's attention on the CPU (slow on masked
    entries and on those far below the row's largest); fused, a 256-query chunk of 320 keys takes
    1.5 ms against 7.5 here, no further from a float64 computation."""
    b, h, _, d = q.shape
    shared = keys.unsqueeze(1).expand(b, h, keys.shape[1], d)  # the one KV head, seen by every head
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, shared, shared, attn_mask=bias.unsqueeze(1).to(q.dtype), scale=scaling
    )
    kept = torch.sigmoid(lse - sinks.view(1, h, 1).to(lse.dtype))  # [B, H, S]: what the sink leaves
    return (out * kept.unsqueeze(-1).to(out.dtype)).transpose(1, 2)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4's expert activation: SwiGLU with the gate clamped from above, `up` both ways."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _at_least_two_rows(hidden: torch.Tensor) -> torch.Tensor:
    """One row repeated as two: MKL's matrix-vector path runs on a single thread (3x slower)."""
    return torch.cat([hidden, hidden]) if hidden.shape[0] == 1 else hidden


# a traced graph's limit (the decode graphs', see routed_experts: past about 32 picks per expert the
# loop wins), unless picks_per_expert_while_tracing sets another (the prefill pieces': 2)
PICKS_PER_EXPERT = 16

_tracing = threading.local()  # .picks_per_expert on a thread tracing graphs of another limit


def _traced_picks_per_expert() -> int:  # read once as a graph is traced: see mark_graph_constants
    return getattr(_tracing, "picks_per_expert", PICKS_PER_EXPERT)


def mark_graph_constants() -> None:
    """Tell Dynamo that `_traced_picks_per_expert` is read once as a graph is traced: a constant of
    the graph, with no guard. Called where graphs are made (compiled_decode.compile_only), not as a
    decorator at import: marking imports Dynamo and Inductor, 1.5 s of every process that imports
    the engine, where most never compile (eager services, the CLI's eager commands, the tests)."""
    torch.compiler.assume_constant_result(_traced_picks_per_expert)


@contextlib.contextmanager
def picks_per_expert_while_tracing(limit: int) -> Iterator[None]:
    """Graphs traced on this thread meanwhile multiply the routed experts a pick at a time up to
    `limit` picks an expert, and past that in the grouped product, instead of up to
    PICKS_PER_EXPERT: the compiled prefill's pieces (engine/compiled_prefill.py)."""
    _tracing.picks_per_expert = limit
    try:
        yield
    finally:
        del _tracing.picks_per_expert


def _experts_per_pick(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """routed_experts with each (token, expert) pick multiplied on its own: a row's result depends on
    its token and expert alone, never on what else the batch holds.

    The picks run in expert order, so that consecutive rows read the same expert's weights while
    they are still in the core's cache (1.04x the step at batch 32 here); each pick's result then
    goes back to its token's place, and a token's picks are summed in the order it chose them."""
    top_k = indices.shape[1]
    experts, order = indices.flatten().sort(stable=True)
    rows = x[order // top_k].unsqueeze(1)  # [T * k, 1, D], grouped by expert
    gate, up = torch.bmm(rows, gate_up[experts].transpose(1, 2)).squeeze(1).chunk(2, dim=-1)
    hidden = clamped_swiglu(gate, up, limit)
    by_expert = torch.bmm(hidden.unsqueeze(1), down[experts].transpose(1, 2)).squeeze(1)
    y = torch.empty_like(by_expert).index_copy_(0, order, by_expert).view(x.shape[0], top_k, -1)
    return (y * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)


@dataclass
class _Entry:
    factory: Callable[[], object]
    supports: Callable[[torch.device], bool]


_REGISTRY: dict[str, _Entry] = {"torch": _Entry(TorchBackend, lambda device: True)}


def register_backend(name: str, factory: Callable[[], object], supports: Callable[[torch.device], bool]) -> None:
    """Make a backend selectable; later registrations are preferred over earlier ones."""
    _REGISTRY[name] = _Entry(factory, supports)


def available_backends(device: torch.device | str) -> list[str]:
    device = torch.device(device)
    return [name for name, entry in _REGISTRY.items() if entry.supports(device)]


def select_backend(device: torch.device | str, name: str | None = None):
    """The named backend, or the most recently registered one that supports the device."""
    device = torch.device(device)
    if name is not None:
        entry = _REGISTRY.get(name)
        if entry is None:
            raise EngineError(f"unknown kernel backend {name!r}; registered: {sorted(_REGISTRY)}")
        if not entry.supports(device):
            raise EngineError(f"kernel backend {name!r} does not support device {device}")
        return entry.factory()
    return _REGISTRY[available_backends(device)[-1]].factory()
