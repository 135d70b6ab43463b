"""Loading a DeepSeek-V4 checkpoint into the engine's model.

Checkpoints load as DeepSeek publishes them (its own tensor names, FP8 weights with
128 x 128 block scales, FP4 routed experts, BF16 projections, multi-token-prediction
modules) and as transformers writes them (its module names, with or without the `model.`
prefix), from one file or from shards with an index. Everything that can be checked from
the headers is checked before any weight is read (`plan_weights`), and each problem is an
error naming the file and the tensor. Quantized weights are dequantized while loading, one
tensor at a time, so a load holds the finished weights plus the one tensor in hand.
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.checkpoint.quant import (
    FP8_DTYPE,
    SCALE_DTYPES,
    dequantize_fp4,
    dequantize_fp8,
    fp4_scale_shape,
    fp8_scale_shape,
)
from engine.checkpoint.safetensors_files import CheckpointFiles, StoredTensor, checkpoint_files
from engine.checkpoint.weight_names import (
    EXPERT_PARAMS,
    EXPERT_PARTS,
    VISION_TENSORS,
    Target,
    canonical_name,
    canonical_name_v41,
    deepseek_expert_name,
)
from engine.config import QuantConfig
from engine.config_v41 import V41Config
from engine.errors import UnsupportedCheckpointError
from engine.families import AnyConfig, build_model, read_config

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FP4_STORAGE = (torch.int8, torch.uint8)
ENGRAM_TABLE = "engram.embed.weight"  # kept as stored (memory-mapped), looked up row by row
ENGRAM_SCALE_GROUP = 32


@dataclass(frozen=True)
class Piece:
    """One stored tensor, with its scale if it is quantized, and where its values go."""

    tensor: StoredTensor
    scale: StoredTensor | None
    target: Target

    @property
    def quantization(self) -> str:
        if self.tensor.dtype == FP8_DTYPE:
            return "fp8"
        return "fp4" if self.tensor.dtype in FP4_STORAGE and self.scale is not None else "none"

    @property
    def key(self) -> tuple[int | None, int | None]:
        return self.target.expert, self.target.half


@dataclass
class WeightPlan:
    """Which stored tensors make each parameter of the model; built and checked from headers only."""

    model: torch.nn.Module  # on the meta device
    expected: dict[str, torch.Tensor]  # its state dict: names, shapes and dtypes of what to build
    pieces: dict[str, list[Piece]]  # parameter name -> its pieces (several for per-expert tensors)
    unused: list[str]  # stored names the engine has no place for


def resolve_dtype(config: AnyConfig, dtype: torch.dtype | str | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = (dtype or config.torch_dtype or "float32").replace("torch.", "")
    if name not in _DTYPES:
        raise UnsupportedCheckpointError(f"dtype {name!r} is not supported (float32, bfloat16, float16)")
    return _DTYPES[name]


def _find_scales(files: CheckpointFiles) -> dict[str, StoredTensor]:
    """Weight name -> its scale tensor. DeepSeek names a scale `X.scale` beside `X.weight`;
    transformers names it `X.weight_scale_inv`, or `P_scale_inv` beside a fused parameter `P`."""
    scales = {}
    for name, tensor in files.tensors.items():
        if name.endswith("_scale_inv"):
            weight = name.removesuffix("_scale_inv")
        elif name.endswith(".scale") and name.removesuffix("scale") + "weight" in files.tensors:
            weight = name.removesuffix("scale") + "weight"
        else:
            continue
        if weight in files.tensors:
            scales[weight] = tensor
    return scales


def plan_weights(files: CheckpointFiles, config: AnyConfig) -> WeightPlan:
    scales = _find_scales(files)
    scale_names = {scale.name for scale in scales.values()}
    canonical = canonical_name_v41 if isinstance(config, V41Config) else canonical_name
    targets = {name: canonical(name) for name in files.tensors if name not in scale_names}
    has_mtp = any(target is not None and target.name.startswith("mtp.") for target in targets.values())
    with torch.device("meta"):
        model = build_model(config, files.path, config.num_nextn_predict_layers if has_mtp else 0)
    expected = model.state_dict()

    pieces: dict[str, list[Piece]] = defaultdict(list)
    unused: list[str] = []
    for name, target in targets.items():
        tensor = files.tensors[name]
        if target is not None and target.name in expected:
            pieces[target.name].append(Piece(tensor, scales.get(name), target))
        elif name.removeprefix("model.").startswith(VISION_TENSORS):
            continue  # the image encoder's (engine/checkpoint/vision.py)
        elif target is None or target.name.startswith("mtp."):
            unused.append(name)  # named in a warning: nothing the model computes depends on it
        else:
            raise UnsupportedCheckpointError(
                f"{tensor.where()} has no place in the model config.json describes (as {target.name}); "
                "leaving it out would change the model's output"
            )
    if config.tie_word_embeddings and "lm_head.weight" not in pieces and "model.embed_tokens.weight" in pieces:
        pieces["lm_head.weight"] = pieces["model.embed_tokens.weight"]
    missing: list[str] = []
    for name, meta in expected.items():
        missing += _check_parameter(name, meta, pieces.get(name, []), config)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise UnsupportedCheckpointError(f"{files.path}: missing tensors the model needs: {shown}")
    return WeightPlan(model, expected, dict(pieces), sorted(unused))


def _check_parameter(name: str, meta: torch.Tensor, pieces: list[Piece], config: AnyConfig) -> list[str]:
    """Checks every piece of one parameter against it; returns the names of missing pieces."""
    if not pieces:
        return [name]
    seen: dict[tuple[int | None, int | None], Piece] = {}
    for piece in pieces:
        if piece.key in seen:
            raise UnsupportedCheckpointError(
                f"{piece.tensor.where()} and {seen[piece.key].tensor.where()} both hold {name}"
            )
        seen[piece.key] = piece
        _check_piece(piece, _piece_shape(piece.target, tuple(meta.shape)), meta.dtype, config.quantization_config)
    if (None, None) in seen:
        if len(seen) > 1:
            raise UnsupportedCheckpointError(f"{name} is stored both whole and per expert")
        return []
    if not name.endswith(EXPERT_PARAMS):
        return [name]
    # per-expert tensors: every expert's w1 and w3 (gate_up_proj) or w2 (down_proj)
    parts = [part for part, (param, _) in EXPERT_PARTS.items() if name.endswith(param)]
    wanted = [(expert, part) for expert in range(meta.shape[0]) for part in parts]
    return [deepseek_expert_name(name, e, part) for e, part in wanted if (e, EXPERT_PARTS[part][1]) not in seen]


def _piece_shape(target: Target, shape: tuple[int, ...]) -> tuple[int, ...]:
    if target.expert is None:
        return shape
    if target.half is None:
        return shape[1:]
    return (shape[1] // 2, *shape[2:])


def _check_piece(piece: Piece, shape: tuple[int, ...], dtype: torch.dtype, quant: QuantConfig | None) -> None:
    stored, scale = piece.tensor, piece.scale
    where = stored.where()
    is_expert = piece.target.name.endswith(EXPERT_PARAMS)
    if piece.target.name.endswith(ENGRAM_TABLE):
        _check_engram_table(piece, shape)
        return
    if stored.dtype == FP8_DTYPE or (stored.dtype in FP4_STORAGE and dtype.is_floating_point):
        kind = "FP8" if stored.dtype == FP8_DTYPE else "FP4 (packed int8)"
        if quant is None:
            raise UnsupportedCheckpointError(f"{where} is {kind} but config.json has no quantization_config")
        if scale is None:
            raise UnsupportedCheckpointError(f"{where} is {kind} but has no scale (.scale or .weight_scale_inv)")
        if scale.dtype not in SCALE_DTYPES:
            raise UnsupportedCheckpointError(f"{scale.where()} is {scale.dtype}, not a scale dtype")
        if stored.dtype == FP8_DTYPE:
            stored_shape, scale_shape = shape, fp8_scale_shape(shape, quant.weight_block_size)
        else:
            if not is_expert or quant.expert_dtype != "fp4":
                raise UnsupportedCheckpointError(
                    f"{where} is {stored.dtype}: only routed experts may be FP4, with expert_dtype fp4 in config.json"
                )
            stored_shape, scale_shape = (*shape[:-1], shape[-1] // 2), fp4_scale_shape(shape)
        if scale.shape != scale_shape:
            raise UnsupportedCheckpointError(
                f"{scale.where()} has shape {list(scale.shape)}; {list(scale_shape)} expected for {kind} "
                f"weight {stored.name} of shape {list(shape)}"
            )
    else:
        if scale is not None:
            raise UnsupportedCheckpointError(f"{where} is {stored.dtype} but has a scale ({scale.name})")
        if stored.dtype.is_floating_point != dtype.is_floating_point or stored.dtype == torch.bool:
            raise UnsupportedCheckpointError(f"{where} is {stored.dtype}; {dtype} values expected")
        stored_shape = shape
    if stored.shape != stored_shape:
        raise UnsupportedCheckpointError(
            f"{where} has shape {list(stored.shape)}; config.json makes it {list(stored_shape)}"
        )


def _check_engram_table(piece: Piece, shape: tuple[int, ...]) -> None:
    """An Engram table: [rows, dim] floats, or FP8 with one scale per row and 32 columns."""
    stored, scale = piece.tensor, piece.scale
    if stored.shape != shape:
        raise UnsupportedCheckpointError(
            f"{stored.where()} has shape {list(stored.shape)}; config.json makes it {list(shape)}"
        )
    if stored.dtype == FP8_DTYPE:
        wanted = (shape[0], -(-shape[1] // ENGRAM_SCALE_GROUP))
        if scale is None or scale.dtype not in SCALE_DTYPES or scale.shape != wanted:
            got = "none" if scale is None else f"{scale.dtype} {list(scale.shape)}"
            raise UnsupportedCheckpointError(
                f"{stored.where()} is FP8: needs a scale of shape {list(wanted)}, has {got}"
            )
    elif not stored.dtype.is_floating_point or scale is not None:
        raise UnsupportedCheckpointError(
            f"{stored.where()} is {stored.dtype}: an Engram table is FP8 with scales or floats"
        )


def parameter_dtype(name: str, meta: torch.Tensor, dtype: torch.dtype, model: torch.nn.Module) -> torch.dtype:
    """What a parameter is loaded as: the load dtype, but fp32 where the reference keeps it and
    integers (the hash-routing table) as they are."""
    if not meta.dtype.is_floating_point:
        return meta.dtype
    return torch.float32 if name.endswith(model.fp32_parameter_suffixes) else dtype


def _read_piece(
    files: CheckpointFiles, piece: Piece, dtype: torch.dtype, device: torch.device, quant: QuantConfig | None
) -> torch.Tensor:
    values = files.read(piece.tensor).to(device)
    if piece.scale is None:
        return values.to(dtype)
    scale = files.read(piece.scale).to(device)
    if piece.target.name.endswith(ENGRAM_TABLE):  # FP8 with per-row scales: dequantized as looked up
        return values
    if piece.quantization == "fp8":
        return dequantize_fp8(values, scale, quant.weight_block_size, dtype)
    return dequantize_fp4(values, scale, dtype)


def _build_parameter(
    files: CheckpointFiles,
    name: str,
    pieces: list[Piece],
    plan: WeightPlan,
    dtype: torch.dtype,
    device: torch.device,
    quant: QuantConfig | None,
) -> torch.Tensor:
    meta = plan.expected[name]
    dtype = parameter_dtype(name, meta, dtype, plan.model)
    if name.endswith(ENGRAM_TABLE) and pieces[0].tensor.dtype == FP8_DTYPE and device.type == "cpu":
        return files.mapped(pieces[0].tensor)  # ~200 GB at full size: read row by row where it lies
    if len(pieces) == 1 and pieces[0].target.expert is None:
        return _read_piece(files, pieces[0], dtype, device, quant)
    out = torch.empty(meta.shape, dtype=dtype, device=device)
    for piece in pieces:
        rows = out[piece.target.expert]
        if piece.target.half is not None:
            rows = rows.chunk(2)[piece.target.half]
        rows.copy_(_read_piece(files, piece, dtype, device, quant))
    return out


def _check_values(name: str, tensor: torch.Tensor, config: AnyConfig) -> None:
    if name.endswith("tid2eid") and tensor.numel():
        low, high = tensor.min().item(), tensor.max().item()
        if low < 0 or high >= config.n_routed_experts:
            raise UnsupportedCheckpointError(
                f"{name}: expert ids from {low} to {high}, outside 0..{config.n_routed_experts - 1}"
            )


def load_model(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
    prefill_keep_tokens: int | None = None,
) -> torch.nn.Module:
    """The checkpoint's model, of the family its config.json names (engine/families.py).
    `prefill_keep_tokens`: V4.1's prompt truncation (config_v41.py), its default if None."""
    path = Path(path)
    config = read_config(path, prefill_keep_tokens)
    dtype = resolve_dtype(config, dtype)
    device = torch.device(device)
    engram_scales = {}
    with CheckpointFiles(path) as files:
        plan = plan_weights(files, config)
        weights = {}
        for name in plan.expected:
            pieces = plan.pieces[name]
            weights[name] = _build_parameter(files, name, pieces, plan, dtype, device, config.quantization_config)
            _check_values(name, weights[name], config)
            if name.endswith(ENGRAM_TABLE) and pieces[0].scale is not None:
                scale = pieces[0].scale
                engram_scales[name] = files.mapped(scale) if device.type == "cpu" else files.read(scale).to(device)
    model = plan.model
    model.load_state_dict(weights, assign=True)
    for name, scale in engram_scales.items():
        model.get_submodule(name.removesuffix(".weight")).scale = scale
    for module in model.modules():
        for buffer_name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.device != device:  # computed at build (V4.1's Engram hash tables)
                setattr(module, buffer_name, buffer.to(device))
    if len(model.mtp):
        count = sum(len(pieces) for name, pieces in plan.pieces.items() if name.startswith("mtp."))
        kind = "DSpark draft stage(s)" if isinstance(config, V41Config) else "multi-token-prediction module(s)"
        drafter = "the speculative decoding drafter"
        logger.info("%s: %d %s (mtp.*, %d tensors), %s", path, len(model.mtp), kind, count, drafter)
    if plan.unused:
        logger.warning("%s: %s", path, unused_summary(plan))
    return model.eval()


def unused_summary(plan: WeightPlan) -> str:
    """One line naming what the checkpoint holds that generation does not use."""
    parts = []
    if plan.unused:
        shown = ", ".join(plan.unused[:10]) + (f" and {len(plan.unused) - 10} more" if len(plan.unused) > 10 else "")
        parts.append(f"ignored, no place in the model: {shown}")
    return "; ".join(parts)


def weights_id(path: str | Path) -> str:
    """A fingerprint of a checkpoint's weights (each file's name, size, first and last 64 KiB):
    state computed by one checkpoint must never be taken for another's with the same config."""
    digest = hashlib.sha256()
    for file in checkpoint_files(Path(path)):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            digest.update(f.read(1 << 16))
            f.seek(max(0, size - (1 << 16)))
            digest.update(f.read(1 << 16))
    return digest.hexdigest()[:16]
