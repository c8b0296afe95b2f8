"""Read GGUF files (llama.cpp's format): validate them, build the HF config, and stream weights.

Weights are dequantized with the ``gguf`` package one tensor at a time, a bounded number of rows
at a time, and read with plain file reads rather than through the reader's memory map, so the
resident memory of a conversion stays near one dequantized tensor however large the model is.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, TokenType
from gguf.quants import dequantize
from specdec.engine.errors import CorruptModelFileError, ModelNotFoundError
from specdec.engine.weights.gguf_blocks import GROUP_TYPES, StoredGroups, read_groups
from specdec.engine.weights.gguf_config import ArchSpec, arch_spec, build_hf_config

logger = logging.getLogger(__name__)

# Rows are dequantized in chunks of about this many output elements (64 MiB of float32), which
# bounds the temporaries of the block decoders.
DEQUANT_CHUNK_ELEMENTS = 16 * 1024 * 1024

_TOP_LEVEL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors that carry no HF weight: rope_freqs becomes rope_scaling in the config.
_SKIPPED_TENSORS = frozenset({"rope_freqs.weight"})
# Metadata arrays longer than this (vocabulary, merges, token types) are not copied out.
_MAX_KEPT_ARRAY_LEN = 4096
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _damaged(path: Path, detail: str) -> CorruptModelFileError:
    return CorruptModelFileError(
        f"{path} is damaged ({detail}). Delete it and fetch it again "
        "(for the default models: `specdec pull <name>`)."
    )


def hf_tensor_name(gguf_name: str) -> str:
    """HF parameter name of a GGUF tensor name, e.g. blk.3.attn_q.bias -> model.layers.3...."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _TOP_LEVEL_NAMES and kind in ("weight", "bias"):
        return f"{_TOP_LEVEL_NAMES[stem]}.{kind}"
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    raise ModelNotFoundError(f"GGUF tensor {gguf_name!r} has no known Hugging Face counterpart.")


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order for ``llama`` GGUF files.

    Within each head llama.cpp stores RoPE pairs interleaved (row 2i is the first half's row i,
    row 2i+1 the second half's row i); HF's rotate-half layout keeps the halves apart. Viewing a
    head's rows as [head_dim/2, 2] and transposing to [2, head_dim/2] restores HF order. Works for
    weights [num_heads * head_dim, in] and biases [num_heads * head_dim].
    """
    head_dim = weight.shape[0] // num_heads
    grouped = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(weight.shape)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in the file and how to decode it."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # PyTorch order
    n_bytes: int
    data_offset: int
    raw_dtype: np.dtype  # element type of the stored rows (uint8 for block-quantized types)
    raw_row_len: int  # stored elements per row


def _special_tokens(reader: GGUFReader) -> dict[str, int]:
    """Control and user-defined tokens of the embedded vocabulary (``<|im_end|>`` and the like).

    Without token types, tokens spelled ``<|...|>`` are taken.
    """
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is None:
        return {}
    types = reader.get_field("tokenizer.ggml.token_type")
    if types is not None and len(types.data) == len(tokens.data):
        kinds = np.array(types.contents())
        wanted = np.flatnonzero((kinds == TokenType.CONTROL) | (kinds == TokenType.USER_DEFINED))
    else:
        wanted = range(len(tokens.data))
    special = {}
    for index in wanted:
        raw = tokens.parts[tokens.data[index]].tobytes()
        if types is not None or (raw.startswith(b"<|") and raw.endswith(b"|>")):
            special[raw.decode("utf-8", errors="replace")] = int(index)
    return special


class GGUFModel:
    """An opened, validated GGUF file of a supported architecture.

    Everything needed later (scalar metadata, tensor locations, special token ids) is copied out
    of the ``gguf`` reader, which is then dropped: its parsed vocabulary alone takes ~0.5 GB for
    a 150k-token model, memory a conversion should not hold while it dequantizes.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ModelNotFoundError(f"GGUF file {self.path} does not exist.")
        try:
            reader = GGUFReader(self.path)
            self._meta = {
                key: field.contents()
                for key, field in reader.fields.items()
                if len(field.data) <= _MAX_KEPT_ARRAY_LEN
            }
            self.tensor_infos = [
                TensorInfo(
                    name=t.name,
                    tensor_type=t.tensor_type,
                    # PyTorch order is GGUF's dimension list reversed (fastest axis first there).
                    shape=tuple(int(d) for d in reversed(t.shape.tolist())),
                    n_bytes=int(t.n_bytes),
                    data_offset=int(t.data_offset),
                    raw_dtype=t.data.dtype,
                    raw_row_len=int(t.data.shape[-1]),
                )
                for t in reader.tensors
            ]
            self.has_tokenizer = reader.get_field("tokenizer.ggml.model") is not None
            self.special_tokens = _special_tokens(reader)
        except Exception as exc:  # the reader raises ValueError, IndexError, struct errors...
            raise _damaged(self.path, f"cannot parse it: {exc!r}") from exc
        del reader
        if not self.tensor_infos:
            raise _damaged(self.path, "it holds no tensors")
        file_size = self.path.stat().st_size
        data_end = max(t.data_offset + t.n_bytes for t in self.tensor_infos)
        if file_size < data_end:
            raise _damaged(
                self.path, f"truncated: {file_size} bytes, tensor data ends at {data_end}"
            )
        self.tensors: dict[str, TensorInfo] = {t.name: t for t in self.tensor_infos}
        self.shapes: dict[str, tuple[int, ...]] = {t.name: t.shape for t in self.tensor_infos}
        self.architecture: str = self.meta("general.architecture", "")
        self.spec: ArchSpec = arch_spec(self.architecture)

    def meta(self, key: str, default: Any = None) -> Any:
        """Value of a metadata key (str, int, float, bool or short list), or ``default``.

        Arrays longer than a few thousand entries (the vocabulary, merges) are not kept.
        """
        return self._meta.get(key, default)

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        return build_hf_config(self.meta, self.shapes, self.read_small_tensor, dtype)

    def weight_plan(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """``(gguf_name, hf_name, shape)`` of every weight, in file order."""
        return [
            (t.name, hf_tensor_name(t.name), self.shapes[t.name])
            for t in self.tensor_infos
            if t.name not in _SKIPPED_TENSORS
        ]

    def read_small_tensor(self, name: str) -> np.ndarray:
        with open(self.path, "rb") as f:
            return self._read_float32(f, self.tensors[name])

    def _read_float32(self, f: BinaryIO, tensor: TensorInfo) -> np.ndarray:
        """Dequantized float32 array of ``tensor`` in PyTorch shape, read with file reads."""
        raw = np.empty(tensor.n_bytes, dtype=np.uint8)
        f.seek(tensor.data_offset)
        if f.readinto(memoryview(raw)) != tensor.n_bytes:
            raise _damaged(self.path, f"tensor {tensor.name} is cut short")
        rows = raw.view(tensor.raw_dtype).reshape(-1, tensor.raw_row_len)
        shape = self.shapes[tensor.name]
        if tensor.tensor_type == GGMLQuantizationType.F32:
            return rows.reshape(shape)
        row_len = shape[-1]
        out = np.empty((rows.shape[0], row_len), dtype=np.float32)
        step = max(1, DEQUANT_CHUNK_ELEMENTS // row_len)
        try:
            for start in range(0, rows.shape[0], step):
                out[start : start + step] = dequantize(
                    rows[start : start + step], tensor.tensor_type
                ).reshape(-1, row_len)
        except NotImplementedError as exc:
            raise ModelNotFoundError(
                f"{self.path}: tensor {tensor.name} uses {tensor.tensor_type.name}, which the "
                "installed gguf package cannot dequantize."
            ) from exc
        return out.reshape(shape)

    def stored_groups(self, hf_name: str) -> StoredGroups | None:
        """The file's own groups of weight ``hf_name`` (as ``gguf_blocks.read_groups`` gives
        them), or None where it is not stored in a type of 32-weight groups."""
        gguf_name = self._gguf_names.get(hf_name)
        tensor = self.tensors.get(gguf_name) if gguf_name else None
        if tensor is None or tensor.tensor_type not in GROUP_TYPES or len(tensor.shape) != 2:
            return None
        raw = np.empty(tensor.n_bytes, dtype=np.uint8)
        with open(self.path, "rb") as f:
            f.seek(tensor.data_offset)
            if f.readinto(memoryview(raw)) != tensor.n_bytes:
                raise _damaged(self.path, f"tensor {tensor.name} is cut short")
        groups = read_groups(raw, tensor.tensor_type, tensor.shape)
        part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        if self.spec.permute_qk and part in ("attn_q", "attn_k"):
            heads = self.meta(f"{self.architecture}.attention.head_count")
            if part == "attn_k":
                heads = self.meta(f"{self.architecture}.attention.head_count_kv", heads)
            arrays = (unpermute_qk(array, int(heads)) for array in groups[1:])
            groups = StoredGroups(groups.bits, *arrays)
        return groups

    @functools.cached_property
    def _gguf_names(self) -> dict[str, str]:
        return {hf_name: gguf_name for gguf_name, hf_name, _ in self.weight_plan()}

    def iter_weights(
        self, dtype: torch.dtype = torch.float32
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` one at a time, in file order, as ``dtype``.

        The generator drops its own reference before reading the next tensor, so a consumer that
        does the same holds only one tensor at a time.
        """
        num_heads = int(self.meta(f"{self.architecture}.attention.head_count"))
        num_kv_heads = int(self.meta(f"{self.architecture}.attention.head_count_kv", num_heads))
        heads_by_part = {"attn_q": num_heads, "attn_k": num_kv_heads}
        with open(self.path, "rb") as f:
            for gguf_name, hf_name, _ in self.weight_plan():
                array = self._read_float32(f, self.tensors[gguf_name])
                part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
                if self.spec.permute_qk and part in heads_by_part:
                    array = unpermute_qk(array, heads_by_part[part])
                tensor = torch.from_numpy(array)
                del array
                if tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                yield hf_name, tensor
                del tensor


def gguf_to_hf_config(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Hugging Face config.json dict for a ``qwen2`` or ``llama`` GGUF file."""
    return GGUFModel(path).hf_config(dtype)


def iter_gguf_weights(
    path: Path, dtype: torch.dtype = torch.float32
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight of a GGUF file, dequantized to ``dtype``."""
    yield from GGUFModel(path).iter_weights(dtype)


def save_tokenizer_from_gguf(path: Path, out_dir: Path, model: GGUFModel | None = None) -> bool:
    """Write the tokenizer embedded in a GGUF file (with its chat template) into ``out_dir``.

    Returns False, after logging a warning, when the file has no tokenizer metadata or
    transformers cannot build a tokenizer from it; the weights are still usable then.
    """
    from transformers import AutoTokenizer

    path = Path(path).expanduser()
    model = model or GGUFModel(path)
    if not model.has_tokenizer:
        logger.warning("%s has no tokenizer metadata; no tokenizer files written", path)
        return False
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers raises many kinds for unsupported tokenizers
        logger.warning("could not build a tokenizer from %s (%r); none written", path, exc)
        return False
    tokenizer.save_pretrained(str(out_dir))
    return True
