"""Logit parity with transformers on tiny random Qwen2/Llama configs: whole, chunked, decode."""

from __future__ import annotations

import pytest
import torch
from specdec.engine.attention import build_attention_metadata, create_backend
from specdec.engine.kv_cache import allocate_model_kv
from tiny_models import loaded_from_hf, tiny_hf_model

TOL = 1e-4
VARIANTS = [
    ("qwen2", {}),
    ("qwen2", {"tie": True}),
    ("llama", {}),
    ("llama", {"tie": True, "kv_heads": 4}),
    (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
]


class PagedModel:
    """Our model plus a KV pool and a block table, run chunk by chunk like the engine does."""

    def __init__(self, hf, page_size: int = 4, num_blocks: int = 64, quantization: str = "none"):
        self.lm = loaded_from_hf(hf, quantization=quantization)
        arch = self.lm.arch
        self.kv = allocate_model_kv(arch, num_blocks, page_size, torch.float32, torch.device("cpu"))
        self.backend = create_backend(
            "torch",
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.head_dim,
            torch.device("cpu"),
        )
        self.page_size = page_size
        # A deliberately scrambled block table: pages need not be contiguous or ordered.
        self.table = list(range(num_blocks - 1, -1, -3))
        self.computed = 0

    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Append tokens; returns logits for every one of them."""
        q, kv = len(tokens), self.computed + len(tokens)
        meta = build_attention_metadata(
            [q], [kv], [self.table], self.page_size, torch.device("cpu")
        )
        logits = self.lm.model(
            torch.tensor(tokens),
            torch.arange(self.computed, kv),
            self.kv.layers,
            self.backend,
            meta,
            torch.arange(q),
        )
        self.computed = kv
        return logits


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("family,kw", VARIANTS)
def test_whole_prompt_logits_match_transformers(family, kw):
    hf = tiny_hf_model(family, **kw)
    tokens = torch.randint(0, 128, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = PagedModel(hf).feed(tokens)
    assert (ours - hf_logits(hf, tokens)).abs().max().item() <= TOL


@pytest.mark.parametrize("family,kw", VARIANTS)
def test_chunked_prefill_and_decode_match_transformers(family, kw):
    hf = tiny_hf_model(family, **kw)
    tokens = torch.randint(0, 128, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = hf_logits(hf, tokens)
    model = PagedModel(hf)
    got = []
    # Chunks of uneven sizes crossing page boundaries, then one-token decode steps.
    cuts = [0, 5, 6, 19, 33, 34, 50] + list(range(51, 71))
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        got.append(model.feed(tokens[a:b]))
    assert (torch.cat(got) - ref).abs().max().item() <= TOL


def test_ragged_batch_rows_equal_single_sequence_runs():
    """Three sequences in one forward (prefill chunk, decode, verify-like run) = each alone."""
    hf = tiny_hf_model("qwen2")
    lm = loaded_from_hf(hf)
    arch = lm.arch
    kv = allocate_model_kv(arch, 64, 4, torch.float32, torch.device("cpu"))
    be = create_backend(
        "torch",
        arch.num_attention_heads,
        arch.num_key_value_heads,
        arch.head_dim,
        torch.device("cpu"),
    )
    seqs = [list(range(3, 20)), list(range(40, 49)), list(range(60, 66))]
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    done = [10, 8, 1]  # already-computed prefix of each
    for s, t, d in zip(seqs, tables, done, strict=True):
        meta = build_attention_metadata([d], [d], [t], 4, torch.device("cpu"))
        lm.model(torch.tensor(s[:d]), torch.arange(d), kv.layers, be, meta, torch.arange(0))
    q_lens = [len(s) - d for s, d in zip(seqs, done, strict=True)]
    meta = build_attention_metadata(q_lens, [len(s) for s in seqs], tables, 4, torch.device("cpu"))
    ids = torch.tensor([t for s, d in zip(seqs, done, strict=True) for t in s[d:]])
    pos = torch.tensor([p for s, d in zip(seqs, done, strict=True) for p in range(d, len(s))])
    batch = lm.model(ids, pos, kv.layers, be, meta, torch.arange(len(ids)))
    ref = torch.cat([hf_logits(hf, s)[d:] for s, d in zip(seqs, done, strict=True)])
    assert (batch - ref).abs().max().item() <= TOL


def test_bad_block_table_is_rejected():
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata([3], [9], [[0, 1]], 4, torch.device("cpu"))


class InPlaceOps:
    """A torch stand-in for `specdec.engine.models.fused_ops.FusedOps` with the kernels' in-place
    contract (fused add-norm overwrites both inputs, rope rotates q and k where they are), so
    the decoder's use of the fused path is checked on the CPU: a layer that read a tensor after
    handing it to a kernel would see it overwritten here as on the GPU."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    @staticmethod
    def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rms_norm(self, x, weight, eps):
        self._count("rms_norm")
        return self._norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        self._count("add_rms_norm")
        residual.add_(x)
        x.copy_(self._norm(residual, weight, eps))
        return x, residual

    def silu_and_mul(self, gate_up):
        self._count("silu_and_mul")
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def rope_(self, positions, q, k, cos_sin):
        self._count("rope_")
        cos, sin = cos_sin[positions].chunk(2, dim=-1)
        for x in (q, k):
            x1, x2 = x[..., : x.shape[-1] // 2].clone(), x[..., x.shape[-1] // 2 :].clone()
            c, s = cos[:, None], sin[:, None]
            x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


@pytest.mark.parametrize("family,kw", VARIANTS[:3])
def test_fused_ops_path_matches_the_torch_layers(family, kw):
    hf = tiny_hf_model(family, seed=7, layers=3, **kw)
    plain, fused = PagedModel(hf), PagedModel(hf)
    ops = InPlaceOps()
    fused.lm.model.use_fused_ops(ops)
    prompt = [3, 17, 5, 9, 22, 41, 8]
    for chunk in (prompt[:4], prompt[4:], [11], [12, 13]):  # prefill chunks, decode, verify
        torch.testing.assert_close(fused.feed(chunk), plain.feed(chunk), rtol=1e-4, atol=1e-4)
    # Per forward: 2 norms per layer (1 plain + 1 fused at layer 0), one fused final norm.
    assert ops.calls["rms_norm"] == 4 and ops.calls["add_rms_norm"] == 4 * (2 * 3 - 1 + 1)
    assert ops.calls["silu_and_mul"] == ops.calls["rope_"] == 4 * 3
    fused.lm.model.use_fused_ops(None)
    torch.testing.assert_close(fused.feed([30]), plain.feed([30]), rtol=1e-4, atol=1e-4)


class StubGraphs:
    """Stands in for `specdec.engine.cuda_graphs.GraphedForward` (CUDA only): one captured bucket of
    four one-token sequences, returning a fixed buffer it overwrites on every replay."""

    def __init__(self, vocab: int) -> None:
        self.buffer = torch.zeros(4, vocab)
        self.calls: list[list[list[int]]] = []

    def accepts(self, entries) -> bool:
        from specdec.engine.cuda_graphs import graph_bucket

        return graph_bucket(entries, [(4, 1)], max_tokens_per_seq=64) is not None

    def run(self, token_ids, start_positions, block_tables) -> torch.Tensor:
        self.calls.append([list(t) for t in token_ids])
        self.buffer.fill_(float(len(self.calls)))
        return self.buffer[: len(token_ids)]


def test_runner_replays_graphs_only_for_batches_that_fit_and_copies_their_logits():
    from types import SimpleNamespace

    from specdec.engine.model_runner import ModelRunner, RunEntry

    paged = PagedModel(tiny_hf_model("qwen2", seed=2))
    stub = StubGraphs(paged.lm.arch.vocab_size)
    runner = ModelRunner(paged.lm.model, paged.kv, paged.backend, paged.page_size, stub)
    seq = SimpleNamespace(block_table=paged.table)

    decode = [RunEntry(seq, [5], 3, 1), RunEntry(seq, [6], 4, 1)]
    first = runner.run(decode)
    assert stub.calls == [[[5], [6]]] and runner.num_graph_runs == 1
    runner.run(decode)  # the stub overwrites its buffer: the first result must be a copy
    assert torch.equal(first, torch.ones_like(first))

    eager_batches = [
        [RunEntry(seq, [1, 2, 3], 0, 1)],  # a prompt chunk
        [RunEntry(seq, [5], 3, 1)] * 5,  # larger than the bucket
        [RunEntry(seq, [7, 8], 3, 2)],  # a q_len never captured
    ]
    for entries in eager_batches:
        logits = runner.run(entries)
        assert logits.shape[0] == sum(e.num_logits for e in entries)
    assert runner.num_graph_runs == 2 and len(stub.calls) == 2
