"""The native int4 draft kernel (``int4_matmul.c``): built once per machine with the system's C
compiler, loaded with ctypes, used where the CPU has AVX-512 VNNI.

torch's own CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) streams a one-row product's
weights at about half the memory bandwidth an int8 product reaches on the same machine; the
native kernel multiplies 4-bit codes by 8-bit activation codes with VNNI dot products and
reaches about that bandwidth (docs/formats.md). Both read the same codes, scales and offsets.

The shared library is compiled on first use into ``$SPECDEC_HOME/kernels/`` under a name that
digests the source, the flags and the compiler, so an edit or another compiler builds anew and a
restart only loads it. It is built with ``-fopenmp`` against ``libgomp.so.1``: torch's CPU wheel
ships the same soname, so both share one OpenMP runtime and thread pool instead of competing
for the cores. ``SPECDEC_NATIVE_INT4=0`` turns it off (torch's kernel then runs), for side by side
measurements. Without a compiler, or on a CPU without VNNI, torch's kernel runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from specdec.engine.weights.cache import specdec_home

SWITCH_ENV = "SPECDEC_NATIVE_INT4"
GROUP = 32  # inputs per scale and base; int4_matmul.c's GROUP
BLOCK = 16  # output channels per block; one zmm of int32 sums
_SOURCE = Path(__file__).with_name("int4_matmul.c")
_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-fopenmp", "-fPIC")
_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})


def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed into place, so concurrent first uses (test workers,
    # replicas) never load a half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run(
            [compiler, *_FLAGS, "-shared", str(_SOURCE), "-o", str(built)],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(built, target)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None where it is switched off, unsupported, or cannot be built."""
    if os.environ.get(SWITCH_ENV, "1") == "0" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    if not _cpu_flags() >= _CPU_FLAGS:
        return None
    compiler = _compiler()
    if compiler is None:
        warnings.warn(
            "no C compiler found: the int4 draft runs torch's slower kernel", stacklevel=2
        )
        return None
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + version.encode())
    target = specdec_home() / "kernels" / f"int4_matmul-{digest.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        warnings.warn(
            f"the native int4 kernel could not be built ({detail.strip()[-300:]}): "
            "the int4 draft runs torch's slower kernel",
            stacklevel=2,
        )
        return None
    lib.int4_linear.restype = ctypes.c_int
    lib.int4_linear.argtypes = [
        ctypes.c_void_p,  # packed weight
        ctypes.c_int,  # output features
        ctypes.c_int,  # input features
        ctypes.c_void_p,  # x
        ctypes.c_int,  # rows
        ctypes.c_void_p,  # bias or NULL
        ctypes.c_int,  # 1: x, bias and y are bfloat16; 0: float32
        ctypes.c_void_p,  # y
    ]
    return lib


@contextlib.contextmanager
def switched_off() -> Iterator[None]:
    """int4 weights quantized inside this block take torch's kernel (for side by side
    measurements in one process; the kernel is chosen when a weight is quantized)."""
    previous = os.environ.get(SWITCH_ENV)
    os.environ[SWITCH_ENV] = "0"
    library.cache_clear()
    try:
        yield
    finally:
        if previous is None:
            del os.environ[SWITCH_ENV]
        else:
            os.environ[SWITCH_ENV] = previous
        library.cache_clear()


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
        laid = values.to(torch.bfloat16).view(blocks, BLOCK, groups).permute(0, 2, 1)
        return laid.contiguous().view(torch.uint8)

    return torch.cat((nibbles, per_group(scale), per_group(base)), dim=-1).contiguous()


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
