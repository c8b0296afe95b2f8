"""The replay: real engine and controllers on recorded traces against simulated time."""

from __future__ import annotations

import numpy as np
import pytest
from helpers_replay import linear_cost_table, synthetic_trace, synthetic_trace_set
from specdec.evals.cost_table import StepCosts
from specdec.evals.replay import (
    MAX_K,
    EngineShape,
    OraclePolicy,
    Policy,
    ReplayError,
    Round,
    SimClock,
    Workload,
    default_policies,
    replay_request,
    run_policy,
)
from specdec.evals.replay_suite import (
    Scenario,
    default_scenarios,
    run_suite,
    targets_markdown,
    to_json,
    to_markdown,
)
from specdec.evals.traces import load_traces, save_traces

from specdec.controller.policy import FixedPolicy

COSTS = StepCosts(linear_cost_table())
SHAPE = EngineShape(num_kv_blocks=512)


class RecordingPolicy(FixedPolicy):
    """Fixed k that keeps every step's outcomes as the engine reports them."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.calls = 0
        self.outcomes: list[tuple[int, int]] = []

    def decide(self, seqs, prefill):
        self.calls += 1
        return super().decide(seqs, prefill)

    def observe(self, obs) -> None:
        self.outcomes += [(o.num_drafted, o.num_accepted) for o in obs.outcomes]


def _one_request(matches: list[bool], temperature: float = 0.0):
    trace = synthetic_trace("r0", "code_generation", temperature, matches)
    return replay_request(trace, "q0", seed=0)


MATCHES = [True, True, False, True, True, True, True, True, False, False, True, True, True] * 2


@pytest.mark.parametrize("k", [1, 2, 3, 6])
def test_greedy_replay_accepts_min_k_and_leading_matches(k):
    req = _one_request(MATCHES)
    ctl = RecordingPolicy(k)
    result, _ = run_policy(Workload([req], 1), Policy("rec", lambda e: ctl), COSTS, SHAPE)
    # By hand: the prefill commits output 0; each decode step at output position m drafts
    # k' = min(k, tokens left - 1) and accepts its leading matches from m, then commits one more.
    expected, m, n = [], 1, len(MATCHES)
    while m < n:
        kk = min(k, n - m - 1)
        acc = 0
        while acc < kk and MATCHES[m + acc]:
            acc += 1
        expected.append((kk, acc))
        m += acc + 1
    decode = ctl.outcomes[1:]  # the first outcome is the prefill's token
    assert ctl.outcomes[0] == (0, 0)
    assert decode == expected
    assert result.tokens == n
    assert result.accepted == sum(a for _, a in expected)


def test_replay_calls_the_plugged_in_policy_and_drafts_its_ks():
    reqs = [_one_request(MATCHES)]
    ctl = RecordingPolicy(2)
    result, engine = run_policy(Workload(reqs, 1), Policy("rec", lambda e: ctl), COSTS, SHAPE)
    assert engine.policy is ctl
    assert ctl.calls > 0
    assert result.drafted == sum(d for d, _ in ctl.outcomes)
    # the real proposer ran the draft forwards
    assert engine.proposer.runner.num_forwards > 0


class BatchRecordingPolicy(FixedPolicy):
    """Fixed k that keeps the number of decode-ready sequences of every step."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.sizes: list[int] = []

    def decide(self, seqs, prefill):
        self.sizes.append(len(seqs))
        return super().decide(seqs, prefill)


def _batch_sizes(grow_to: tuple[int, int] | None) -> list[int]:
    ctl = BatchRecordingPolicy(1)
    reqs = [replay_request(synthetic_trace(f"r{i}", "code_generation", 0.0, MATCHES),
                           f"q{i}", seed=0) for i in range(6)]  # fmt: skip
    workload = Workload(reqs, 1, grow_to=grow_to)
    result, _ = run_policy(workload, Policy("rec", lambda e: ctl), COSTS, SHAPE)
    assert result.tokens == 6 * len(MATCHES)
    return ctl.sizes


def test_a_closed_loop_grows_to_more_clients_once_its_first_requests_were_sent():
    assert max(_batch_sizes(None)) == 1
    # One client until the second request is sent (when the first finished), then three.
    sizes = _batch_sizes((2, 3))
    grown = sizes.index(3)
    assert grown > 1 and set(sizes[:grown]) == {1} and max(sizes) == 3


def _six_requests():
    return [replay_request(synthetic_trace(f"r{i}", "code_generation", 0.0, MATCHES),
                           f"q{i}", seed=0) for i in range(6)]  # fmt: skip


def test_rounds_start_once_the_last_drained_and_only_measured_ones_are_reported():
    ctl = BatchRecordingPolicy(1)
    rounds = (Round(2, 1, measured=False), Round(4, 4))
    workload = Workload(_six_requests(), None, rounds=rounds)
    result, _ = run_policy(workload, Policy("rec", lambda e: ctl), COSTS, SHAPE)
    # One client for the first two requests, then all four of the second round at once.
    grown = ctl.sizes.index(4)
    assert set(ctl.sizes[:grown]) == {1}
    assert result.tokens == 4 * len(MATCHES)
    assert len(result.ttft) == 4
    both = Workload(_six_requests(), None, rounds=(Round(2, 1), Round(4, 4)))
    whole, _ = run_policy(both, Policy("rec", lambda e: BatchRecordingPolicy(1)), COSTS, SHAPE)
    assert whole.tokens == 6 * len(MATCHES)
    # The first round's two requests one after the other take longer than four at once.
    assert whole.seconds - result.seconds > result.seconds


def test_rounds_must_cover_the_workload():
    with pytest.raises(ValueError, match="rounds hold 2 requests"):
        Workload(_six_requests(), None, rounds=(Round(2, 1),))


def test_a_cut_request_keeps_its_first_tokens_and_their_acceptance():
    req = _one_request(MATCHES)
    cut = req.cut(5)
    assert cut.path == req.path[:5]
    assert cut.accept.tolist() == req.accept[:5].tolist()
    assert len(cut.confidence) == 5 and cut.prompt == req.prompt


class ShapeRecordingPolicy(FixedPolicy):
    """Fixed k that keeps what it is shown: each sequence's cost class and each measured step."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.warped: list[bool] = []
        self.steps = []

    def decide(self, seqs, prefill):
        self.warped += [s.params.warped for s in seqs]
        return super().decide(seqs, prefill)

    def observe(self, obs) -> None:
        self.steps.append(obs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_sampled_requests_rows_are_priced_and_observed_as_sampled(temperature):
    # The engine picks a replayed request's tokens greedily (the harness drew them), but the
    # policy must see what the live engine would: at T=1 every target and draft row is sampled.
    ctl = ShapeRecordingPolicy(2)
    req = _one_request(MATCHES, temperature)
    result, _ = run_policy(Workload([req], 1), Policy("rec", lambda e: ctl), COSTS, SHAPE)
    assert result.tokens == len(MATCHES)  # still the recorded path
    assert ctl.warped and all(w == (temperature > 0) for w in ctl.warped)
    decodes = [o for o in ctl.steps if o.draft_forwards]
    assert decodes
    for obs in decodes:
        sampled = temperature > 0
        assert obs.target.sampled == (obs.target.rows if sampled else 0)
        assert all(f.sampled == (f.seqs if sampled else 0) for f in obs.draft_forwards)


def test_adaptive_is_the_engines_own_policy_calibrated_on_simulated_time():
    from specdec.controller import AdaptivePolicy

    reqs = [_one_request(MATCHES)]
    result, engine = run_policy(Workload(reqs, 1), Policy("adaptive"), COSTS, SHAPE)
    assert isinstance(engine.policy, AdaptivePolicy)
    assert result.tokens == len(MATCHES)
    # start-up calibration ran its forwards through the trace runners, then the clock restarted
    assert engine.target_runner.num_forwards > result.steps


def test_calibration_sees_the_machine_before_the_scenarios_slowdowns_and_stalls():
    """A scenario's slow-downs and stalls start with its requests: the start-up calibration of
    an adaptive run times the same forwards whatever the scenario does to the clock later."""
    reqs = [_one_request(MATCHES)]
    runs = [
        Workload(reqs, 1),
        Workload(reqs, 1, slowdowns=[(0.0, 1e9, 3.0)], stalls=[0.01], stall_seconds=5.0),
    ]
    samples = []
    for workload in runs:
        _, engine = run_policy(workload, Policy("adaptive"), COSTS, SHAPE)
        samples.append(list(engine.policy.cost.target._cal_y))
    assert samples[0] and samples[0] == samples[1]


def test_no_kv_leak_even_when_the_pool_forces_preemption(monkeypatch):
    from specdec.engine.scheduler import Scheduler

    preempted = []
    real_preempt = Scheduler._preempt

    def counting_preempt(self, seq, plan):
        preempted.append(seq.request_id)
        real_preempt(self, seq, plan)

    monkeypatch.setattr(Scheduler, "_preempt", counting_preempt)
    ts = synthetic_trace_set(n_out=40)
    reqs = [replay_request(t, f"q{i}", 0, filler_tokens=200) for i, t in enumerate(ts.requests)]
    shape = EngineShape(num_kv_blocks=40, page_size=16, max_num_seqs=4, max_model_len=512)
    for policy in (Policy("k3", lambda e: FixedPolicy(3)), Policy("adaptive")):
        result, engine = run_policy(Workload(reqs, 4), policy, COSTS, shape)
        assert engine.allocator.num_free_blocks == shape.num_kv_blocks
        assert result.tokens == sum(len(r.path) for r in reqs)
    assert preempted  # the pool was too small for every request at once


def test_leaked_block_is_reported(monkeypatch):
    from specdec.engine.block_allocator import BlockAllocator

    real_free = BlockAllocator.free

    def leaky_free(self, seq):
        if seq.request_id == "q0":
            seq.block_table = seq.block_table[:-1]  # forget one block: it never comes back
        real_free(self, seq)

    monkeypatch.setattr(BlockAllocator, "free", leaky_free)
    with pytest.raises(ReplayError, match="leaked"):
        run_policy(
            Workload([_one_request(MATCHES)], 1),
            Policy("k2", lambda e: FixedPolicy(2)),
            COSTS,
            SHAPE,
        )


def test_oracle_is_at_least_every_fixed_policy_on_a_synthetic_trace():
    ts = synthetic_trace_set(n_out=48)
    reqs = [replay_request(t, f"q{i}", 0) for i, t in enumerate(ts.requests)]
    rates = {}
    for policy in default_policies():
        if policy.name == "adaptive":
            continue
        result, _ = run_policy(Workload(reqs, 1), policy, COSTS, SHAPE)
        rates[policy.name] = result.tokens_per_s
    assert rates["oracle"] >= max(v for n, v in rates.items() if n != "oracle")


def test_oracle_reads_the_traces_future():
    req = _one_request(MATCHES)
    oracle = OraclePolicy({req.request_id: req}, COSTS, MAX_K)
    assert req.leading_accepts(0, 6) == 2
    assert req.leading_accepts(3, 6) == 5
    assert req.leading_accepts(3, 2) == 2
    assert oracle.k_max == MAX_K


def test_sampled_acceptance_is_drawn_from_the_overlap_with_a_fixed_seed():
    trace = synthetic_trace("r1", "translation", 1.0, [False] * 4000, overlap=0.3)
    a = replay_request(trace, "a", seed=0)
    b = replay_request(trace, "b", seed=0)
    c = replay_request(trace, "c", seed=0, offset=1)
    assert np.array_equal(a.accept, b.accept)  # same request, same seed: the same draws
    assert not np.array_equal(a.accept, c.accept)  # another replica draws its own
    assert abs(a.accept.mean() - 0.3) < 0.03


def test_sim_clock_slowdown_and_stalls():
    clock = SimClock()
    clock.reset(slowdowns=[(1.0, 2.0, 1.3)], stalls=[5.0], stall_seconds=3.0)
    clock.charge(1.0)
    assert clock() == pytest.approx(1.0)
    clock.charge(0.5)  # starts inside the window: 30% slower
    assert clock() == pytest.approx(1.65)
    clock.advance_to(4.9)
    clock.charge(0.2)  # runs across the stall at t = 5
    assert clock() == pytest.approx(8.1)
    clock.charge(0.1)
    assert clock() == pytest.approx(8.2)


def test_step_costs_interpolate_and_price_context():
    # the linear table is reproduced between and beyond its points
    assert COSTS.target(7, 1) == pytest.approx(0.05 + 0.014 + 0.001)
    assert COSTS.target(24, 3) == pytest.approx(0.05 + 0.048 + 0.003, rel=0.05)
    assert COSTS.target_attention == pytest.approx(1e-9)
    long = COSTS.target_seconds([(1, 4000)], sampled_rows=1)
    short = COSTS.target_seconds([(1, 31)], sampled_rows=1)
    assert long > short


def test_rows_past_a_curves_last_point_cost_what_they_add_to_the_longest_curve():
    # One sequence measured to prompt-sized rows, flattening (weights read once); eight sequences
    # measured to a few rows each, steep there (per-row work of a small-row kernel).
    one = {1: 0.10, 8: 0.12, 64: 0.20, 512: 0.60}
    eight = {8: 0.14, 16: 0.18}
    table = linear_cost_table()
    table["draft"] = [{"seqs": 1, "rows": r, "context": 32, "seconds": t} for r, t in one.items()]
    table["draft"] += [
        {"seqs": 8, "rows": r, "context": 32, "seconds": t} for r, t in eight.items()
    ]
    costs = StepCosts(table)
    assert costs.draft(16, 8) == pytest.approx(0.18)  # measured points stay as measured
    # 512 rows over 8 sequences: the last point plus the one-sequence rise from 16 to 512 rows,
    # not the 8-sequence curve's end slope (5 ms a row) carried out to 512 rows.
    rise = 0.60 - (0.12 + (0.20 - 0.12) * (16 - 8) / (64 - 8))
    assert costs.draft(512, 8) == pytest.approx(0.18 + rise)
    assert costs.draft(512, 8) < 0.18 + 496 * 0.005 / 2
    # Between sequence counts the two curves' prices are interpolated as before.
    assert costs.draft(512, 1) < costs.draft(512, 4) < costs.draft(512, 8)


def test_suite_is_deterministic_and_has_the_required_shape(tmp_path):
    ts = synthetic_trace_set()
    save_traces(tmp_path / "t", ts.requests, ts.meta)
    loaded = load_traces(tmp_path / "t")
    wanted = {"code_c2", "open_c2", "switch"}
    scenarios = [s for s in default_scenarios() if s.name in wanted]
    policies = [p for p in default_policies() if p.name in ("plain", "fixed_k2", "adaptive")]
    first = to_json(run_suite(loaded, scenarios, policies))
    second = to_json(run_suite(load_traces(tmp_path / "t"), scenarios, policies))
    assert first == second
    # Spread over processes: the same bytes.
    assert to_json(run_suite(loaded, scenarios, policies, workers=2)) == first
    report = run_suite(loaded, scenarios, policies)
    assert [r["name"] for r in report["scenarios"]] == [s.name for s in scenarios]
    for r in report["scenarios"]:
        assert set(r["tokens_per_s"]) == {"plain", "fixed_k2", "adaptive"}
        assert all(v > 0 for v in r["tokens_per_s"].values())
    assert "adaptive / best fixed" in to_markdown(report)


def test_default_suite_names_every_policy_and_scenario():
    names = [p.name for p in default_policies()]
    assert names == [
        "plain", *[f"fixed_k{k}" for k in range(1, 7)], "tree_n8", "tree_n16", "adaptive",
        "adaptive_trees", "oracle",
    ]  # fmt: skip
    scenario_names = [s.name for s in default_scenarios()]
    for c in (1, 2, 4, 8, 16, 32, 64):
        assert f"code_c{c}" in scenario_names and f"open_c{c}" in scenario_names
    for name in ("slowdown", "stalls", "switch", "burst", "ramp", "long_prompts", "mixed"):
        assert name in scenario_names


def test_tree_policies_follow_the_recorded_ranks():
    """Where the draft's second choice is the path's token a chain stops and a tree goes on;
    every policy still commits the recorded path (run_policy checks it)."""
    trace = synthetic_trace("r0", "code_generation", 0.0, [True, False, True, True] * 8)
    trace.draft_probs[:, 1:] = 0.2 / 6
    trace.draft_probs[:, 1] = 0.3  # a clear second choice
    for j in range(trace.num_output):
        if trace.draft_ids[j, 0] != trace.tokens[j]:
            trace.draft_ids[j, 1] = trace.tokens[j]  # the path's token, ranked second
    req = replay_request(trace, "q0", seed=0)
    assert req.rank.tolist() == [0, 1, 0, 0] * 8
    per_forward = {}
    for name, make in (("chain", lambda e: FixedPolicy(4)), ("tree", lambda e: FixedPolicy(4, 8))):
        result, engine = run_policy(Workload([req], 1), Policy(name, make), COSTS, SHAPE)
        per_forward[name] = engine.spec_stats.mean_accepted_length
        if name == "tree":
            assert engine.spec_stats.accepted_per_rank[1] > 0
    assert per_forward["tree"] > per_forward["chain"] + 0.25


def test_a_scenario_without_requests_for_its_workload_is_an_error():
    ts = synthetic_trace_set()
    ts.requests = [r for r in ts.requests if r.temperature > 0]
    scenario = [s for s in default_scenarios() if s.name == "code_c1"]
    with pytest.raises(ValueError, match="no requests"):
        run_suite(ts, scenario, default_policies()[:1])


def test_missing_trace_set_is_a_clear_error(tmp_path):
    from specdec.engine.errors import SpecdecError

    with pytest.raises(SpecdecError, match="no trace set"):
        load_traces(tmp_path)


def test_scenario_type_is_public():
    assert Scenario.__name__ == "Scenario"


def test_replay_command_writes_identical_files_twice(tmp_path, capsys):
    from specdec.api.cli import main

    ts = synthetic_trace_set()
    save_traces(tmp_path / "t", ts.requests, ts.meta)
    outputs = []
    for run in ("a", "b"):
        argv = ["replay", "--traces", str(tmp_path / "t"), "--output-dir", str(tmp_path / run)]
        argv += ["--scenarios", "code_c1,mixed", "--policies", "plain,fixed_k2,oracle"]
        assert main(argv) == 0
        outputs.append(
            (
                (tmp_path / run / "replay.json").read_bytes(),
                (tmp_path / run / "replay.md").read_bytes(),
            )
        )
    assert outputs[0] == outputs[1]
    assert b'"fixed_k2"' in outputs[0][0]


def _scaled(table: dict, factor: float) -> dict:
    """Every measured time of ``table`` times ``factor``."""
    return {
        name: [dict(p, seconds=p["seconds"] * factor) for p in points]
        for name, points in table.items()
    }


def test_replay_command_prices_the_traces_by_another_cost_table(tmp_path, capsys):
    import json

    from specdec.api.cli import main

    ts = synthetic_trace_set()
    save_traces(tmp_path / "t", ts.requests, ts.meta)
    slower = tmp_path / "slower.json"
    slower.write_text(
        json.dumps(
            {
                "cost_table": _scaled(ts.meta["cost_table"], 2.0),
                "cost_table_command": "specdec trace --cost-table-only",
                "cost_table_machine": {"cpu": "Slower CPU"},
            }
        )
    )
    argv = ["replay", "--traces", str(tmp_path / "t"), "--scenarios", "code_c1"]
    argv += ["--policies", "plain,fixed_k2"]
    assert main([*argv, "--output-dir", str(tmp_path / "own")]) == 0
    assert (
        main([*argv, "--output-dir", str(tmp_path / "other"), "--cost-table-from", str(slower)])
        == 0
    )
    own, other = (
        json.loads((tmp_path / d / "replay.json").read_text())["scenarios"][0]["tokens_per_s"]
        for d in ("own", "other")
    )
    for policy in ("plain", "fixed_k2"):
        assert other[policy] == pytest.approx(own[policy] / 2, rel=0.02)
    header = (tmp_path / "other" / "replay.md").read_text().splitlines()[2]
    assert "Slower CPU" in header and str(slower) in header


@pytest.mark.parametrize(
    "body, message",
    [(None, "cannot read a cost table"), ("{not json", "cannot read a cost table"),
     ('{"machine": {}}', "holds no cost table"), ("[1, 2]", "holds no cost table")],
)  # fmt: skip
def test_a_bad_cost_table_is_a_clear_error_and_writes_nothing(tmp_path, capsys, body, message):
    from specdec.api.cli import main

    ts = synthetic_trace_set()
    save_traces(tmp_path / "t", ts.requests, ts.meta)
    table = tmp_path / "table.json"
    if body is not None:
        table.write_text(body)
    argv = ["replay", "--traces", str(tmp_path / "t"), "--output-dir", str(tmp_path / "o")]
    assert main([*argv, "--cost-table-from", str(table)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_replay_command_rejects_unknown_names(tmp_path, capsys):
    from specdec.api.cli import main

    ts = synthetic_trace_set()
    save_traces(tmp_path / "t", ts.requests, ts.meta)
    argv = ["replay", "--traces", str(tmp_path / "t"), "--output-dir", str(tmp_path / "o")]
    assert main([*argv, "--policies", "fixed_k9"]) == 2
    assert "unknown policy fixed_k9" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_committed_trace_set_covers_every_category_and_replays():
    from specdec.evals.datasets import CATEGORIES

    traces = load_traces()
    seen = {(t.category, t.temperature) for t in traces.requests}
    assert seen == {(c, t) for c in CATEGORIES for t in (0.0, 1.0)}
    table = traces.cost_table
    for key in ("target", "target_context", "target_prefill_context", "draft", "sampling"):
        assert table[key], key
    scenario = [s for s in default_scenarios() if s.name == "code_c1"]
    policies = [p for p in default_policies() if p.name in ("plain", "fixed_k2")]
    tps = run_suite(traces, scenario, policies)["scenarios"][0]["tokens_per_s"]
    assert tps["fixed_k2"] > tps["plain"] > 0  # code at T = 0, one client: drafts pay


def test_targets_table_checks_each_target_and_the_baseline():
    def report(adaptive: dict[str, float]) -> dict:
        rows = []
        for name, ad in adaptive.items():
            tps = {"plain": 10.0, "fixed_k1": 12.0, "fixed_k2": 11.0, "adaptive": ad}
            if name.startswith("busy"):  # no fixed k beats plain
                tps.update(fixed_k1=8.0, fixed_k2=7.0)
            rows.append({"name": name, "tokens_per_s": tps})
        return {"scenarios": rows}

    now = report({"a": 11.9, "b": 11.0, "busy": 9.95})
    text = targets_markdown(now, report({"a": 11.0, "b": 12.0, "busy": 9.95}))
    assert "2 of 3; missed in b 0.917" in text  # 11.9 >= 0.98 * 12; busy's best fixed is 8
    assert "0.99x plain where no fixed k beats plain: met everywhere" in text
    assert "baseline in 2 of 3 scenarios; below 0.97x in b 0.917" in text
    assert "missed in busy 0.950" in targets_markdown(report({"busy": 9.5}))
