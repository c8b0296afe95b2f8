"""`specdec trace` on a tiny random pair: the recorded path is the target's, the draft's top tokens
are its distribution given the true prefix, and the set round-trips through its files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from specdec.engine.sampling_params import SamplingParams
from specdec.evals.tiny_pair import tiny_pair
from specdec.evals.trace_record import draft_side, draft_top, plain_engine, record_requests
from specdec.evals.traces import load_traces, save_traces


@pytest.fixture(scope="module")
def recorded():
    torch.manual_seed(0)
    target, draft = tiny_pair()
    requests = [
        (
            "a@t0",
            "code_generation",
            list(range(3, 20)),
            SamplingParams(temperature=0, max_tokens=12),
        ),
        (
            "a@t1",
            "code_generation",
            list(range(3, 20)),
            SamplingParams(temperature=1, max_tokens=12, seed=5),
        ),
        ("b@t0", "math", list(range(40, 52)), SamplingParams(temperature=0, max_tokens=10)),
    ]
    target_engine = plain_engine(target, 0.1, 4, 0)
    draft_engine = plain_engine(draft, 0.1, 4, 0)
    free = (target_engine.allocator.num_free_blocks, draft_engine.allocator.num_free_blocks)
    traces = record_requests(target_engine, draft_engine, requests)
    after = (target_engine.allocator.num_free_blocks, draft_engine.allocator.num_free_blocks)
    return target, draft, requests, traces, free, after


def test_greedy_path_is_the_targets_plain_output(recorded):
    target, _, requests, traces, _, _ = recorded
    engine = plain_engine(target, 0.1, 4, 0)
    for (rid, _, prompt, params), trace in zip(requests, traces, strict=True):
        if params.temperature == 0:
            out = engine.generate([prompt], params)[0]
            assert trace.tokens.tolist() == out.output_token_ids, rid
            # greedy: the path token is the target's most likely one
            assert np.all(trace.target_prob + 1e-6 >= trace.target_probs_of_draft.max(axis=1))


def test_draft_top_tokens_are_its_distribution_given_the_true_prefix(recorded):
    _, draft, requests, traces, _, _ = recorded
    engine = plain_engine(draft, 0.1, 4, 0)
    for (_, _, prompt, _), trace in zip(requests, traces, strict=True):
        assert np.all(np.diff(trace.draft_probs, axis=1) <= 1e-7)  # sorted, most likely first
        # the draft's greedy next token after prompt + path[:j] is its recorded top-1
        for j in (0, trace.num_output // 2, trace.num_output - 1):
            prefix = prompt + trace.tokens[:j].tolist()
            out = engine.generate([prefix], SamplingParams(temperature=0, max_tokens=1))[0]
            assert out.output_token_ids[0] == trace.draft_ids[j, 0]


def test_recording_returns_every_block_and_round_trips(recorded, tmp_path):
    _, _, requests, traces, free, after = recorded
    assert free == after
    save_traces(tmp_path, traces, {"cost_table": {}})
    loaded = load_traces(tmp_path).requests
    assert [t.id for t in loaded] == [r[0] for r in requests]
    for a, b in zip(traces, loaded, strict=True):
        assert np.array_equal(a.tokens, b.tokens)
        assert np.array_equal(a.draft_ids, b.draft_ids)
        assert np.allclose(a.draft_probs, b.draft_probs, atol=1e-3)
        assert b.temperature == a.temperature and b.seed == a.seed


def test_cost_table_times_every_kind_of_shape_on_a_tiny_pair():
    """The table the replay prices steps with: target, draft and sampling shapes, each timed
    (shapes the small pool cannot hold are skipped, the rest are there)."""
    from specdec.evals.cost_table import StepCosts, measure_cost_table

    target, draft = tiny_pair()
    target_engine = plain_engine(target, 0.05, 4, 0)
    draft_engine = plain_engine(draft, 0.05, 4, 0)
    free = (target_engine.allocator.num_free_blocks, draft_engine.allocator.num_free_blocks)
    table = measure_cost_table(target_engine, draft_engine, repeats=1)
    for kind in ("target", "draft", "sampling"):
        assert table[kind] and all(row["seconds"] > 0 for row in table[kind])
    assert {row["temperature"] for row in table["sampling"]} == {0.0, 1.0}
    assert StepCosts(table).target_seconds([(4, 32)], greedy_rows=4) > 0
    # Token trees' verifies (1 + 8 rows per sequence) and draft levels (4 rows each) are timed.
    assert any(r["seqs"] == 2 and r["rows"] == 18 for r in table["target"])
    assert any(r["seqs"] == 2 and r["rows"] == 8 for r in table["draft"])
    after = (target_engine.allocator.num_free_blocks, draft_engine.allocator.num_free_blocks)
    assert after == free


def test_cost_table_rounds_visit_every_shape_in_a_fresh_order_and_keep_the_median(monkeypatch):
    """A slow spell falls on shapes at random, not on the same neighbours each round, and each
    shape keeps its median over the rounds beside every round's value."""
    from specdec.evals import cost_table

    target, draft = tiny_pair()
    target_engine = plain_engine(target, 0.05, 4, 0)
    draft_engine = plain_engine(draft, 0.05, 4, 0)
    visits: list[tuple] = []

    def fake_time(engine, shape, context, logits, repeats=1):
        visits.append((id(engine), shape, context))
        return float(len(visits))  # a clock: a later visit takes longer

    monkeypatch.setattr(cost_table, "_time_job", fake_time)
    table = cost_table.measure_cost_table(target_engine, draft_engine, rounds=3)
    jobs = len(cost_table._timing_jobs(target_engine, draft_engine))
    rounds = [visits[2 + r * jobs : 2 + (r + 1) * jobs] for r in range(3)]  # after 2 warm-ups
    assert all(sorted(r, key=str) == sorted(rounds[0], key=str) for r in rounds)
    assert rounds[0] != rounds[1] != rounds[2]
    rows = [row for kind, rs in table.items() if kind != "sampling" for row in rs]
    assert len(rows) == jobs
    assert all(len(row["rounds"]) == 3 for row in rows)
    assert all(row["seconds"] == sorted(row["rounds"])[1] for row in rows)


def test_draft_side_ranks_only_the_tokens_its_pruned_head_keeps(tmp_path):
    """A trace of a pruned draft holds what the engine drafts from: q over the kept ids only,
    the same ranking as the full head's logits restricted to them."""
    from test_draft_vocab import tiny_table

    target, draft = tiny_pair()
    vocab, keep = target.arch.vocab_size, 48
    table = tiny_table(tmp_path / "table.json", vocab=vocab)
    side = draft_side(target, draft, 0.05, 0, "float32", "none", keep, table)
    kept = side.target_runner.output_token_ids
    assert kept is not None and kept.numel() == keep
    prompt, tokens = list(range(3, 20)), np.array([30, 7, 41, 9], np.int64)
    free = side.allocator.num_free_blocks
    ids, probs = draft_top(side, prompt, tokens)
    assert side.allocator.num_free_blocks == free
    assert set(ids[probs > 0].tolist()) <= set(kept.tolist())
    full_ids, _ = draft_top(plain_engine(draft, 0.05, 4, 0), prompt, tokens)
    in_kept = np.isin(full_ids, kept.numpy())
    # the pruned head's first choice is the full head's best kept token wherever one is ranked
    for j in range(len(tokens)):
        if in_kept[j].any():
            assert ids[j, 0] == full_ids[j][in_kept[j]][0]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-tokens", "1"], "--max-tokens must be >= 2"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--temperatures", "0.5"], "temperatures 0 and 1 only"),
        (["--draft-vocab-size", "-1"], "--draft-vocab-size must be >= 0"),
    ],
)
def test_trace_command_rejects_bad_flags_before_loading_anything(tmp_path, capsys, flags, message):
    from specdec.api.cli import main

    assert main(["trace", "--output-dir", str(tmp_path / "t"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_trace_command_rejects_unknown_formats(tmp_path, capsys):
    from specdec.api.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["trace", "--output-dir", str(tmp_path / "t"), "--quantization", "int8-dynamic"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
