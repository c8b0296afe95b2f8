"""The machine's step-cost table: measured on runners, cached per machine, seeding the cost fit."""

from __future__ import annotations

import json

import pytest
import torch
from specdec.engine import calibration
from specdec.engine.calibration import (
    CalibrationSpec,
    CostTable,
    cached_or_measured,
    forward_code_digest,
    machine_description,
    measure,
)
from tiny_models import make_engine, noisy_copy, tiny_hf_model

from specdec.controller.step_cost import ForwardShape, StepCostModel


def _engine():
    target = tiny_hf_model(seed=0)
    return make_engine(target, noisy_copy(target, 0.05))


def test_measure_times_target_and_draft_shapes_and_frees_every_block():
    engine = _engine()
    free = engine.allocator.num_free_blocks
    spec = CalibrationSpec(4, k_max=3, max_rows=128, max_context=256, budget_seconds=5.0, repeats=1)
    machine = machine_description(torch.device("cpu"), torch.float32, ["t", "d"])
    ticks = iter(range(1, 10**9))  # a clock of 1 ms ticks: which shapes fit the budget is fixed
    table = measure(
        engine.target_runner,
        engine.proposer.runner,
        engine.allocator,
        spec,
        machine,
        clock=lambda: next(ticks) * 1e-3,
    )
    assert engine.allocator.num_free_blocks == free
    target = [s for s in table.samples if s.model == "target"]
    draft = [s for s in table.samples if s.model == "draft"]
    assert {(s.rows, s.seqs) for s in target} >= {(1, 1), (4, 4), (3, 1)}  # plain and verify
    assert any(s.seqs == 1 and s.attended > 200 for s in target)  # a long-context decode
    assert {(s.rows, s.seqs) for s in draft} >= {(1, 1), (16, 1)}
    # A catch-up as long as the step's budget: the price of a prompt the draft never read.
    assert (spec.max_rows, 1) in {(s.rows, s.seqs) for s in draft}
    assert all(s.seconds > 0 for s in table.samples)
    cost = StepCostModel()
    table.seed(cost)
    assert cost.target_time(ForwardShape(1, 1)) > 0 and cost.draft_time([ForwardShape(1, 1)]) > 0


def test_with_trees_the_table_times_tree_verifies_and_wide_draft_levels():
    engine = _engine()
    free = engine.allocator.num_free_blocks
    machine = machine_description(torch.device("cpu"), torch.float32, ["t", "d"])

    def shapes(tree_nodes: int) -> dict[str, set[tuple[int, int]]]:
        spec = CalibrationSpec(4, 3, max_rows=128, budget_seconds=60.0, repeats=1,
                               tree_nodes=tree_nodes)  # fmt: skip
        ticks = iter(range(1, 10**9))
        args = (engine.target_runner, engine.proposer.runner, engine.allocator, spec, machine)
        table = measure(*args, clock=lambda: next(ticks) * 1e-3)
        return {m: {(s.seqs, s.rows // s.seqs) for s in table.samples if s.model == m}
                for m in ("target", "draft")}  # fmt: skip

    chains, trees = shapes(0), shapes(16)
    assert engine.allocator.num_free_blocks == free
    # A 16-node tree verifies 17 rows per sequence; a chain of k = 3 at most 4.
    assert max(r for _, r in chains["target"] if _ > 1) == 4
    assert (4, 17) in trees["target"] and (2, 17) in trees["target"]
    # A dynamic tree's widest level holds half its nodes: draft forwards of up to 8 rows each.
    assert max(r for _, r in chains["draft"] if _ > 1) == 2
    assert {(4, 4), (4, 8)} <= trees["draft"]


def test_tree_shapes_are_timed_after_every_chain_shape():
    # A budget stops at the first shape it cannot afford, so what it cuts is the end of the list:
    # chains' shapes, the long-context decodes (the attention term) and the draft's catch-ups come
    # first, and only trees lose shapes when time runs short.
    engine = _engine()
    machine = machine_description(torch.device("cpu"), torch.float32, ["t", "d"])

    def timed(tree_nodes: int) -> dict[str, list[tuple[int, int, int]]]:
        spec = CalibrationSpec(4, 3, max_rows=128, max_context=256, budget_seconds=60.0,
                               repeats=1, tree_nodes=tree_nodes)  # fmt: skip
        ticks = iter(range(1, 10**9))
        args = (engine.target_runner, engine.proposer.runner, engine.allocator, spec, machine)
        table = measure(*args, clock=lambda: next(ticks) * 1e-3)
        return {m: [(s.seqs, s.rows, s.attended) for s in table.samples if s.model == m]
                for m in ("target", "draft")}  # fmt: skip

    chains, trees = timed(0), timed(16)
    for model in ("target", "draft"):
        assert len(trees[model]) > len(chains[model])
        assert trees[model][: len(chains[model])] == chains[model]
    assert any(seqs == 1 and attended > 200 for seqs, _, attended in chains["target"])


def test_table_is_cached_per_machine_and_spec(tmp_path):
    engine = _engine()
    spec = CalibrationSpec(max_num_seqs=2, k_max=2, max_rows=16, budget_seconds=2.0, repeats=1)
    machine = machine_description(torch.device("cpu"), torch.float32, ["t", "d"])
    args = (engine.target_runner, engine.proposer.runner, engine.allocator, spec, machine)
    first = cached_or_measured(*args, cache_dir=tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    second = cached_or_measured(*args, cache_dir=tmp_path)
    assert second.to_json() == first.to_json()  # read back, not measured again
    other = dict(machine, threads=machine["threads"] + 1)
    cached_or_measured(*args[:4], other, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2  # another machine key, another entry


def test_an_unreadable_cache_entry_is_measured_afresh(tmp_path):
    engine = _engine()
    spec = CalibrationSpec(max_num_seqs=1, k_max=1, max_rows=8, budget_seconds=1.0, repeats=1)
    machine = machine_description(torch.device("cpu"), torch.float32, ["t"])
    args = (engine.target_runner, None, engine.allocator, spec, machine)
    cached_or_measured(*args, cache_dir=tmp_path)
    path = next(tmp_path.glob("*.json"))
    path.write_text("{not json")
    table = cached_or_measured(*args, cache_dir=tmp_path)
    assert table.samples and json.loads(path.read_text())["version"] == 1
    assert CostTable.from_json(json.loads(path.read_text())).samples == table.samples


def test_the_cache_key_follows_the_forward_code(tmp_path):
    # An edit to a layer, a weight format, an attention backend or the sampler changes the
    # timings, so it changes the key even where the package version does not move (a source tree).
    for part in ("models", "attention"):
        (tmp_path / part).mkdir()
        (tmp_path / part / "a.py").write_text("x = 1\n")
    before = forward_code_digest(tmp_path)
    assert forward_code_digest(tmp_path) == before
    (tmp_path / "attention" / "a.py").write_text("x = 2\n")
    assert forward_code_digest(tmp_path) != before
    after_python = forward_code_digest(tmp_path)
    (tmp_path / "attention" / "kernel.c").write_text("int f(void) { return 0; }\n")  # native
    assert forward_code_digest(tmp_path) != after_python
    after_native = forward_code_digest(tmp_path)
    (tmp_path / "noise.py").write_text("x = 3\n")  # every sampled row's noise
    assert forward_code_digest(tmp_path) != after_native
    machine = machine_description(torch.device("cpu"), torch.float32, ["t"])
    assert machine["forward_code"] == forward_code_digest()


def test_the_cache_key_follows_the_plan_of_shapes(tmp_path, monkeypatch):
    # A change to the shapes the calibration times (its code, with the same spec) must not read
    # a table measured to the old plan: the fit would extrapolate where the new plan measures.
    from specdec.engine import calibration

    engine = _engine()
    spec = CalibrationSpec(max_num_seqs=1, k_max=1, max_rows=32, budget_seconds=1.0, repeats=1)
    machine = machine_description(torch.device("cpu"), torch.float32, ["t", "d"])
    args = (engine.target_runner, engine.proposer.runner, engine.allocator, spec, machine)
    cached_or_measured(*args, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 1
    monkeypatch.setattr(calibration, "catch_up_rows", lambda max_rows: [16])
    table = cached_or_measured(*args, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2  # measured to the new plan, stored apart
    catch_ups = [s.rows for s in table.samples if s.model == "draft" and s.seqs == 1]
    assert 32 not in catch_ups


def test_a_cached_table_timed_on_a_busier_machine_is_measured_afresh(tmp_path):
    # A table timed while other work held the machine prices the draft far above its cost, and a
    # draft that is never run is never measured live: the table must not outlive that spell.
    engine = _engine()
    spec = CalibrationSpec(max_num_seqs=1, k_max=1, max_rows=8, budget_seconds=1.0, repeats=1)
    machine = machine_description(torch.device("cpu"), torch.float32, ["t", "d"])
    args = (engine.target_runner, engine.proposer.runner, engine.allocator, spec, machine)
    ticks = iter(range(1, 10**9))
    clock = lambda: next(ticks) * 1e-3  # noqa: E731  every forward takes 1 ms
    first = cached_or_measured(*args, cache_dir=tmp_path, clock=clock)
    path = next(tmp_path.glob("*.json"))
    busy = first.to_json()
    busy["samples"] = [dict(s, seconds=s["seconds"] * 20) for s in busy["samples"]]
    path.write_text(json.dumps(busy))
    again = cached_or_measured(*args, cache_dir=tmp_path, clock=clock)
    assert all(s.seconds == pytest.approx(1e-3) for s in again.samples)  # measured, not read
    assert json.loads(path.read_text())["samples"] == again.to_json()["samples"]  # and kept
    assert cached_or_measured(*args, cache_dir=tmp_path, clock=clock).to_json() == again.to_json()


def test_a_table_timed_while_the_machine_changed_speed_serves_the_run_uncached(tmp_path):
    engine = _engine()
    free = engine.allocator.num_free_blocks
    spec = CalibrationSpec(max_num_seqs=1, k_max=1, max_rows=8, budget_seconds=1.0, repeats=1)
    machine = machine_description(torch.device("cpu"), torch.float32, ["t", "d"])
    args = (engine.target_runner, engine.proposer.runner, engine.allocator, spec, machine)
    now = [0.0]
    step = [1e-3]

    def clock() -> float:  # each reading a step on; steps 20 times longer once the plan is done
        now[0] += step[0]
        return now[0]

    original = calibration.time_forward

    def slower_afterwards(*a, **k):
        step[0] = 20e-3
        return original(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibration, "time_forward", slower_afterwards)
        table = cached_or_measured(*args, cache_dir=tmp_path, clock=clock)
    assert {s.model for s in table.samples} == {"target", "draft"}
    assert not list(tmp_path.glob("*.json"))  # used for this run, not kept
    assert engine.allocator.num_free_blocks == free
