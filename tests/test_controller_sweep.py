"""The controller benchmark: repeats merge into one row per arm, results files are written."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from specdec.engine.sequence import SpecStats
from specdec.evals.controller_sweep import sweep as bench
from specdec.evals.controller_sweep.report import check_targets, merge_results, round_ratios
from specdec.evals.controller_sweep.report import main as report_main
from specdec.evals.controller_sweep.sweep import (
    DEFAULT_ARMS,
    ArmResult,
    main,
    merge_runs,
    round_requests,
    run_round,
)


def _run(throughput: float, tpots: list[float], drafted: int, accepted: int) -> ArmResult:
    return ArmResult(
        workload="code",
        concurrency=2,
        arm="adaptive",
        num_requests=2,
        output_tokens=64,
        wall_s=64 / throughput,
        throughput_tok_s=throughput,
        tpot_median_ms=0.0,
        tpot_p99_ms=0.0,
        acceptance_rate=accepted / drafted,
        mean_k=0.0,
        speculating_fraction=0.0,
        draft_forwards=drafted,
        num_drafted=drafted,
        num_accepted=accepted,
        decode_steps=10,
        spec_steps=5,
        throughput_runs=[throughput],
        tpots_ms=tpots,
    )


def test_merge_runs_takes_the_median_throughput_and_pools_the_rest() -> None:
    runs = [
        _run(10.0, [100.0, 110.0], 20, 10),
        _run(30.0, [90.0], 20, 20),
        _run(12.0, [95.0], 10, 5),
    ]
    merged = merge_runs(runs)
    assert merged.throughput_tok_s == 12.0  # the median, not the mean (17.3)
    assert merged.throughput_runs == [10.0, 30.0, 12.0]
    assert merged.tpot_median_ms == pytest.approx(97.5)
    assert merged.acceptance_rate == pytest.approx(35 / 50)
    assert merged.mean_k == pytest.approx(50 / 30)
    assert merged.speculating_fraction == pytest.approx(0.5)
    assert merged.num_requests == 6 and merged.output_tokens == 192


def test_round_ratios_compare_runs_of_the_same_round_only() -> None:
    arms = {
        "plain": {"throughput_runs": [10.0, 20.0, 10.0]},
        "fixed-k2": {"throughput_runs": [12.0, 10.0, 8.0]},
        "adaptive": {"throughput_runs": [11.0, 19.0, 10.5]},
    }
    ratios = round_ratios(arms)
    # Round by round against that round's best arm: 11/12, 19/20, 10.5/10 - not against the
    # best median (12), which no single round had beside adaptive's run.
    assert ratios["best"] == pytest.approx([11 / 12, 19 / 20, 10.5 / 10])
    assert ratios["plain"] == pytest.approx([1.1, 0.95, 1.05])
    # A round an arm did not finish has no ratio; without adaptive there is nothing to compare.
    arms["fixed-k2"]["throughput_runs"] = [12.0, 10.0]
    assert len(round_ratios(arms)["best"]) == 2
    assert round_ratios({"plain": {"throughput_runs": [1.0]}}) == {"best": [], "plain": []}


def _arms(**runs: list[float]) -> dict[str, dict]:
    """Arms as the report reads them: each round's throughput and the median over rounds."""
    return {
        arm.replace("_", "-"): {"throughput_runs": r, "throughput_tok_s": sorted(r)[len(r) // 2]}
        for arm, r in runs.items()
    }


def test_checks_judge_the_rounds_ratios_and_beside_them_the_arms_medians() -> None:
    # Adaptive is at or above plain in every round (1.00, 1.00, 1.05), but its median comes from
    # a slow round and plain's from a fast one: 14/16 = 0.875 on the medians.
    arms = _arms(plain=[20.0, 16.0, 10.0], fixed_k2=[19.0, 15.0, 9.0], adaptive=[20.0, 16.0, 10.5])
    arms["adaptive"]["throughput_tok_s"] = 14.0  # a median the rounds do not share
    assert check_targets("open", 2, arms) == {
        "within_5pct_of_best": True,
        "not_3pct_slower_than_plain": True,
    }
    assert check_targets("open", 2, arms, paired=False) == {
        "within_5pct_of_best": False,
        "not_3pct_slower_than_plain": False,
    }
    # Behind in two rounds of three fails, though the medians (10 and 10) tie.
    arms = _arms(plain=[10.0, 12.0, 8.0], adaptive=[9.5, 11.5, 10.0])
    assert check_targets("open", 1, arms)["not_3pct_slower_than_plain"] is False
    assert check_targets("open", 1, arms, paired=False)["not_3pct_slower_than_plain"] is True


def test_check_c_compares_with_the_best_fixed_k_of_each_round_at_code_c1_only() -> None:
    arms = _arms(plain=[5.0, 5.0, 5.0], fixed_k2=[9.0, 12.0, 9.0], fixed_k4=[12.0, 9.0, 9.0],
                 adaptive=[12.0, 12.0, 8.9])  # fmt: skip
    assert check_targets("code", 1, arms)["c1_code_at_least_best_fixed"] is True
    arms["adaptive"]["throughput_runs"] = [12.0, 11.9, 8.9]  # behind in two rounds of three
    assert check_targets("code", 1, arms)["c1_code_at_least_best_fixed"] is False
    assert "c1_code_at_least_best_fixed" not in check_targets("code", 2, arms)
    # An arm that did not run leaves its target unjudged; no adaptive arm, no checks.
    assert check_targets("open", 1, _arms(fixed_k2=[1.0], adaptive=[1.0])) == {
        "within_5pct_of_best": True,
        "not_3pct_slower_than_plain": None,
    }
    assert check_targets("open", 1, _arms(plain=[1.0])) == {}


class _RecordingEngine:
    """Gives each request one token per step until it has ``length``; remembers what it was sent
    and in which order the engines stepped (``log``, shared by the engines of one round)."""

    def __init__(self, name: str, log: list[str], length: int = 3) -> None:
        self.name, self.log, self.length = name, log, length
        self.policy = None
        self.proposer = None
        self.spec_stats = SpecStats()
        self.sent: list[tuple[list[int], int | None, str]] = []
        self._tokens: dict[str, int] = {}

    def add_request(self, rid, prompt, params, speculative) -> None:
        self.sent.append((prompt, params.seed, speculative))
        self._tokens[rid] = 0

    def has_unfinished(self) -> bool:
        return bool(self._tokens)

    def step(self) -> list[SimpleNamespace]:
        self.log.append(self.name)
        outs = []
        for rid in list(self._tokens):
            self._tokens[rid] += 1
            done = self._tokens[rid] == self.length
            outs.append(
                SimpleNamespace(request_id=rid, finished=done,
                                output_token_ids=[1] * self._tokens[rid])
            )  # fmt: skip
            if done:
                del self._tokens[rid]
        return outs


def _round(arms: tuple[str, ...], round_index: int, concurrency: int = 2):
    log: list[str] = []
    engines = {arm: _RecordingEngine(arm, log) for arm in arms}
    requests = round_requests("open", concurrency, [[i] for i in range(5)], 1.0, 3, 8, round_index)
    results = run_round(engines, "open", requests, concurrency)
    return engines, log, results


def test_every_arm_of_a_round_serves_the_same_requests_and_each_round_fresh_ones() -> None:
    def sent(round_index: int) -> list[list[tuple[list[int], int | None, str]]]:
        engines, _, _ = _round(("plain", "adaptive"), round_index)
        return [engine.sent for engine in engines.values()]

    plain, adaptive = sent(0)
    assert [(p, seed) for p, seed, _ in plain] == [([0], 0), ([1], 1), ([2], 2)]
    assert [(p, seed) for p, seed, _ in adaptive] == [([0], 0), ([1], 1), ([2], 2)]
    assert {mode for *_, mode in plain} == {"off"} and {mode for *_, mode in adaptive} == {"auto"}
    # Round 1 continues where round 0 stopped, prompts wrapping around: the same seed never
    # comes back, so no arm repeats one draw of sampled text in every round.
    plain, adaptive = sent(1)
    assert [(p, seed) for p, seed, _ in plain] == [([3], 3), ([4], 4), ([0], 5)]


def test_arms_step_in_turn_each_timed_by_its_own_steps() -> None:
    t0 = time.perf_counter()
    engines, log, results = _round(("plain", "fixed-k2", "adaptive"), 0, concurrency=2)
    elapsed = time.perf_counter() - t0
    # Three requests, two in flight, three steps each: 6 steps per arm, one step of each arm
    # per cycle, the first arm of a cycle rotating.
    assert log[:6] == ["plain", "fixed-k2", "adaptive", "fixed-k2", "adaptive", "plain"]
    assert all(log.count(arm) == 6 for arm in engines)
    for r in results.values():
        assert r.output_tokens == 9 and r.num_requests == 3
        assert len(r.tpots_ms) == 3
        assert r.wall_s > 0 and r.throughput_tok_s == pytest.approx(9 / r.wall_s)
    # Each arm's clock holds its own steps only: the arms' clocks cover disjoint spans of the
    # round, so together they fit inside it.
    assert sum(r.wall_s for r in results.values()) <= elapsed
    assert not any(engine.has_unfinished() for engine in engines.values())


def test_tiny_sweep_writes_one_row_per_arm_with_every_repeat(tmp_path) -> None:
    argv = ["--tiny", "--quick", "--concurrency", "1", "--workloads", "code", "--repeats", "2"]
    assert main([*argv, "--out-dir", str(tmp_path), "--name", "sweep"]) == 0
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert data["meta"]["repeats"] == 2
    rows = data["results"]
    assert sorted(r["arm"] for r in rows) == sorted(DEFAULT_ARMS)
    assert data["meta"]["environment"]["cpu"] and data["meta"]["commit"]
    for r in rows:
        assert len(r["throughput_runs"]) == 2
        assert r["num_requests"] == 2 * 4  # max(c, 4) prompts per run
        assert min(r["throughput_runs"]) <= r["throughput_tok_s"] <= max(r["throughput_runs"])
    by_arm = {r["arm"]: r for r in rows}
    assert by_arm["plain"]["num_drafted"] == 0 and by_arm["plain"]["draft_forwards"] == 0
    assert by_arm["fixed-k2"]["mean_k"] <= 2.0 < by_arm["fixed-k4"]["mean_k"]
    md = (tmp_path / "sweep.md").read_text()
    assert "| 1 |" in md and "checks" in md and "per round" in md
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_the_adaptive_trees_arm_is_judged_against_adaptive(tmp_path) -> None:
    argv = ["--tiny", "--quick", "--concurrency", "1", "--workloads", "code", "--repeats", "1"]
    argv += ["--arms", "adaptive", "adaptive-trees", "--tree-nodes", "8"]
    assert main([*argv, "--out-dir", str(tmp_path), "--name", "sweep"]) == 0
    rows = json.loads((tmp_path / "sweep.json").read_text())["results"]
    assert sorted(r["arm"] for r in rows) == ["adaptive", "adaptive-trees"]
    assert all("tree_steps" in r for r in rows)
    assert all(r["tree_steps"] == 0 for r in rows if r["arm"] == "adaptive")
    assert " D" in (tmp_path / "sweep.md").read_text()  # check D: trees against chains


def test_check_d_compares_adaptive_trees_with_adaptive_round_by_round() -> None:
    arms = _arms(adaptive=[10.0, 10.0], **{"adaptive-trees": [9.9, 9.7]})
    assert check_targets("code", 8, arms)["trees_within_2pct_of_adaptive"] is True
    arms = _arms(adaptive=[10.0, 10.0], **{"adaptive-trees": [9.7, 9.7]})
    assert check_targets("code", 8, arms)["trees_within_2pct_of_adaptive"] is False


def _part(
    workload: str, concurrency: list[int], repeats: int = 3, in_turn: bool | None = True
) -> dict:
    meta = dict(
        command=f"python -m specdec.evals.controller_sweep.sweep --workloads {workload}",
        model="t", draft_model="d", max_tokens=64, repeats=repeats,
        concurrency=concurrency, total_seconds=100.0, controller_final={"mean_k": 1.0},
    )  # fmt: skip
    if in_turn is not None:  # None: results written before the arms stepped in turn
        meta["arms_step_in_turn"] = in_turn
    rows = []
    for c in concurrency:
        for arm, tp in (("plain", 10.0), ("fixed-k2", 9.0), ("fixed-k4", 8.0), ("adaptive", 9.9)):
            rows.append(
                dict(
                    workload=workload, concurrency=c, arm=arm, throughput_tok_s=tp,
                    tpot_median_ms=100.0, tpot_p99_ms=120.0, mean_k=0.5,
                    speculating_fraction=0.2, acceptance_rate=0.6, throughput_runs=[tp] * 3,
                )
            )  # fmt: skip
    return {"meta": meta, "results": rows}


def test_parts_of_a_sweep_merge_into_one_report(tmp_path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_part("code", [1, 16])))
    b.write_text(json.dumps(_part("open", [4])))
    assert report_main([str(a), str(b), "--out", str(tmp_path / "all")]) == 0
    merged = json.loads((tmp_path / "all.json").read_text())
    assert len(merged["results"]) == 12
    assert merged["meta"]["total_seconds"] == 200.0 and merged["meta"]["concurrency"] == [1, 4, 16]
    assert "controller_final" not in merged["meta"]
    md = (tmp_path / "all.md").read_text()
    assert (
        "--workloads code`; `python -m specdec.evals.controller_sweep.sweep --workloads open" in md
    )
    assert "## code" in md and "## open" in md and "A✓ B✓" in md
    assert "the engines stepping in turn" in md
    assert (tmp_path / "all.png").stat().st_size > 0
    # A report of results measured the older way says how they were measured.
    a.write_text(json.dumps(_part("code", [1], in_turn=None)))
    assert report_main([str(a), "--out", str(tmp_path / "old")]) == 0
    old = (tmp_path / "old.md").read_text()
    assert "stepping in turn" not in old and "interleaved run(s) of every arm" in old


def test_merging_refuses_a_point_measured_twice_or_parts_of_different_benchmarks() -> None:
    with pytest.raises(ValueError, match="code c=1 plain is in more than one part"):
        merge_results([_part("code", [1, 2]), _part("code", [1])])
    with pytest.raises(ValueError, match="differ in repeats"):
        merge_results([_part("code", [1]), _part("open", [1], repeats=5)])
    # Arms stepping in turn and arms run one after another are two different measurements.
    with pytest.raises(ValueError, match="differ in arms_step_in_turn"):
        merge_results([_part("code", [1]), _part("open", [1], in_turn=None)])
    with pytest.raises(ValueError, match="nothing to merge"):
        merge_results([])


def test_each_workload_starts_with_a_warm_up_of_fresh_requests(tmp_path, monkeypatch) -> None:
    """Every arm serves ``--warmup-requests`` untimed requests of ``--warmup-tokens`` tokens, two
    at a time, before a workload's points; their seeds follow every measured request's."""
    served: list[tuple[str, int, list]] = []
    real_round = bench.run_round

    def recording(engines, workload, requests, concurrency):
        served.append((workload, concurrency, requests))
        return real_round(engines, workload, requests, concurrency)

    monkeypatch.setattr(bench, "run_round", recording)
    argv = ["--tiny", "--concurrency", "1", "--workloads", "code", "--repeats", "2"]
    argv += ["--max-tokens", "6", "--warmup-requests", "3", "--warmup-tokens", "5"]
    assert main([*argv, "--out-dir", str(tmp_path), "--name", "warm"]) == 0
    (_, warm_c, warm), *rounds = served
    assert warm_c == 2 and len(rounds) == 2
    assert [p.max_tokens for _, _, p in warm] == [5] * 3
    measured = [p.seed for _, _, reqs in rounds for _, _, p in reqs]
    assert sorted(measured) == list(range(8))  # 2 rounds x max(c, 4) requests
    assert [p.seed for _, _, p in warm] == [9, 10, 11]  # the first multiple of 3 past them
    meta = json.loads((tmp_path / "warm.json").read_text())["meta"]
    assert meta["warmup"] == {"requests": 3, "tokens": 5}
    assert "3 untimed warm-up requests of 5 tokens" in (tmp_path / "warm.md").read_text()


def test_the_warm_up_is_sized_by_flags_and_kept_short_by_quick() -> None:
    args = bench.parse_args([])
    assert (args.warmup_requests, args.warmup_tokens) == (8, 32)
    quick = bench.parse_args(["--quick"])
    assert (quick.warmup_requests, quick.warmup_tokens) == (2, 8)
    assert bench.parse_args(["--warmup-requests", "0"]).warmup_requests == 0  # no warm-up
    for bad in (["--warmup-requests", "-1"], ["--warmup-tokens", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_row_split_ratios_pair_shapes_of_one_round_with_their_groups_reference() -> None:
    from specdec.evals.controller_sweep.row_split import LADDERS, all_shapes, paired_ratios

    shapes = all_shapes()
    slow = {s: 2.0 * s[0] * s[1] for s in shapes}  # a round twice as slow: same ratios
    fast = {s: s[0] * s[1] * (1.0 if s[1] == 1 else 0.5) for s in shapes}
    ratios = paired_ratios([slow, fast])
    assert ratios[("16 rows", (16, 1))] == [1.0, 1.0]
    assert ratios[("16 rows", (2, 8))] == [1.0, 0.5]
    # a shape missing from a round (the pool could not hold it) drops out of that round only
    del fast[(32, 1)]
    assert paired_ratios([slow, fast])[("32 rows", (4, 8))] == [1.0]
    # ladders: each verify over one row a sequence at the same sequence count
    ladder = {s: s[0] * (1.0 + s[1]) for s in all_shapes(LADDERS)}
    assert paired_ratios([ladder], LADDERS)[("8 sequences", (8, 3))] == [2.0]


def test_tiny_row_split_writes_every_shape_and_frees_its_blocks(tmp_path) -> None:
    from specdec.evals.controller_sweep.row_split import all_shapes
    from specdec.evals.controller_sweep.row_split import main as row_split_main

    assert (
        row_split_main(["--tiny", "--rounds", "2", "--repeats", "1", "--output-dir", str(tmp_path)])
        == 0
    )
    result = json.loads((tmp_path / "row_split.json").read_text())
    assert {(r["seqs"], r["rows_each"]) for r in result["shapes"]} == set(all_shapes())
    assert result["dtype"] == "float32" and len(result["per_round_ms"]) == 2
    assert all(r["ratio_to_ref_median"] > 0 for r in result["shapes"])
    assert "| 16 rows | 2 x 8 |" in (tmp_path / "row_split.md").read_text()


def test_row_split_refuses_rounds_below_one() -> None:
    from specdec.evals.controller_sweep.row_split import main as row_split_main

    with pytest.raises(SystemExit) as e:
        row_split_main(["--tiny", "--rounds", "0"])
    assert e.value.code == 2


def test_tiny_step_breakdown_splits_full_batch_steps_into_forwards_and_host_work(tmp_path):
    from specdec.evals.controller_sweep.step_breakdown import main as breakdown_main

    argv = ["--tiny", "--max-tokens", "8", "--concurrency", "3", "--repeats", "1"]
    assert breakdown_main([*argv, "--output-dir", str(tmp_path)]) == 0
    points = json.loads((tmp_path / "step_breakdown.json").read_text())["points"]
    assert [(p["temperature"], p["k"]) for p in points] == [
        (t, k) for t in (0.0, 1.0) for k in (0, 2, 4)
    ]
    for p in points:
        assert p["steps"] > 0
        parts = p["target_forward_ms"] + p["draft_forwards_ms"] + p["rest_ms"]
        assert parts == pytest.approx(p["step_ms"])
        assert p["rest_ms"] >= 0 and (p["draft_forwards_per_step"] > 0) == (p["k"] > 0)
    assert "| 1 | 4 |" in (tmp_path / "step_breakdown.md").read_text()


def test_step_breakdown_refuses_a_negative_k() -> None:
    from specdec.evals.controller_sweep.step_breakdown import main as breakdown_main

    with pytest.raises(SystemExit) as e:
        breakdown_main(["--tiny", "--ks", "-1"])
    assert e.value.code == 2


TRACES_BF16 = "evals/data/traces_bf16_int4"
TABLE_WITH_ROUNDS = f"{TRACES_BF16}/cost_table_zen5_b970af4.json"


def test_table_noise_resamples_each_shape_from_its_own_rounds() -> None:
    import random

    from specdec.evals.controller_sweep.table_noise import has_resampleable_rounds, resampled

    table = {
        "cost_table": {
            "target": [{"seqs": 1, "rows": 1, "seconds": 2.0, "rounds": [1.0, 2.0, 9.0]}],
            "draft": [{"seqs": 1, "rows": 1, "seconds": 0.5, "rounds": [0.5, 0.5, 0.5]}],
            "sampling": [{"rows": 1, "temperature": 0.0, "seconds": 0.1}],
        }
    }
    assert has_resampleable_rounds(table["cost_table"])
    draws = [resampled(table, random.Random(seed)) for seed in range(20)]
    target_seconds = {d["cost_table"]["target"][0]["seconds"] for d in draws}
    assert target_seconds <= {1.0, 2.0, 9.0} and len(target_seconds) > 1
    assert all(d["cost_table"]["draft"][0]["seconds"] == 0.5 for d in draws)
    assert all(d["cost_table"]["sampling"] == table["cost_table"]["sampling"] for d in draws)
    assert table["cost_table"]["target"][0]["seconds"] == 2.0  # the input is left as it was
    assert resampled(table, random.Random(3)) == resampled(table, random.Random(3))
    del table["cost_table"]["draft"][0]["rounds"]
    assert not has_resampleable_rounds(table["cost_table"])


def test_table_noise_verdict_checks_plain_only_where_no_fixed_arm_beats_it() -> None:
    from specdec.evals.controller_sweep.table_noise import verdict

    arms = {f"fixed_k{k}": 10.0 + k for k in range(1, 7)}
    spec = verdict({"plain": 8.0, "adaptive": 15.0, **arms})
    assert spec["best_fixed"] == "fixed_k6" and spec["adaptive_over_best"] == 15.0 / 16.0
    assert spec["adaptive_over_plain"] is None
    plain = verdict({"plain": 20.0, "adaptive": 19.0, **arms})
    assert plain["adaptive_over_best"] == plain["adaptive_over_plain"] == 19.0 / 20.0


def test_table_noise_writes_a_verdict_and_its_spread_per_scenario(tmp_path) -> None:
    from specdec.evals.controller_sweep.table_noise import main as noise_main

    args = ["--traces", TRACES_BF16, "--cost-table-from", TABLE_WITH_ROUNDS, "--resamples", "2"]
    args += ["--scenarios", "code_c1", "--workers", "1", "--output-dir", str(tmp_path)]
    assert noise_main(args) == 0
    result = json.loads((tmp_path / "table_noise.json").read_text())
    (row,) = result["scenarios"]
    assert row["scenario"] == "code_c1" and len(row["resampled_over_best"]) == 2
    assert sum(row["resampled_best_fixed"].values()) == 2
    assert len(result["tokens_per_s"]) == 3  # the measured table, then the two resamples
    assert "| code_c1 |" in (tmp_path / "table_noise.md").read_text()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--resamples", "0"], "--resamples and --workers must be >= 1"),
        (["--cost-table-from", f"{TRACES_BF16}/cost_table_zen5.json"], "no per-round times"),
        (["--cost-table-from", TABLE_WITH_ROUNDS, "--scenarios", "nope"], "unknown scenario"),
        (["--cost-table-from", "/nonexistent/table.json"], "cannot read a cost table"),
    ],
)
def test_table_noise_refuses_bad_input(flags, message, capsys) -> None:
    from specdec.evals.controller_sweep.table_noise import main as noise_main

    with pytest.raises(SystemExit) as e:
        noise_main(["--traces", TRACES_BF16, *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
