"""What the host CPU's vector units can do, read from /proc/cpuinfo (Linux; empty elsewhere)."""

from __future__ import annotations

import functools
from pathlib import Path

# Flags that decide which weight formats run fast: AMX tiles and AVX-512 BF16 give bf16 matrix
# products at about twice the fp32 rate for the same bytes; VNNI and AMX-INT8 do int8 dot products.
VECTOR_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The `flags` of the first processor listed in /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        return parse_cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def has_fast_bf16(flags: frozenset[str] | None = None) -> bool:
    """True where bf16 matrix products have hardware support (AMX or AVX-512 BF16)."""
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in BF16_FLAGS)


def has_fast_int4_draft(flags: frozenset[str] | None = None) -> bool:
    """True where an int4 draft runs fast: torch's CPU int4 kernel is vectorised for AVX-512
    (with AVX2 only it measured about twice as slow), and the draft's many-row path is fbgemm's
    (x86 builds of torch)."""
    import torch

    flags = cpu_flags() if flags is None else flags
    return "avx512f" in flags and "fbgemm" in torch.backends.quantized.supported_engines


def vector_flags_summary(flags: frozenset[str] | None = None) -> str:
    """The flags above that this CPU has, space separated (for result files)."""
    flags = cpu_flags() if flags is None else flags
    return " ".join(f for f in VECTOR_FLAGS if f in flags) or "none of " + ",".join(VECTOR_FLAGS)
