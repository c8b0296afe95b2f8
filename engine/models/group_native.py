"""Products of weights stored in groups of 32 inputs, through the native kernels
(``group_matmul.c``, loaded by ``native``): the weight layouts they read, and the call.

- int4: 4-bit codes with an fp16 scale and base per group, ``w = scale * code + base`` (the
  layout of GGUF's Q4_0, Q4_1 and Q4_K, and of this engine's own int4 rounding). Drafts run it
  for a few rows, an int4 target for all.
- q8_0: signed 8-bit codes with an fp16 scale per group, ``w = scale * code`` (GGUF's Q8_0), run
  by a q8_0 target for all rows.

Both multiply int8 activation codes with one scale per group of 32 activations, so a row's
rounding follows its own local range rather than its whole width. torch's own CPU int4 kernel
(``_weight_int4pack_mm_for_cpu``) streams a one-row product's weights at about two thirds of the
memory bandwidth the native kernel reaches on the same machine (docs/formats.md).
"""

from __future__ import annotations

import ctypes

import torch

GROUP = 32  # inputs per scale; group_matmul.c's GROUP
BLOCK = 16  # output channels per block; one zmm of int32 sums
INT4_BYTES = 320  # a (block, group) of int4: 256 bytes of codes, 16 fp16 scales, 16 fp16 bases
Q8_0_BYTES = 544  # a (block, group) of q8_0: 512 bytes of codes, 16 fp16 scales


def _padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``rows``."""
    missing = rows - tensor.shape[0]
    return torch.cat((tensor, tensor.new_zeros(missing, *tensor.shape[1:]))) if missing else tensor


def _vectors(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [out, in] (out a multiple of BLOCK) -> [block, group, step, 64]: byte
    4 * channel + input of step t holds that channel's code for input 4t + input."""
    out_features, in_features = codes.shape
    blocks, groups = out_features // BLOCK, in_features // GROUP
    return (
        codes.view(blocks, BLOCK, groups, GROUP // 4, 4)
        .permute(0, 2, 3, 1, 4)
        .reshape(blocks, groups, GROUP // 4, 4 * BLOCK)
    )


def _codes(vectors: torch.Tensor) -> torch.Tensor:
    """``_vectors``' inverse: [block, group, step, 64] -> codes [block * BLOCK, in]."""
    blocks, groups = vectors.shape[:2]
    codes = vectors.reshape(blocks, groups, GROUP // 4, BLOCK, 4).permute(0, 3, 1, 2, 4)
    return codes.reshape(blocks * BLOCK, groups * GROUP)


def _per_group(values: torch.Tensor) -> torch.Tensor:
    """fp16 bytes [block, group, 2 * BLOCK] of a per-(channel, group) value [out, groups]."""
    blocks, groups = values.shape[0] // BLOCK, values.shape[1]
    laid = values.to(torch.float16).view(blocks, BLOCK, groups).permute(0, 2, 1)
    return laid.contiguous().view(torch.uint8)


def _from_per_group(packed: torch.Tensor, at: int) -> torch.Tensor:
    """``_per_group``'s inverse for the field at byte ``at``: float32 [out, groups, 1]."""
    blocks, groups, _ = packed.shape
    values = packed[..., at : at + 2 * BLOCK].contiguous().view(torch.float16).float()
    return values.permute(0, 2, 1).reshape(blocks * BLOCK, groups, 1)


def pack(codes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of int4 weights ``w = scale * code + base``: codes [out, in] in 0..15,
    scale and base [out, in / 32]. Returns uint8 [ceil(out / 16), in / 32, 320]; padding channels
    are zero and never stored."""
    rows = -(-codes.shape[0] // BLOCK) * BLOCK
    codes, scale, base = (_padded(t, rows) for t in (codes, scale, base))
    vectors = _vectors(codes.to(torch.uint8))
    blocks, groups = vectors.shape[:2]
    nibbles = (vectors[..., :32] | (vectors[..., 32:] << 4)).reshape(blocks, groups, 256)
    return torch.cat((nibbles, _per_group(scale), _per_group(base)), dim=-1).contiguous()


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The float32 weight [out_features, in] that int4 ``packed`` holds (``pack``'s inverse)."""
    blocks, groups, _ = packed.shape
    nibbles = packed[..., :256].reshape(blocks, groups, GROUP // 4, 32)
    codes = _codes(torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1)).float()
    weight = codes.view(blocks * BLOCK, groups, GROUP) * _from_per_group(packed, 256)
    weight = weight + _from_per_group(packed, 288)
    return weight.reshape(blocks * BLOCK, groups * GROUP)[:out_features]


def pack_q8_0(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of q8_0 weights ``w = scale * code``: codes [out, in] in -128..127,
    scale [out, in / 32]. Returns uint8 [ceil(out / 16), in / 32, 544]."""
    rows = -(-codes.shape[0] // BLOCK) * BLOCK
    codes, scale = _padded(codes, rows), _padded(scale, rows)
    stored = (codes.to(torch.int16) + 128).to(torch.uint8)  # unsigned for VPDPBUSD
    vectors = _vectors(stored)
    blocks, groups = vectors.shape[:2]
    return torch.cat((vectors.reshape(blocks, groups, 512), _per_group(scale)), dim=-1).contiguous()


def unpack_q8_0(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The float32 weight [out_features, in] that q8_0 ``packed`` holds (``pack_q8_0``'s
    inverse)."""
    blocks, groups, _ = packed.shape
    codes = _codes(packed[..., :512].reshape(blocks, groups, GROUP // 4, 64)).float() - 128
    weight = codes.view(blocks * BLOCK, groups, GROUP) * _from_per_group(packed, 512)
    return weight.reshape(blocks * BLOCK, groups * GROUP)[:out_features]


def linear(
    lib: ctypes.CDLL,
    packed: torch.Tensor,
    out_features: int,
    x: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x @ W^T + bias`` for 2-D ``x`` in float32 or bfloat16 (others run in float32), W packed
    by ``pack`` or ``pack_q8_0`` (told apart by the bytes of a group)."""
    kernels = {INT4_BYTES: lib.int4_linear, Q8_0_BYTES: lib.q8_0_linear}
    kernel = kernels[packed.shape[2]]
    io_dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    x = x.to(io_dtype).contiguous()
    rows, in_features = x.shape
    if in_features != packed.shape[1] * GROUP or out_features > packed.shape[0] * BLOCK:
        raise ValueError(
            f"the weight takes {packed.shape[1] * GROUP} input features and gives at most "
            f"{packed.shape[0] * BLOCK} outputs; got x of {in_features} and {out_features} outputs"
        )
    y = torch.empty(rows, out_features, dtype=io_dtype)
    if rows == 0:
        return y
    if bias is not None:
        bias = bias.to(io_dtype).contiguous()
    status = kernel(
        packed.data_ptr(),
        out_features,
        in_features,
        x.data_ptr(),
        rows,
        None if bias is None else bias.data_ptr(),
        int(io_dtype == torch.bfloat16),
        y.data_ptr(),
    )
    if status != 0:
        raise MemoryError("the native kernel could not allocate its activation scratch")
    return y
