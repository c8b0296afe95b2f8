"""--kv-cache-dtype int8 | fp8 | fp8_e5m2: one-byte KV pages (int8 rows with a scale each, or
float8 elements), read back in the model dtype; greedy speculative output equal to plain output
on the same pool format, about twice the tokens per GiB of bf16, nothing leaked."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
from specdec.api.engine_args import add_engine_arguments, config_from_args
from specdec.engine.attention.base import build_attention_metadata, write_kv
from specdec.engine.attention.kv_format import decode, encode, row_width
from specdec.engine.attention.torch_backend import TorchAttentionBackend
from specdec.engine.config import EngineConfig
from specdec.engine.errors import ConfigError
from specdec.engine.kv_cache import ModelKV, bytes_per_block, copy_kv_slots
from specdec.engine.sampling_params import SamplingParams
from test_engine_greedy import prompts, run_staggered
from tiny_models import make_engine

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FORMATS = {"int8": torch.int8, **FP8}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def draft(target):
    """The target with a perturbed head: drafts are often rejected, so verifies both accept and
    reject, and the rejected rows' KV is written and then overwritten."""
    d = copy.deepcopy(target)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        d.lm_head.weight.add_(torch.randn(d.lm_head.weight.shape, generator=g) * 0.02)
    return d


@pytest.mark.parametrize("name", sorted(FP8))
def test_pages_hold_each_element_cast_on_its_own(name):
    dtype = FP8[name]
    k_cache = torch.zeros(4, 2, 2, 8, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(3, 2, 8) * 100
    v = torch.randn(3, 2, 8)
    slots = torch.tensor([6, 1, 3])
    write_kv(k, v, k_cache, v_cache, slots)
    flat_k = k_cache.view(-1, 2, 8).float()
    assert torch.equal(flat_k[slots], k.to(dtype).float())
    assert torch.equal(v_cache.view(-1, 2, 8).float()[slots], v.to(dtype).float())
    assert not flat_k[[0, 2, 4, 5, 7]].any()  # nothing else written


def test_int8_rows_keep_their_own_scale_and_round_to_a_254th_of_their_largest():
    rows = torch.randn(5, 2, 16) * torch.tensor([1.0, 300.0])[:, None]  # heads of unlike size
    rows[0, 0, 3] = 0.0
    stored = encode(rows, torch.int8)
    assert stored.shape == (5, 2, 16 + 4) and stored.dtype == torch.int8
    back = decode(stored, torch.float32)
    bound = rows.abs().amax(-1, keepdim=True) / 254 * 1.0001
    assert ((back - rows).abs() <= bound).all()
    # A row is encoded from its own values only: alone or among others, the same bytes.
    assert torch.equal(encode(rows[2:3], torch.int8), stored[2:3])
    assert not decode(encode(torch.zeros(1, 1, 16), torch.int8), torch.float32).any()


def test_copying_slots_of_an_fp8_pool_moves_the_same_bits():
    pool = torch.randn(4, 2, 2, 8).to(torch.float8_e4m3fn)
    kv = ModelKV([(pool.clone(), pool.clone())])
    copy_kv_slots(kv, [5, 6], [0, 1])
    flat = kv.layers[0][0].view(torch.uint8).view(-1, 2, 8)
    src = pool.view(torch.uint8).view(-1, 2, 8)
    assert torch.equal(flat[[0, 1]], src[[5, 6]])
    assert torch.equal(flat[2:], src[2:])


def test_one_byte_pools_hold_about_twice_the_blocks_of_bf16_in_the_same_memory(target):
    bf16 = make_engine(target, kv_cache_memory=0.01, num_kv_blocks=None, dtype="bfloat16")
    fp8 = make_engine(
        target, kv_cache_memory=0.01, num_kv_blocks=None, dtype="bfloat16", kv_cache_dtype="fp8"
    )
    arch = [bf16.target.arch]
    assert bytes_per_block(arch, 4, torch.float8_e4m3fn) * 2 == bytes_per_block(
        arch, 4, torch.bfloat16
    )
    assert abs(fp8.allocator.num_free_blocks - 2 * bf16.allocator.num_free_blocks) <= 1  # floors
    assert fp8.target_runner.kv.layers[0][0].dtype == torch.float8_e4m3fn
    int8 = make_engine(
        target, kv_cache_memory=0.01, num_kv_blocks=None, dtype="bfloat16", kv_cache_dtype="int8"
    )
    head_dim = bf16.target.arch.head_dim
    layer = int8.target_runner.kv.layers[0][0]
    assert layer.dtype == torch.int8 and layer.shape[-1] == head_dim + 4  # values, then scale
    expected = bf16.allocator.num_free_blocks * 2 * head_dim / (head_dim + 4)
    assert abs(int8.allocator.num_free_blocks - expected) <= 1


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("trees", [0, 8])
def test_greedy_speculative_output_equals_plain_output_on_an_fp8_pool(target, draft, name, trees):
    options = dict(kv_cache_dtype=name, max_num_batched_tokens=40)
    plain = make_engine(target, speculative_method="none", **options)
    spec = make_engine(
        target, draft, speculative_policy="fixed", speculative_mode="on",
        num_speculative_tokens=4, spec_tree_max_nodes=trees, **options,
    )  # fmt: skip
    free0 = spec.allocator.num_free_blocks
    ps = prompts()
    want = run_staggered(plain, ps)
    assert run_staggered(spec, ps) == want
    stats = spec.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepts and rejects both ran
    assert spec.allocator.num_free_blocks == free0


@pytest.mark.parametrize("name, tolerance", [("int8", 0.01), ("fp8_e4m3", 0.05), ("fp8_e5m2", 0.1)])
def test_attention_over_fp8_pages_is_close_to_full_precision(name, tolerance):
    """Not exact against a full-precision pool (that is the format's price; its effect on a real
    pair's output is measured, docs/formats.md), but within the format's rounding: a prefill
    and a decode attend as over fp32 pages up to a few percent."""
    heads, kv_heads, dim, page = 4, 2, 16, 4
    backend = TorchAttentionBackend(heads, kv_heads, dim, torch.device("cpu"))
    outs = {}
    for pool_dtype in (torch.float32, FORMATS[name]):
        k_cache = torch.zeros(8, page, kv_heads, row_width(dim, pool_dtype), dtype=pool_dtype)
        v_cache = torch.zeros_like(k_cache)
        out = []
        for q_len, kv_len in ((12, 12), (1, 13)):  # a prompt, then one decode over it
            g = torch.Generator().manual_seed(q_len)
            q, k, v = (torch.randn(q_len, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
            meta = build_attention_metadata([q_len], [kv_len], [[3, 0, 5, 6]], page, q.device)
            backend.plan(meta)
            out.append(backend.forward(q, k, v, k_cache, v_cache, meta))
        outs[pool_dtype] = torch.cat(out)
    full, short = outs[torch.float32], outs[FORMATS[name]]
    assert (short - full).norm() / full.norm() < tolerance


def test_a_bad_kv_cache_dtype_is_refused(target):
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        make_engine(target, kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="int8 is a CPU format"):
        EngineConfig(kv_cache_dtype="int8", device="cuda")
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"])
    assert config_from_args(args).kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(SystemExit):  # argparse: exit 2 with the choices listed
        parser.parse_args(["--kv-cache-dtype", "q8_0"])
