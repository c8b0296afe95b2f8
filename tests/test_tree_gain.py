"""Static token trees predicted from traces: ranks, the tree walk, the fitted tree, the report."""

from __future__ import annotations

import json

import numpy as np
import pytest
from specdec.evals import tree_gain
from specdec.evals.traces import TOP_K, TraceSet, save_traces

from tests.helpers_replay import linear_cost_table, synthetic_trace


def ranked_trace(rid: str, category: str, target_ranks: list[int]):
    """A greedy request whose target token is the draft's ``r``-th choice at each position
    (``TOP_K``: not among the draft's top choices)."""
    trace = synthetic_trace(rid, category, 0.0, [False] * len(target_ranks))
    for j, r in enumerate(target_ranks):
        if r < TOP_K:
            trace.draft_ids[j, r] = trace.tokens[j]
    return trace


def test_ranks_read_the_targets_token_among_the_drafts_choices():
    trace = ranked_trace("a", "code_generation", [0, 1, 7, TOP_K, 0])
    assert tree_gain.ranks(trace).tolist() == [0, 1, 7, TOP_K, 0]


def test_chain_walk_accepts_leading_top_choices_and_commits_one_more():
    r = np.array([0, 0, 1, 0, 0, 0])
    # depth 2: accept 2 (+1) -> t=3; accept 2 (+1) -> t=6: 6 tokens in 2 forwards
    assert tree_gain.decode(r, tree_gain.chain(2)) == (6, 2)
    # depth 1: forwards at t=0 (acc 1), t=2 (acc 0), t=3 (acc 1), t=5 (the request ends)
    assert tree_gain.decode(r, tree_gain.chain(1)) == (6, 4)


def test_a_tree_holding_second_choices_accepts_where_the_chain_stops():
    r = np.array([1, 1, 1, 1, 1, 1])
    assert tree_gain.decode(r, tree_gain.chain(3)) == (6, 6)  # nothing accepted
    tree = frozenset({(0,), (1,), (1, 1), (1, 1, 1)})
    assert tree_gain.decode(r, tree) == (6, 2)  # 3 accepted + 1, then the last 2 + 1


def test_best_tree_is_the_most_frequent_prefix_closed_paths():
    seqs = [np.array([1, 1, 1, 1, 1, 1, 1, 1])] * 3 + [np.array([0, 2, 0, 2])]
    counts = tree_gain.path_counts(seqs, depth=3)
    tree = tree_gain.best_tree(counts, 3)
    assert tree == frozenset({(1,), (1, 1), (1, 1, 1)})
    for n in range(1, 8):
        t = tree_gain.best_tree(counts, n)
        assert all(p[:-1] in t for p in t if len(p) > 1)  # prefix-closed


def traces_with_second_choices() -> TraceSet:
    requests = []
    for i in range(3):
        requests.append(ranked_trace(f"code{i}", "code_generation", [1, 1, 0, 1] * 12))
        requests.append(ranked_trace(f"chat{i}", "multi_turn_chat", [0, 1, 2, 0] * 12))
    meta = {"cost_table": linear_cost_table(), "cost_table_machine": {"cpu": "test", "dtype": "x"}}
    return TraceSet(requests, meta)


def test_evaluate_fits_on_other_requests_and_beats_the_chain_where_second_choices_hold():
    result = tree_gain.evaluate(traces_with_second_choices())
    for group in ("code", "chat"):
        rows = result["groups"][group]["rows"]
        for depth in tree_gain.DEPTHS:
            by_shape = {r["shape"]: r for r in rows if r["depth"] == depth}
            chain_tpf = by_shape["chain"]["tokens_per_forward"]
            assert by_shape["tree_n16"]["tokens_per_forward"] > chain_tpf
    summary = tree_gain.summary(result)
    assert summary["code"]["trees"]["tree_n16"]["tokens_per_forward_vs_chain"] > 1.5


def test_main_writes_json_and_markdown(tmp_path):
    traces_dir = tmp_path / "traces"
    ts = traces_with_second_choices()
    save_traces(traces_dir, ts.requests, ts.meta)
    out = tmp_path / "out"
    assert tree_gain.main(["--traces", str(traces_dir), "--output-dir", str(out)]) == 0
    body = json.loads((out / "tree_gain.json").read_text())
    assert set(body["groups"]) == {"code", "chat"}
    md = (out / "tree_gain.md").read_text()
    assert "tree_n16" in md and "test" in md
    # another cost table prices the same traces: a meta.json file
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"cost_table": ts.meta["cost_table"],
                                "cost_table_machine": {"cpu": "other", "dtype": "bf16"}}))  # fmt: skip
    args = ["--traces", str(traces_dir), "--cost-table-from", str(meta), "--output-dir", str(out)]
    assert tree_gain.main(args) == 0
    assert "other" in (out / "tree_gain.md").read_text()


def test_missing_trace_set_is_a_clear_error(tmp_path):
    from specdec.engine.errors import SpecdecError

    with pytest.raises(SpecdecError, match="holds no trace set"):
        tree_gain.main(["--traces", str(tmp_path / "none"), "--output-dir", str(tmp_path)])
