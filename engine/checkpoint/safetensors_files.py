"""The tensors of a safetensors checkpoint (one file or shards with an index), read one at a time.

The `safetensors` library maps each file into memory and hands out views of the mapping;
every page a load touches then stays resident until the whole shard is released, so
dequantizing an FP8 shard into bf16 weights holds the shard and the weights at once. Here
each tensor is read with a plain file read into a buffer of its own: a load holds the
weights built so far plus the one tensor being converted. The format is an 8-byte header
length, a JSON header (name -> dtype, shape, byte range) and the data.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from engine.errors import UnsupportedCheckpointError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    def where(self) -> str:
        return f"{self.file.name}: {self.name}"


def read_index(path: Path) -> dict[str, str]:
    """A sharded checkpoint's weight map (tensor name -> file name); {} for a single file."""
    index = path / INDEX_FILE
    if not index.is_file():
        return {}
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("file names must be strings")
        return weight_map
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise UnsupportedCheckpointError(f"{index}: not a safetensors index ({err})") from None


def checkpoint_files(path: Path) -> list[Path]:
    weight_map = read_index(path)
    if weight_map:
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise UnsupportedCheckpointError(f"{path / INDEX_FILE} names {file.name}, which is missing")
        return files
    single = path / SINGLE_FILE
    if single.is_file():
        return [single]
    raise UnsupportedCheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints load)")


def read_header(file: Path) -> dict[str, StoredTensor]:
    """Every tensor a file declares; a header that does not fit the file (truncated, corrupt) is an error."""
    size = file.stat().st_size
    with file.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise UnsupportedCheckpointError(f"{file.name}: {size} bytes, too short for a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER, size - 8):
            raise UnsupportedCheckpointError(
                f"{file.name}: header of {header_len} bytes does not fit in the {size}-byte file (truncated?)"
            )
        try:
            header = json.loads(f.read(header_len))
        except ValueError as err:
            raise UnsupportedCheckpointError(f"{file.name}: unreadable safetensors header ({err})") from None
    data_start = 8 + header_len
    tensors: dict[str, StoredTensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise UnsupportedCheckpointError(f"{file.name}: {name} has dtype {info.get('dtype')!r}, not supported")
        begin, end = info["data_offsets"]
        tensor = StoredTensor(file, name, dtype, tuple(info["shape"]), data_start + begin, end - begin)
        if tensor.nbytes != tensor.numel * dtype.itemsize:
            raise UnsupportedCheckpointError(
                f"{tensor.where()}: {tensor.nbytes} bytes for a {dtype} tensor of shape {list(tensor.shape)}"
            )
        if data_start + end > size:
            raise UnsupportedCheckpointError(
                f"{tensor.where()}: ends at byte {data_start + end} of a {size}-byte file (truncated shard?)"
            )
        tensors[name] = tensor
    return tensors


class CheckpointFiles:
    """The tensors of every file of a checkpoint, by name; `read` returns one as a new CPU tensor."""

    def __init__(self, path: Path):
        self.path = path
        self.files = checkpoint_files(path)
        self.tensors: dict[str, StoredTensor] = {}
        for file in self.files:
            for name, tensor in read_header(file).items():
                if name in self.tensors:
                    raise UnsupportedCheckpointError(
                        f"{name} is in both {self.tensors[name].file.name} and {file.name}"
                    )
                self.tensors[name] = tensor
        for name, file_name in read_index(path).items():
            if self.tensors.get(name) is None or self.tensors[name].file.name != file_name:
                raise UnsupportedCheckpointError(f"{INDEX_FILE} puts {name} in {file_name}, which does not hold it")
        self._open: dict[Path, BinaryIO] = {}

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._open.values():
            handle.close()
        self._open.clear()

    def read(self, tensor: StoredTensor) -> torch.Tensor:
        if tensor.nbytes == 0:
            return torch.empty(tensor.shape, dtype=tensor.dtype)
        handle = self._open.get(tensor.file)
        if handle is None:
            handle = self._open[tensor.file] = tensor.file.open("rb")
        handle.seek(tensor.offset)
        out = torch.empty(tensor.shape, dtype=tensor.dtype)
        if handle.readinto(out.view(-1).view(torch.uint8).numpy()) != tensor.nbytes:
            raise UnsupportedCheckpointError(f"{tensor.where()}: file ended early (truncated shard?)")
        return out

    def mapped(self, tensor: StoredTensor) -> torch.Tensor:
        """The tensor where it lies in its file, memory-mapped copy-on-write: pages are read when
        touched, so a table far larger than memory costs only the rows looked up."""
        element = torch.empty((), dtype=tensor.dtype).element_size()
        if tensor.nbytes == 0 or tensor.offset % element:
            return self.read(tensor)
        size = tensor.file.stat().st_size
        whole = torch.from_file(str(tensor.file), shared=False, size=size, dtype=torch.uint8)
        return whole[tensor.offset : tensor.offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)

    def bytes_on_disk(self) -> int:
        return sum(file.stat().st_size for file in self.files)
