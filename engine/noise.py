"""Counter-based random numbers for seeded requests: a pure function of (seed, position, purpose).

A seeded request's randomness must not depend on how many numbers were drawn before (that count
changes with k, the batch and the arm), so nothing here keeps state. Element ``i`` of the stream
keyed by ``(seed, position, purpose)`` is

    key = mix(mix(mix(seed + GAMMA) ^ position) ^ purpose)
    bits_i = mix(key + (i + 1) * GAMMA)

where ``mix`` is the splitmix64 finaliser (a bijection of 64-bit words with full avalanche) and
``GAMMA`` the golden-ratio increment; ``bits_i`` is the i-th output of splitmix64 started at
``key``. Because ``mix`` is a bijection, two positions of one seed never share a key.

Everything is computed with int64 torch ops, vectorised over rows, on any device: wrapping
multiplication and addition agree bit for bit with unsigned 64-bit arithmetic in two's complement,
and right shifts of int64 are arithmetic, so the bits they bring in from the sign are masked off.
The uniforms are therefore bit-identical on CPU and CUDA; the exponentials computed from them
agree to the rounding of ``log``. On a CPU with the native kernels (`specdec.engine.models.native`)
``noise_stream.c`` computes the same exponentials in one pass (from the same uniforms, bit for
bit, to the rounding of its own ``log``) and the race without writing them: over a
vocabulary of 150k the torch ops' int64 temporaries made sampling about 2 ms a row.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from specdec.engine.models import native

# Purposes: which use of the stream a draw serves. The token at a position is picked by one
# exponential race shared by the draft and the target (`specdec.engine.sampling.sample`).
TOKEN = 1

_U64 = 1 << 64


def _signed(c: int) -> int:
    """A 64-bit word as the int64 with the same bits."""
    c %= _U64
    return c - _U64 if c >= 1 << 63 else c


_GAMMA = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)
# Uniforms take the top 53 bits, so (bits + 0.5) / 2**53 is exact in float64 and lies in (0, 1).
_MANTISSA = 53
# Row chunks keep the [rows, vocab] int64 temporaries of one call under this many elements.
CHUNK_ELEMENTS = 1 << 22


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 words."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser on int64 words (see the module docstring)."""
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


def stream_keys(
    seeds: Sequence[int], positions: Sequence[int], purpose: int, device: torch.device | str
) -> torch.Tensor:
    """``[rows]`` int64 keys of the streams (seed, position, purpose); any Python int seed is
    reduced modulo 2**64."""
    s = torch.tensor([_signed(v) for v in seeds], dtype=torch.int64, device=device)
    pos = torch.tensor([_signed(v) for v in positions], dtype=torch.int64, device=device)
    return mix(mix(mix(s + _GAMMA) ^ pos) ^ _signed(purpose))


def random_keys(rows: int, device: torch.device | str) -> torch.Tensor:
    """``[rows]`` int64 keys of streams nobody can name, drawn from the device's default generator
    (for rows without a seed: the same noise path at the same speed)."""
    return mix(torch.randint(0, 1 << 62, (rows,), dtype=torch.int64, device=device))


def stream_bits(keys: torch.Tensor, n: int) -> torch.Tensor:
    """``[rows, n]`` int64: the first ``n`` words of each key's stream."""
    counter = (torch.arange(1, n + 1, dtype=torch.int64, device=keys.device) * _GAMMA)[None, :]
    return mix(keys[:, None] + counter)


def _native_for(keys: torch.Tensor) -> ctypes.CDLL | None:
    return native.library() if keys.device.type == "cpu" else None


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def uniforms(keys: torch.Tensor, n: int) -> torch.Tensor:
    """``[rows, n]`` float64 uniforms in the open interval (0, 1)."""
    top = _shr(stream_bits(keys, n), 64 - _MANTISSA).to(torch.float64)
    return (top + 0.5) * 2.0**-_MANTISSA


def exponentials(keys: torch.Tensor, n: int) -> torch.Tensor:
    """``[rows, n]`` float32 Exp(1) draws, all finite and > 0."""
    lib = _native_for(keys)
    if lib is not None:
        keys, out = keys.contiguous(), torch.empty(keys.shape[0], n, dtype=torch.float32)
        lib.noise_exponentials(_ptr(keys), keys.shape[0], n, _ptr(out))
        return out
    return (
        (-torch.log(uniforms(keys, n)))
        .to(torch.float32)
        .clamp_min_(torch.finfo(torch.float32).tiny)
    )


def race(keys: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``[rows]`` int64: ``argmax_i probs[r, i] / E[r, i]`` with ``E = exponentials(keys, vocab)``
    (`specdec.engine.sampling.sample`), the first index among equal maxima. The native kernel
    never writes ``E``; the torch ops hold it in chunks of `chunk_rows` rows."""
    rows, vocab = probs.shape
    lib = _native_for(keys)
    if lib is not None:
        keys, probs = keys.contiguous(), probs.to(torch.float32).contiguous()
        out = torch.empty(rows, dtype=torch.int64)
        if lib.noise_race(_ptr(keys), rows, vocab, _ptr(probs), _ptr(out)) != 0:
            raise MemoryError("the exponential race could not allocate its per-block maxima")
        return out
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    step = chunk_rows(vocab)
    for c in range(0, rows, step):
        draws = exponentials(keys[c : c + step], vocab)
        out[c : c + step] = (probs[c : c + step].to(torch.float32) / draws).argmax(dim=-1)
    return out


def chunk_rows(vocab: int) -> int:
    """Rows per call of `exponentials` over a vocabulary that stay under `CHUNK_ELEMENTS`."""
    return max(1, CHUNK_ELEMENTS // max(1, vocab))
