"""The engine's native CPU kernels (``group_matmul.c``, ``elementwise.c``, ``int8_rows.c``,
``paged_attention.c`` beside the attention backends, and ``noise_stream.c`` beside the sampler):
compiled into one shared library on first use with the system's C compiler, loaded with ctypes,
used where the CPU has AVX-512 VNNI. The element-wise ops serve quantized models
(``native_elementwise``): their rounding is not the torch layers', which an unquantized target
keeps so that its numbers stay the checkpoint's reference ones. The products of
weights in groups of 32 (``group_native``) serve int4 drafts, int4 and q8_0 targets, and the int8 target's per-row activation
map (``int8_rows.c``, ``quant.Int8RowScaled``) replaces several torch calls with one; all of
them compute each row on its own.

The library is built into ``$SPECDEC_HOME/kernels/`` under a name that digests the sources, the
flags and the compiler, so an edit or another compiler builds anew and a restart only loads it.
It is built with ``-fopenmp`` against ``libgomp.so.1``: torch's CPU wheel ships the same soname,
so both share one OpenMP runtime and thread pool instead of competing for the cores.
``SPECDEC_NATIVE_KERNELS=0`` turns it off (the torch kernels then run), for side by side
measurements. Without a compiler, or on a CPU without VNNI, the torch kernels run.
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

from specdec.engine.weights.cache import specdec_home

SWITCH_ENV = "SPECDEC_NATIVE_KERNELS"
_HERE = Path(__file__).parent
_SOURCES = (
    _HERE / "group_matmul.c",
    _HERE / "elementwise.c",
    _HERE / "int8_rows.c",
    _HERE.parent / "attention" / "paged_attention.c",
    _HERE.parent / "noise_stream.c",
)
_HEADERS = (_HERE / "simd16.h",)
# -ffp-contract=off: no multiply-add fused behind the sources' back, so int8_rows.c's arithmetic
# is the IEEE operations it spells out.
_FLAGS = (
    "-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
    "-ffp-contract=off", "-fopenmp", "-fPIC",
)  # fmt: skip
_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"})

_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    # (weight, outputs, inputs, x, rows, bias or NULL, bf16, y) -> 0, or -1 without memory
    "int4_linear": ([_P, _I, _I, _P, _I, _P, _I, _P], ctypes.c_int),
    "q8_0_linear": ([_P, _I, _I, _P, _I, _P, _I, _P], ctypes.c_int),
    # (x, weight, rows, n, eps, bf16, out)
    "rms_norm": ([_P, _P, _I, _I, _F, _I, _P], None),
    # (x, residual, weight, rows, n, eps, bf16): in place
    "add_rms_norm": ([_P, _P, _P, _I, _I, _F, _I], None),
    # (gate_up, rows, n, bf16, out)
    "silu_and_mul": ([_P, _I, _I, _I, _P], None),
    # (positions, tokens, q, q token stride, q heads, k, k token stride, k heads, head_dim,
    #  cos_sin, bf16): in place
    "rope": ([_P, _I, _P, _I64, _I, _P, _I64, _I, _I, _P, _I], None),
    # (x, rows, k, bf16, levels, codes, lo, step)
    "int8_row_codes": ([_P, _I, _I, _I, _F, _P, _P, _P], None),
    # (w_codes, rows, n, lo, step, row_sums, bias or NULL, bf16, y)
    "int8_row_output": ([_P, _I, _I, _P, _P, _P, _P, _I, _P], None),
    # (q, k_cache, v_cache, page_size, kv_heads, heads, dim, pages, row, page_start, key_start,
    #  keys, rows, scale, bf16, out) -> 0, or -1 without memory
    "paged_attention_rows": (
        [_P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _I, _F, _I, _P],
        ctypes.c_int,
    ),
    # (keys, rows, n, out): counter-based exponentials (``specdec.engine.noise``)
    "noise_exponentials": ([_P, _I, _I64, _P], None),
    # (keys, rows, n, probs, out) -> 0, or -1 without memory: the exponential race's winners
    "noise_race": ([_P, _I, _I64, _P, _P], ctypes.c_int),
}


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
            [compiler, *_FLAGS, f"-I{_HERE}", "-shared", *map(str, _SOURCES), "-o", str(built)],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(built, target)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they are switched off, unsupported, or cannot be
    built (with a warning)."""
    if os.environ.get(SWITCH_ENV, "1") == "0" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    if not _cpu_flags() >= _CPU_FLAGS:
        return None
    compiler = _compiler()
    if compiler is None:
        warnings.warn("no C compiler found: drafts run the slower torch kernels", stacklevel=2)
        return None
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(" ".join(_FLAGS).encode() + version.encode())
    for source in (*_SOURCES, *_HEADERS):
        digest.update(source.read_bytes())
    target = specdec_home() / "kernels" / f"specdec_kernels-{digest.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        warnings.warn(
            f"the native kernels could not be built ({detail.strip()[-300:]}): "
            "drafts run the slower torch kernels",
            stacklevel=2,
        )
        return None
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib


@contextlib.contextmanager
def switched_off() -> Iterator[None]:
    """Models built inside this block use the torch kernels (for side by side measurements in
    one process: the kernels are chosen when a model is built)."""
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
