"""GGUF's 4-bit block types read as int4 groups: codes, and a scale and base per 32 weights.

llama.cpp's 4-bit formats all store weights as ``scale * code + base`` with 4-bit codes in groups
of 32 along the input, which is the layout of this engine's int4 kernel (``int4_native``):

- Q4_0 (18-byte blocks of 32): fp16 ``d``; ``w = d * (q - 8)``.
- Q4_1 (20-byte blocks of 32): fp16 ``d`` and ``m``; ``w = d * q + m``.
- Q4_K (144-byte super-blocks of 256 = 8 groups of 32): fp16 ``d`` and ``dmin``, twelve bytes of
  6-bit group scales ``sc`` and mins ``mn``; ``w = d * sc * q - dmin * mn``.

So an int4 target loaded from such a file can keep the file's own codes instead of expanding
them to floats and rounding them onto a second 4-bit grid. The scale and base of each group
come out exactly in float32 (an fp16 value times a 6-bit integer fits float32's mantissa), and
``scale * code + base`` equals what ``gguf.quants.dequantize`` returns.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

GROUP = 32
INT4_TYPES = frozenset(
    {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K}
)

Int4Groups = tuple[np.ndarray, np.ndarray, np.ndarray]  # codes [out, in] uint8, scale, base


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of each block, as float32 [n_blocks, 1]."""
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., 16 * j] of packed codes -> codes [..., 32 * j]: the low nibbles of each run
    of 16 bytes give the first 16 codes, the high nibbles the next 16 (Q4_0 and Q4_1)."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _q4_0(blocks: np.ndarray) -> Int4Groups:
    d = _fp16(blocks, 0)
    return _nibbles(blocks[:, 2:18]), d, -8 * d


def _q4_1(blocks: np.ndarray) -> Int4Groups:
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


def _q4_k(blocks: np.ndarray) -> Int4Groups:
    d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)
    scales, mins = _q4_k_scales(blocks[:, 4:16])
    # Four runs of 32 bytes; run r holds group 2r in its low nibbles and group 2r + 1 in its high.
    qs = blocks[:, 16:144].reshape(-1, 4, 1, 32)
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=2).reshape(-1, 8 * GROUP)
    return codes, d * scales, -(dmin * mins)


_DECODERS = {
    GGMLQuantizationType.Q4_0: (18, GROUP, _q4_0),
    GGMLQuantizationType.Q4_1: (20, GROUP, _q4_1),
    GGMLQuantizationType.Q4_K: (144, 8 * GROUP, _q4_k),
}


def int4_groups(
    raw: np.ndarray, tensor_type: GGMLQuantizationType, shape: tuple[int, int]
) -> Int4Groups:
    """Codes [out, in] (uint8, 0..15), scale and base [out, in / 32] (float32) of a 2-D tensor
    stored in a GGUF 4-bit type, from its raw bytes; ``w = scale * code + base`` per group."""
    if tensor_type not in _DECODERS:
        raise ValueError(f"{tensor_type.name} is not a 4-bit GGUF type with 32-weight groups")
    block_bytes, block_len, decode = _DECODERS[tensor_type]
    out_features, in_features = shape
    if in_features % block_len or raw.size != out_features * in_features // block_len * block_bytes:
        raise ValueError(
            f"{raw.size} bytes of {tensor_type.name} do not hold a [{out_features}, "
            f"{in_features}] tensor"
        )
    codes, scale, base = decode(raw.reshape(-1, block_bytes))
    groups = in_features // GROUP
    return (
        codes.reshape(out_features, in_features),
        scale.reshape(out_features, groups),
        base.reshape(out_features, groups),
    )
