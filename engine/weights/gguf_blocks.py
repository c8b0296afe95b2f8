"""GGUF block types read as groups of 32 weights: codes, and a scale and base per group.

llama.cpp's 4-bit formats all store weights as ``scale * code + base`` with 4-bit codes in groups
of 32 along the input, which is the layout of this engine's int4 kernel, and Q8_0 stores signed
8-bit codes with one scale per 32, the layout of its q8_0 kernel (both ``group_native``):

- Q4_0 (18-byte blocks of 32): fp16 ``d``; ``w = d * (q - 8)``.
- Q4_1 (20-byte blocks of 32): fp16 ``d`` and ``m``; ``w = d * q + m``.
- Q4_K (144-byte super-blocks of 256 = 8 groups of 32): fp16 ``d`` and ``dmin``, twelve bytes of
  6-bit group scales ``sc`` and mins ``mn``; ``w = d * sc * q - dmin * mn``.
- Q8_0 (34-byte blocks of 32): fp16 ``d`` and 32 signed 8-bit ``q``; ``w = d * q`` (base 0).

So an int4 or q8_0 target loaded from such a file can keep the file's own codes instead of
expanding them to floats and rounding them onto a second grid. The scale and base of each group
come out exactly in float32 (an fp16 value times a 6-bit integer fits float32's mantissa), and
``scale * code + base`` equals what ``gguf.quants.dequantize`` returns.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType

GROUP = 32


class StoredGroups(NamedTuple):
    """Weights ``w = scale * code + base`` in groups of 32 along the input: codes [out, in]
    (0..15 with ``bits`` 4, -128..127 with 8), scale and base [out, in / 32] (float32)."""

    bits: int
    codes: np.ndarray
    scale: np.ndarray
    base: np.ndarray


Groups = tuple[np.ndarray, np.ndarray, np.ndarray]  # codes, scale, base of a run of blocks


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of each block, as float32 [n_blocks, 1]."""
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., 16 * j] of packed codes -> codes [..., 32 * j]: the low nibbles of each run
    of 16 bytes give the first 16 codes, the high nibbles the next 16 (Q4_0 and Q4_1)."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _q4_0(blocks: np.ndarray) -> Groups:
    d = _fp16(blocks, 0)
    return _nibbles(blocks[:, 2:18]), d, -8 * d


def _q4_1(blocks: np.ndarray) -> Groups:
    return _nibbles(blocks[:, 4:20]), _fp16(blocks, 0), _fp16(blocks, 2)


def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of each super-block from its 12 packed bytes: groups 0-3
    keep theirs in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); groups 4-7 take 4 low
    bits from bytes 8-11 (scale low nibble, min high nibble) and 2 high bits from the top of
    bytes 0-3 (scales) and 4-7 (mins)."""
    p = packed.astype(np.uint8)
    low, mid, high = p[:, 0:4], p[:, 4:8], p[:, 8:12]
    scales = np.concatenate((low & 63, (high & 0x0F) | ((low >> 6) << 4)), axis=1)
    mins = np.concatenate((mid & 63, (high >> 4) | ((mid >> 6) << 4)), axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _q4_k(blocks: np.ndarray) -> Groups:
    d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)
    scales, mins = _q4_k_scales(blocks[:, 4:16])
    # Four runs of 32 bytes; run r holds group 2r in its low nibbles and group 2r + 1 in its high.
    qs = blocks[:, 16:144].reshape(-1, 4, 1, 32)
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=2).reshape(-1, 8 * GROUP)
    return codes, d * scales, -(dmin * mins)


def _q8_0(blocks: np.ndarray) -> Groups:
    d = _fp16(blocks, 0)
    return blocks[:, 2:34].view(np.int8), d, np.zeros_like(d)


# type -> (bytes of a block, weights of a block, code bits, decoder)
_DECODERS = {
    GGMLQuantizationType.Q4_0: (18, GROUP, 4, _q4_0),
    GGMLQuantizationType.Q4_1: (20, GROUP, 4, _q4_1),
    GGMLQuantizationType.Q4_K: (144, 8 * GROUP, 4, _q4_k),
    GGMLQuantizationType.Q8_0: (34, GROUP, 8, _q8_0),
}
GROUP_TYPES = frozenset(_DECODERS)


def read_groups(
    raw: np.ndarray, tensor_type: GGMLQuantizationType, shape: tuple[int, int]
) -> StoredGroups:
    """The groups of a 2-D tensor stored in a GGUF type of ``GROUP_TYPES``, from its raw
    bytes."""
    if tensor_type not in _DECODERS:
        raise ValueError(f"{tensor_type.name} is not a GGUF type with 32-weight groups")
    block_bytes, block_len, bits, decode = _DECODERS[tensor_type]
    out_features, in_features = shape
    if in_features % block_len or raw.size != out_features * in_features // block_len * block_bytes:
        raise ValueError(
            f"{raw.size} bytes of {tensor_type.name} do not hold a [{out_features}, "
            f"{in_features}] tensor"
        )
    codes, scale, base = decode(raw.reshape(-1, block_bytes))
    groups = in_features // GROUP
    return StoredGroups(
        bits,
        codes.reshape(out_features, in_features),
        scale.reshape(out_features, groups),
        base.reshape(out_features, groups),
    )
