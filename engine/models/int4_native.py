"""int4 products through the native kernel (``int4_matmul.c``, loaded by ``native``): the
weight layout it reads, and the call. A draft runs it for a few rows, an int4 target for all.

torch's own CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) streams a one-row product's
weights at about two thirds of the memory bandwidth the native kernel reaches on the same
machine (docs/formats.md); both read the same 4-bit codes, scales and offsets.
"""

from __future__ import annotations

import ctypes

import torch

GROUP = 32  # inputs per scale and base; int4_matmul.c's GROUP
BLOCK = 16  # output channels per block; one zmm of int32 sums


def pack(codes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of int4 weights ``w = scale * code + base``: codes [out, in] in 0..15,
    scale and base [out, in / 32]. Returns uint8 [ceil(out / 16), in / 32, 320]; padding channels
    are zero and never stored."""
    out_features, in_features = codes.shape
    padded = -out_features % BLOCK
    if padded:
        codes = torch.cat((codes, codes.new_zeros(padded, in_features)))
        scale = torch.cat((scale, scale.new_zeros(padded, scale.shape[1])))
        base = torch.cat((base, base.new_zeros(padded, base.shape[1])))
    blocks, groups = codes.shape[0] // BLOCK, in_features // GROUP
    # [block, channel, group, step, input] -> [block, group, step, channel * 4 + input]
    vector = (
        codes.to(torch.uint8)
        .view(blocks, BLOCK, groups, GROUP // 4, 4)
        .permute(0, 2, 3, 1, 4)
        .reshape(blocks, groups, GROUP // 4, 4 * BLOCK)
    )
    nibbles = (vector[..., :32] | (vector[..., 32:] << 4)).reshape(blocks, groups, 256)

    def per_group(values: torch.Tensor) -> torch.Tensor:
        laid = values.to(torch.float16).view(blocks, BLOCK, groups).permute(0, 2, 1)
        return laid.contiguous().view(torch.uint8)

    return torch.cat((nibbles, per_group(scale), per_group(base)), dim=-1).contiguous()


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The float32 weight [out_features, in] that ``packed`` holds (``pack``'s inverse)."""
    blocks, groups, _ = packed.shape
    nibbles = packed[..., :256].reshape(blocks, groups, GROUP // 4, 32)
    vector = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1)  # [block, group, step, 64]
    codes = vector.view(blocks, groups, GROUP // 4, BLOCK, 4).permute(0, 3, 1, 2, 4)
    codes = codes.reshape(blocks * BLOCK, groups, GROUP).float()

    def per_group(at: int) -> torch.Tensor:
        values = packed[..., at : at + 32].contiguous().view(torch.float16).float()
        return values.permute(0, 2, 1).reshape(blocks * BLOCK, groups, 1)

    weight = codes * per_group(256) + per_group(288)
    return weight.reshape(blocks * BLOCK, groups * GROUP)[:out_features]


def linear(
    lib: ctypes.CDLL,
    packed: torch.Tensor,
    out_features: int,
    x: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x @ W^T + bias`` for 2-D ``x`` in float32 or bfloat16 (others run in float32)."""
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
    status = lib.int4_linear(
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
        raise MemoryError("the int4 kernel could not allocate its activation scratch")
    return y
