"""How K/V rows are stored in the pool's pages, and read back.

- The model dtype, or float8 (``--kv-cache-dtype fp8``, ``fp8_e5m2``): each element cast on its
  own, with no scale.
- int8 (``--kv-cache-dtype int8``): each (token, head) row of ``head_dim`` values is divided by
  its own largest magnitude / 127, rounded to int8, and followed in the page by that scale as
  float32 (4 bytes), so a row is ``head_dim + 4`` int8 wide. One scale per row keeps a row's
  large and small elements both to 1/254 of its largest, where float8 keeps 3 (or 2) mantissa
  bits of every element: keys with large components, whose dot products are large, lose far less.

Either way a row is encoded from its own values only, so what a token stores does not depend on
what else the step computed (greedy speculative output stays equal to plain output), and copying
a page row moves a whole encoded row, scale included.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # an int8 row's float32 scale, stored after its values


def is_scaled(dtype: torch.dtype) -> bool:
    """Whether rows of a pool of this element type carry their own scale."""
    return dtype == torch.int8


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements one (token, head) row takes in the pool."""
    return head_dim + SCALE_BYTES if is_scaled(dtype) else head_dim


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor viewed as uint8 (torch has no CPU index_copy_ for float8); others as they
    are. Copies between such views move the same bits."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def encode(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., head_dim]`` rows as the pool stores them (a byte view for float8)."""
    if not is_scaled(dtype):
        return as_bytes(rows.to(dtype))
    x = rows.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    values = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
    return torch.cat([values, scale.contiguous().view(torch.int8)], dim=-1)


def decode(pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows ``[..., row_width]`` back as ``[..., head_dim]`` values in ``dtype``."""
    if not is_scaled(pages.dtype):
        return pages.to(dtype)
    scale = pages[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (pages[..., :-SCALE_BYTES].float() * scale).to(dtype)
