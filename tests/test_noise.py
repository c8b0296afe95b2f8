"""Counter-based noise: bit-exact splitmix64 in int64 torch ops, keyed by (seed, position, purpose)."""

from __future__ import annotations

import pytest
import torch
from scipy import stats
from specdec.engine import noise
from specdec.engine.models import native

M64 = (1 << 64) - 1


def splitmix_reference(x: int) -> int:
    """The splitmix64 finaliser in exact unsigned Python arithmetic (independent of torch)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def stream_reference(seed: int, position: int, purpose: int, n: int) -> list[int]:
    gamma = 0x9E3779B97F4A7C15
    key = splitmix_reference((seed + gamma) & M64)
    key = splitmix_reference(key ^ (position & M64))
    key = splitmix_reference(key ^ purpose)
    return [splitmix_reference((key + (i + 1) * gamma) & M64) for i in range(n)]


@pytest.mark.parametrize(
    ("seed", "position"), [(0, 0), (1, 7), (2**63 + 5, 123456), (-3, 1), (2**64 - 1, 2**40)]
)
def test_stream_is_bit_exact_splitmix64(seed: int, position: int) -> None:
    keys = noise.stream_keys([seed], [position], noise.TOKEN, "cpu")
    got = [v % (1 << 64) for v in noise.stream_bits(keys, 40)[0].tolist()]
    assert got == stream_reference(seed % (1 << 64), position, noise.TOKEN, 40)


def test_seeds_fold_modulo_two_to_the_64() -> None:
    a = noise.stream_keys([-3, 2**80 + 1], [4, 4], noise.TOKEN, "cpu")
    b = noise.stream_keys([2**64 - 3, 1], [4, 4], noise.TOKEN, "cpu")
    assert torch.equal(a, b)


def test_keys_differ_by_seed_position_and_purpose() -> None:
    keys = noise.stream_keys([1, 1, 2, 1], [0, 1, 0, 0], noise.TOKEN, "cpu")
    other_purpose = noise.stream_keys([1], [0], noise.TOKEN + 1, "cpu")
    assert len(set(keys[:3].tolist() + other_purpose.tolist())) == 4
    assert keys[0] == keys[3]
    # Rows are independent of one another: a batch equals its rows computed alone.
    for i, (s, p) in enumerate([(1, 0), (1, 1), (2, 0), (1, 0)]):
        assert keys[i] == noise.stream_keys([s], [p], noise.TOKEN, "cpu")[0]


def test_uniforms_and_exponentials_are_well_formed() -> None:
    keys = noise.stream_keys(list(range(50)), list(range(50)), noise.TOKEN, "cpu")
    u = noise.uniforms(keys, 2000)
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert stats.kstest(u.flatten().numpy(), "uniform").pvalue > 1e-4
    e = noise.exponentials(keys, 2000)
    assert e.dtype == torch.float32 and bool((e > 0).all()) and bool(torch.isfinite(e).all())
    assert stats.kstest(e.flatten().double().numpy(), "expon").pvalue > 1e-4
    # The check has power: the same draws shifted a little are rejected.
    assert stats.kstest((e.flatten().double() * 1.05).numpy(), "expon").pvalue < 1e-4


def test_neighbouring_positions_are_uncorrelated() -> None:
    keys = noise.stream_keys([9] * 4001, list(range(4001)), noise.TOKEN, "cpu")
    u = noise.uniforms(keys, 64)  # [4001, 64]
    r = torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1]
    assert abs(float(r)) < 4 / (4000 * 64) ** 0.5


needs_native = pytest.mark.skipif(
    native.library() is None, reason="no native kernels (AVX-512 VNNI, a C compiler)"
)


def _torch_ops(fn, *args):
    with native.switched_off():
        return fn(*args)


@needs_native
def test_native_noise_is_the_torch_ops_noise() -> None:
    keys = noise.stream_keys(list(range(-8, 40)), list(range(48)), noise.TOKEN, "cpu")
    vocab = 40_000  # several of the kernel's blocks per row, the last one partial
    got, want = noise.exponentials(keys, vocab), _torch_ops(noise.exponentials, keys, vocab)
    differ = got != want
    # The kernel's own log may round to the neighbouring float where two float64 logs differ
    # in their last bits: rare, and never by more than one float.
    assert int(differ.sum()) <= got.numel() // 100_000
    apart = (got[differ].view(torch.int32).long() - want[differ].view(torch.int32).long()).abs()
    assert apart.numel() == 0 or int(apart.max()) <= 1


@needs_native
def test_native_race_is_the_torch_ops_race() -> None:
    torch.manual_seed(3)
    vocab = 40_000
    keys = noise.stream_keys(list(range(64)), [7] * 64, noise.TOKEN, "cpu")
    probs = torch.rand(64, vocab) ** 16  # peaked rows, as a language model's are
    probs[1] = 0.0  # ties everywhere: the first index wins, as torch's argmax picks
    probs[2] = 0.0
    probs[2, vocab - 1] = 1.0  # one-hot in the last, partial block
    probs[3, :20_000] = 0.0  # the mass only in later blocks
    probs[4, ::2] = 0.0
    got = noise.race(keys, probs)
    assert torch.equal(got, _torch_ops(noise.race, keys, probs))
    assert got[1] == 0 and got[2] == vocab - 1 and got[3] >= 20_000 and got[4] % 2 == 1


@pytest.mark.gpu
def test_cuda_stream_equals_cpu_stream() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    seeds, positions = [0, 5, 2**63 + 1, -7], [0, 3, 99, 2**33]
    cpu = noise.stream_keys(seeds, positions, noise.TOKEN, "cpu")
    gpu = noise.stream_keys(seeds, positions, noise.TOKEN, "cuda")
    assert torch.equal(noise.uniforms(cpu, 152064), noise.uniforms(gpu, 152064).cpu())
