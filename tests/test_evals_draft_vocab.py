"""The pruned-draft measurement: the greedy replay's arithmetic and a smoke run on the tiny pair."""

from __future__ import annotations

import json

import pytest
import torch
from specdec.engine.config import EngineConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.evals.datasets import load_categories
from specdec.evals.draft_vocab import corpus as corpus_io
from specdec.evals.draft_vocab.build_table import table_from
from specdec.evals.draft_vocab.measure import main as measure_main
from specdec.evals.draft_vocab.replay import pruned_argmax, rejection_acceptance, replay_greedy
from specdec.evals.tiny_pair import tiny_pair

T, F = True, False


@pytest.mark.parametrize(
    ("agree", "k", "want"),
    [
        # (drafted, accepted, steps, committed); token 0 comes from the prefill.
        ([T] * 9, 4, (6, 6, 2, 8)),  # 4 drafts + bonus, then the 2 that fit + bonus
        ([F] * 5, 2, (5, 0, 4, 4)),  # every draft refused; drafts shrink near the end
        ([F, T, F, T, T, T], 3, (5, 3, 2, 5)),
        ([T], 4, (0, 0, 0, 0)),
    ],
)
def test_greedy_replay_counts(agree, k, want):
    r = replay_greedy(agree, k)
    assert (r.drafted, r.accepted, r.steps, r.committed) == want


def test_pruned_argmax_and_rejection_acceptance():
    logits = torch.tensor([[0.0, 5.0, 1.0, 1.0], [2.0, 0.0, 2.0, -1.0]])
    kept = torch.tensor([0, 2, 3])
    # Row 0's best token (1) is pruned: the kept argmax, lowest id on the 1.0 tie, is 2.
    assert pruned_argmax(logits, kept).tolist() == [2, 0]
    p = torch.softmax(logits, dim=-1)
    full = rejection_acceptance(p, logits, None)
    torch.testing.assert_close(full, torch.ones(2, dtype=torch.float64))
    pruned = rejection_acceptance(p, logits, kept)
    assert bool((pruned < 1).all()) and bool((pruned > 0).all())


def test_measure_runs_on_the_tiny_pair(tmp_path):
    target, draft = tiny_pair()
    cfg = EngineConfig(
        model="tiny", draft_model=None, speculative_method="none", device="cpu", dtype="float32"
    )
    engine = LLMEngine(cfg, target=target, progress=False)
    records = corpus_io.generate(engine, load_categories(["all"], 2), max_tokens=6)
    path = tmp_path / "corpus.jsonl"
    corpus_io.write(records, path)
    assert corpus_io.read(path) == records
    assert {r.id for r in corpus_io.fold(records, 0)}.isdisjoint(
        r.id for r in corpus_io.fold(records, 1)
    )
    table = table_from([r.output_ids for r in records], [], 512, None, [1], {})
    assert table.ranked_ids[0] == 1
    out = tmp_path / "out"
    argv = ["--tiny", "--corpus", str(path), "--sizes", "64,256,0", "--rounds", "1", "--limit", "1"]
    assert measure_main([*argv, "--reps", "1", "--output-dir", str(out)]) == 0
    result = json.loads((out / "draft_vocab.json").read_text())
    rows = {(r["ranking"], r["draft_vocab_size"]): r for r in result["acceptance"]["rows"]}
    full = rows[("full vocabulary", 512)]
    assert full["coverage"] == 1.0
    for name in ("frequency", "id order"):
        assert rows[(name, 64)]["coverage"] <= rows[(name, 256)]["coverage"] <= 1.0
    assert set(result["cost"]["draft_forward_ms"]) == {"draft N=64", "draft N=256", "draft full"}
    assert "| frequency | 64 |" in (out / "draft_vocab.md").read_text()


def test_corpus_from_the_committed_trace_set_is_its_greedy_half():
    records = corpus_io.from_trace("evals/data/traces")
    assert len(records) == 21 and all(r.id.endswith("@t0") for r in records)
    assert all(r.prompt_ids and r.output_ids for r in records)
    assert {r.category for r in records} == {r.category for r in load_categories(["all"], 1)}
