"""Write a model as sharded safetensors while its tensors stream in, one tensor in memory at a time.

The shard layout is planned up front from the known shapes, so every shard's header can be written
before its data and each incoming tensor goes straight to disk. Peak memory is therefore one tensor,
not one shard and never the whole model.

safetensors layout: an 8-byte little-endian header length N, N bytes of JSON (name -> dtype, shape,
[begin, end) byte offsets into the data section; padded with spaces to a multiple of 8), then the
raw little-endian tensor bytes, contiguous, without gaps.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import torch

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 1 << 30  # 1 GiB, the usual Hugging Face shard size

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
}


@dataclass
class Shard:
    """One planned shard: its file name and the tensors it holds, in write order."""

    file_name: str
    tensors: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    num_bytes: int = 0


def plan_shards(
    entries: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, max_shard_bytes: int
) -> list[Shard]:
    """Group tensors, in order, into shards of at most ``max_shard_bytes`` (a larger tensor gets a
    shard of its own)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    groups: list[Shard] = []
    for name, shape in entries:
        size = math.prod(shape) * itemsize
        if not groups or (groups[-1].tensors and groups[-1].num_bytes + size > max_shard_bytes):
            groups.append(Shard(file_name=""))
        groups[-1].tensors.append((name, shape))
        groups[-1].num_bytes += size
    total = len(groups)
    for i, shard in enumerate(groups, start=1):
        shard.file_name = f"model-{i:05d}-of-{total:05d}.safetensors"
    return groups


def _header_bytes(shard: Shard, dtype_name: str, itemsize: int) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shard.tensors:
        size = math.prod(shape) * itemsize
        header[name] = {
            "dtype": dtype_name,
            "shape": list(shape),
            "data_offsets": [offset, size + offset],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


class ShardedSafetensorsWriter:
    """Streams tensors into planned shards; ``close`` writes model.safetensors.index.json.

    Tensors must arrive in the planned order with the planned shapes; anything else is a bug in
    the producer and raises ValueError rather than writing an unreadable file.
    """

    def __init__(
        self,
        out_dir: Path,
        entries: list[tuple[str, tuple[int, ...]]],
        dtype: torch.dtype,
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    ) -> None:
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {dtype}; use one of {list(_DTYPE_NAMES)}")
        self.out_dir = Path(out_dir)
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.shards = plan_shards(entries, dtype, max_shard_bytes)
        self._shard_index = 0
        self._tensor_index = 0
        self._file: BinaryIO | None = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._shard_index >= len(self.shards):
            raise ValueError(f"tensor {name} arrived after every planned tensor was written")
        shard = self.shards[self._shard_index]
        expected_name, expected_shape = shard.tensors[self._tensor_index]
        if (name, tuple(tensor.shape), tensor.dtype) != (expected_name, expected_shape, self.dtype):
            raise ValueError(
                f"expected {expected_name} {expected_shape} {self.dtype}, "
                f"got {name} {tuple(tensor.shape)} {tensor.dtype}"
            )
        if self._file is None:
            self._file = open(self.out_dir / shard.file_name, "wb")  # noqa: SIM115 - spans calls
            self._file.write(_header_bytes(shard, _DTYPE_NAMES[self.dtype], self.itemsize))
        # A byte view of the tensor's own storage: no copy of the data on the way to disk.
        self._file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
        self._tensor_index += 1
        if self._tensor_index == len(shard.tensors):
            self._finish_shard()

    def _finish_shard(self) -> None:
        assert self._file is not None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        self._shard_index += 1
        self._tensor_index = 0

    def close(self) -> None:
        """Check every planned tensor arrived, then write the index."""
        if self._shard_index != len(self.shards):
            raise ValueError("writer closed before every planned tensor was written")
        weight_map = {name: s.file_name for s in self.shards for name, _ in s.tensors}
        index = {
            "metadata": {"total_size": sum(s.num_bytes for s in self.shards)},
            "weight_map": weight_map,
        }
        with open(self.out_dir / INDEX_FILE, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> ShardedSafetensorsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
