"""The vocabulary-pruned draft head: exact output, q = 0 off the kept set, clear errors, no leaks."""

from __future__ import annotations

import json

import pytest
import torch
from specdec.engine.config import EngineConfig
from specdec.engine.errors import ConfigError
from specdec.engine.models.layers import Linear
from specdec.engine.models.quant import Int4Draft, Int8Dynamic, Int8RowScaled
from specdec.engine.sampling import RowContext, compute_probs, sample
from specdec.engine.sampling_params import SamplingParams
from test_engine_greedy import expected, prompts, run_staggered
from test_rejection_sampler import (
    NUM_TOKENS,
    P_THRESHOLD,
    START,
    TRIALS,
    VOCAB,
    lossless_p_values,
    simulate,
)
from tiny_models import make_engine, noisy_copy

from specdec.draft_vocab import (
    FrequencyTable,
    embed_logits,
    load_table,
    rank_tokens,
    resolve_draft_vocab,
)
from specdec.rejection_sampler import rejection_sample

TINY_VOCAB = 128
EOS = 1  # tiny_models' eos_token_id
KEEP = 48
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def tiny_table(path, ranked: list[int] | None = None, vocab: int = TINY_VOCAB) -> str:
    """A table for the tiny vocabulary: eos first, then a fixed shuffle of the other ids."""
    if ranked is None:
        g = torch.Generator().manual_seed(5)
        rest = [int(i) for i in torch.randperm(vocab, generator=g) if int(i) != EOS]
        ranked = [EOS, *rest]
    FrequencyTable(tuple(ranked), vocab, None, {"test": True}).write(path)
    return str(path)


@pytest.fixture(scope="module")
def draft(target):
    """A draft that agrees with the target often (so acceptance is not trivially 0 or 1)."""
    return noisy_copy(target, 0.3, seed=2)


@pytest.fixture
def table(tmp_path):
    return tiny_table(tmp_path / "tiny.json")


def kept_of(path: str, n: int = KEEP) -> set[int]:
    return set(load_table(path).kept_ids(n).tolist())


# ---------------------------------------------------------------- the table


def test_ranking_puts_special_tokens_first_then_counts_then_later_corpora():
    ranked = rank_tokens([[5, 7, 7, 3, 7, 5], [9, 9, 2, 5]], special_ids=[11, 1], vocab_size=12)
    assert ranked == [1, 11, 7, 5, 3, 9, 2]
    table = FrequencyTable(tuple(ranked), 12, None, {})
    assert table.kept_ids(3).tolist() == [1, 7, 11]
    # Past the table's end, the lowest unlisted ids follow.
    assert table.kept_ids(9).tolist() == [0, 1, 2, 3, 4, 5, 7, 9, 11]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rank_tokens([[12]], [], 12)


def test_table_round_trips_and_bad_files_get_clear_errors(tmp_path):
    path = tiny_table(tmp_path / "t.json")
    assert load_table(path).ranked_ids[0] == EOS
    cases = {
        "missing.json": None,
        "garbage.json": "not json",
        "format.json": json.dumps({"format": "other"}),
        "ids.json": json.dumps(
            {"format": "specdec-draft-vocab/1", "vocab_size": 4, "ranked_ids": [1, 9]}
        ),
        "twice.json": json.dumps(
            {"format": "specdec-draft-vocab/1", "vocab_size": 4, "ranked_ids": [1, 1]}
        ),
    }
    for name, text in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=name):
            load_table(tmp_path / name)


@pytest.mark.parametrize("size", [TINY_VOCAB + 1, 10**6])
def test_size_larger_than_the_vocabulary_is_refused(table, size):
    with pytest.raises(ConfigError, match=r"draft_vocab_size must lie in \[1, 128\]"):
        resolve_draft_vocab(size, table, TINY_VOCAB, None, [EOS])


def test_negative_size_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="draft_vocab_size must be >= 0"):
        EngineConfig(draft_vocab_size=-1)


def test_table_lacking_special_tokens_is_refused(tmp_path):
    path = tiny_table(tmp_path / "no_eos.json", ranked=[5, 6, 7])
    with pytest.raises(ConfigError, match=r"lacks special tokens \[1\]"):
        resolve_draft_vocab(8, path, TINY_VOCAB, None, [EOS])
    # Listed, but ranked past the kept rows: N too small to keep it.
    path = tiny_table(tmp_path / "late_eos.json", ranked=[5, 6, 7, EOS])
    with pytest.raises(ConfigError, match=r"leaves out special tokens \[1\]"):
        resolve_draft_vocab(3, path, TINY_VOCAB, None, [EOS])


def test_table_of_another_vocabulary_is_refused_when_asked_for_and_skipped_when_automatic(
    tmp_path,
):
    path = tiny_table(tmp_path / "big.json", vocab=256)
    with pytest.raises(ConfigError, match="vocabulary of 256, the draft has 128"):
        resolve_draft_vocab(KEEP, path, TINY_VOCAB, None, [EOS])
    assert resolve_draft_vocab(None, path, TINY_VOCAB, None, [EOS]) is None
    # 0 and the vocabulary's own size both mean the full head; no table is read.
    assert resolve_draft_vocab(0, tmp_path / "absent.json", TINY_VOCAB, None, [EOS]) is None
    assert resolve_draft_vocab(128, tmp_path / "absent.json", TINY_VOCAB, None, [EOS]) is None


def test_engine_refuses_bad_sizes_and_tables_before_serving(target, draft, tmp_path):
    with pytest.raises(ConfigError, match="must lie in"):
        make_engine(target, draft, draft_vocab_size=TINY_VOCAB + 1)
    bad = tiny_table(tmp_path / "bad.json", ranked=[3, 4, 5])
    with pytest.raises(ConfigError, match="lacks special tokens"):
        make_engine(target, draft, draft_vocab_size=3, draft_vocab_table=bad)


# ---------------------------------------------------------------- the head


@pytest.mark.parametrize("packed", [False, True])
def test_row_subset_computes_the_chosen_rows(packed):
    torch.manual_seed(0)
    full = Linear(16, 40, bias=True)
    full.weight.data.normal_()
    full.bias.data.normal_()
    x = torch.randn(3, 16)
    want = full(x)
    rows = torch.tensor([0, 7, 8, 39])
    if packed and not full.pack_for_cpu():
        pytest.skip("no oneDNN on this build")
    sub = full.row_subset(rows)
    assert sub.out_features == 4 and (sub.kernel is not None) == packed
    torch.testing.assert_close(sub(x), want[:, rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sub(x[:1]), want[:1, rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", [Int8RowScaled, Int8Dynamic])
def test_row_subset_of_an_int8_layer_keeps_its_format_and_rows(kernel):
    torch.manual_seed(0)
    full = Linear(16, 40, bias=False)
    full.weight.data.normal_()
    full.set_kernel(kernel(full.weight))
    rows = torch.tensor([0, 7, 8, 39])
    sub = full.row_subset(rows)
    assert isinstance(sub.kernel, kernel) and sub.out_features == 4
    x = torch.randn(3, 16)
    torch.testing.assert_close(sub(x), full(x)[:, rows], rtol=1e-2, atol=1e-2)


def test_pruned_draft_reads_n_rows_and_leaves_the_loaded_model_alone(target, draft, table):
    engine = make_engine(target, draft, draft_vocab_size=KEEP, draft_vocab_table=table)
    head = engine.proposer.runner.model.lm_head
    assert head.out_features == KEEP
    assert engine.draft.model.lm_head.out_features == TINY_VOCAB
    assert set(engine.proposer.runner.model.output_token_ids.tolist()) == kept_of(table)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9),
        SamplingParams(temperature=1.3, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5),
    ],
)
def test_embedded_logits_give_q_zero_off_the_kept_set(params):
    torch.manual_seed(1)
    kept = torch.tensor(sorted(torch.randperm(TINY_VOCAB)[:KEEP].tolist()))
    logits = embed_logits(torch.randn(4, KEEP) * 3, kept, TINY_VOCAB)
    rows = [RowContext(params, [2, 3, int(kept[0])], [int(kept[1]), 9]) for _ in range(4)]
    q = compute_probs(logits, rows)
    off = torch.ones(TINY_VOCAB, dtype=torch.bool)
    off[kept] = False
    assert bool((q[:, off] == 0).all())
    torch.testing.assert_close(q.sum(-1), torch.ones(4))
    for seeds in ([None] * 4, [1, 2, 3, 4]):
        picks = sample(q, seeds, [5, 5, 6, 7])
        assert set(picks.tolist()) <= set(kept.tolist())


# ---------------------------------------------------------------- end to end


@pytest.mark.parametrize("draft_quantization", ["none", "int8-dynamic", "int4"])
def test_greedy_output_is_token_identical_to_plain_decode(target, draft, table, draft_quantization):
    engine = make_engine(
        target,
        draft,
        num_speculative_tokens=4,
        speculative_mode="on",
        draft_vocab_size=KEEP,
        draft_vocab_table=table,
        draft_quantization=draft_quantization,
    )
    head = engine.proposer.runner.model.lm_head
    assert head.out_features == KEEP
    assert (draft_quantization == "none") == (not isinstance(head.kernel, (Int8Dynamic, Int4Draft)))
    free0 = engine.allocator.num_free_blocks
    ps = prompts()
    outs = run_staggered(engine, ps)
    assert outs == expected(target, ps)
    kept = kept_of(table)
    # The target wrote tokens the draft cannot propose, and drafts were both taken and refused.
    assert any(t not in kept for o in outs for t in o)
    assert 0 < engine.spec_stats.acceptance_rate < 1
    assert engine.allocator.num_free_blocks == free0


def test_draft_never_proposes_a_pruned_token(target, draft, table):
    engine = make_engine(
        target,
        draft,
        num_speculative_tokens=3,
        speculative_mode="on",
        draft_vocab_size=KEEP,
        draft_vocab_table=table,
    )
    kept = kept_of(table)
    off = torch.ones(TINY_VOCAB, dtype=torch.bool)
    off[list(kept)] = False
    seen: list = []
    propose = engine.proposer.propose

    def recording(items, stop=None):
        drafts = propose(items, stop)
        seen.extend(drafts.proposals)
        return drafts

    engine.proposer.propose = recording
    free0 = engine.allocator.num_free_blocks
    kinds = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=30, top_p=0.9, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.2, frequency_penalty=0.5, max_tokens=20, ignore_eos=True),
    ]
    ps = prompts(len(kinds))
    engine.generate(ps, kinds)
    drafted = [t for p in seen for t in p.token_ids]
    assert len(drafted) > 50
    assert set(drafted) <= kept
    with_q = [p for p in seen if p.probs is not None]
    assert with_q  # unseeded sampled requests keep q for the rejection rule
    for p in with_q:
        assert p.probs.shape[-1] == TINY_VOCAB
        assert bool((p.probs[:, off] == 0).all())
        torch.testing.assert_close(p.probs.sum(-1), torch.ones(len(p.token_ids)))
    assert engine.allocator.num_free_blocks == free0


def test_seeded_output_equals_seeded_plain_decode(target, draft, table):
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=20, ignore_eos=True) for s in (1, 2, 3)
    ]
    ps = prompts(3)
    plain = make_engine(target).generate(ps, params)
    engine = make_engine(
        target,
        draft,
        num_speculative_tokens=3,
        speculative_mode="on",
        draft_vocab_size=KEEP,
        draft_vocab_table=table,
    )
    pruned = engine.generate(ps, params)
    assert [o.output_token_ids for o in pruned] == [o.output_token_ids for o in plain]
    assert engine.spec_stats.num_accepted_tokens > 0


# ---------------------------------------------------------------- distribution (chi-square)

# The draft of the Markov harness in test_rejection_sampler keeps these tokens of its 8; the
# target puts mass on the others too.
PRUNED_KEEP = torch.tensor([0, 2, 3, 5, 6])
WARP = SamplingParams(temperature=0.8, top_k=4, top_p=0.95)


def pruned_chains(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target P and pruned draft Q ([VOCAB, VOCAB] each) as the engine would warp them: random
    logits per context, the draft's embedded from its kept rows, both through compute_probs."""
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(VOCAB, VOCAB, generator=g) * 1.5
    draft_logits = target_logits[:, PRUNED_KEEP] + torch.randn(VOCAB, len(PRUNED_KEEP), generator=g)
    rows = [RowContext(WARP, (), ()) for _ in range(VOCAB)]
    p = compute_probs(target_logits, rows)
    q = compute_probs(embed_logits(draft_logits, PRUNED_KEEP, VOCAB), rows)
    return p, q


def kept_only_residual_sampler(target_probs, draft_token_ids, draft_probs, num_draft_tokens):
    """Wrong: verifies against the target restricted to the draft's kept tokens."""
    mask = torch.zeros(target_probs.shape[-1])
    mask[PRUNED_KEEP] = 1.0
    restricted = target_probs * mask
    restricted = restricted / restricted.sum(-1, keepdim=True)
    return rejection_sample(restricted, draft_token_ids, draft_probs, num_draft_tokens)


@pytest.mark.parametrize("chain_seed", [0, 1])
def test_pruned_draft_sampled_output_follows_target_distribution(chain_seed):
    p, q = pruned_chains(chain_seed)
    assert bool((q[:, [1, 4, 7]] == 0).all())
    # The target really puts mass where the draft cannot go, at the start and later.
    assert float(p[START, [1, 4, 7]].sum()) > 0.05
    emitted = simulate(rejection_sample, p, q, seed=200 + chain_seed)
    assert emitted.shape == (TRIALS, NUM_TOKENS)
    assert min(lossless_p_values(emitted, p)) > P_THRESHOLD


@pytest.mark.parametrize("chain_seed", [0, 1])
def test_check_rejects_a_rule_blind_to_pruned_tokens(chain_seed):
    p, q = pruned_chains(chain_seed)
    emitted = simulate(kept_only_residual_sampler, p, q, seed=200 + chain_seed)
    assert min(lossless_p_values(emitted, p)) < P_THRESHOLD
