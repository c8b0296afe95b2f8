"""The speculation policy inside the engine: what it is asked, what it is told, what k = 0 costs."""

from __future__ import annotations

import pytest
from specdec.engine.sampling_params import SamplingParams
from tiny_models import make_engine, tiny_hf_model

from specdec.controller import AdaptivePolicy, FixedPolicy
from specdec.controller import policy as policy_module
from specdec.controller.policy import PrefillShape, SpecDecision, StepObservation

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_hf_model("qwen2", seed=0), tiny_hf_model("qwen2", seed=1, layers=1)


class ScriptedPolicy:
    """Returns the scripted k for every decode-ready sequence, step after step (0 past the end);
    remembers what it was asked and told."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.asked: list[tuple[int, PrefillShape]] = []
        self.observed: list[StepObservation] = []

    def decide(self, seqs, prefill: PrefillShape) -> SpecDecision:
        i = len(self.asked)
        self.asked.append((len(seqs), prefill))
        k = self.script[i] if i < len(self.script) else 0
        return SpecDecision([k] * len(seqs))

    def observe(self, obs: StepObservation) -> None:
        self.observed.append(obs)

    def stats(self) -> dict:
        return {}


def test_k0_steps_run_no_draft_forward_and_the_policy_sees_each_forward(tiny_pair):
    engine = make_engine(*tiny_pair)
    free = engine.allocator.num_free_blocks
    engine.policy = policy = ScriptedPolicy([0, 0, 2, 0, 3, 0, 0, 1] * 3)
    prompts = [[5, 6, 7, 8, 9], [4, 3, 2]]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    forwards_per_step = []
    while engine.has_unfinished():
        before = engine.proposer.num_forwards
        engine.step()
        forwards_per_step.append(engine.proposer.num_forwards - before)
    assert engine.allocator.num_free_blocks == free
    assert len(policy.observed) == len(forwards_per_step)
    for obs, ran in zip(policy.observed, forwards_per_step, strict=True):
        assert len(obs.draft_forwards) == ran  # one shape per forward that ran, none at k = 0
        drafted = sum(o.num_drafted for o in obs.outcomes)
        assert (ran == 0) == (drafted == 0)
        assert obs.target.rows >= obs.target.seqs >= 1 and obs.target.attended > 0
    first = next(obs for obs in policy.observed if obs.draft_forwards)
    # The first drafting step catches the draft up on both whole sequences (prompt + output).
    assert first.draft_forwards[0].rows >= sum(map(len, prompts))
    for obs in policy.observed:
        for f in obs.draft_forwards[1:]:  # later forwards: one row per sequence still drafting
            assert f.rows == f.seqs


def test_the_policy_is_told_the_prompt_chunks_beside_the_decodes(tiny_pair):
    engine = make_engine(*tiny_pair, max_num_batched_tokens=24)
    engine.policy = policy = ScriptedPolicy([])
    engine.add_request("a", [3, 4, 5], GREEDY)
    engine.step()  # a prefills
    engine.add_request("b", list(range(2, 42)), GREEDY)  # 40 tokens: chunks of what is left
    engine.step()
    n, prefill = policy.asked[-1]
    assert n == 1  # a decodes
    assert prefill.seqs == 1 and prefill.rows == 23  # the budget less a's decode row
    engine.abort("a")
    engine.abort("b")


def test_adaptive_policy_without_acceptance_never_drafts(tiny_pair, monkeypatch):
    monkeypatch.setattr(policy_module, "EXPLORE_INTERVAL", 10**9)
    engine = make_engine(*tiny_pair)
    engine.policy = AdaptivePolicy(4, initial_acceptance=0.0, stop_drafts_early=False)
    outs = engine.generate([[3, 4, 5, 6], [9, 8, 7], [1, 2, 3, 4, 5]], GREEDY)
    assert all(len(o.output_token_ids) == 20 for o in outs)
    assert engine.proposer.num_forwards == 0
    assert engine.policy.stats()["speculating_fraction"] == 0.0
    # The same engine does draft for a request that forces speculation on.
    engine.generate([[3, 4, 5, 6]], GREEDY, speculative="on")
    assert engine.proposer.num_forwards > 0


def test_fixed_policy_from_the_config_drafts_k_for_auto_and_none_for_off(tiny_pair):
    engine = make_engine(*tiny_pair, speculative_policy="fixed", num_speculative_tokens=3)
    assert isinstance(engine.policy, FixedPolicy)
    auto = engine.generate([[3, 4, 5, 6], [9, 8, 7]], GREEDY, speculative="auto")
    off = engine.generate([[3, 4, 5, 6]], GREEDY, speculative="off")[0]
    for out in auto:
        st = out.spec_stats
        # Every decode step drafts k = 3 but those near max_tokens, where fewer could commit.
        assert st.num_spec_steps >= st.num_target_steps - 1 > 0  # the last token: no room
        assert len(st.drafted_per_pos) == 3 and st.drafted_per_pos[2] >= st.num_spec_steps - 2
    assert off.spec_stats.num_draft_tokens == 0


def test_adaptive_policy_is_seeded_from_a_cached_cost_table(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    engine = make_engine(*tiny_pair, controller_warmup=True)
    assert isinstance(engine.policy, AdaptivePolicy)
    assert engine.policy.cost.target.num_live == 0  # nothing live yet: the table speaks
    (cached,) = (tmp_path / "calibration").glob("*.json")
    outs = engine.generate([[3, 4, 5, 6]], GREEDY)
    assert len(outs[0].output_token_ids) == 20
    mtime = cached.stat().st_mtime_ns
    make_engine(*tiny_pair, controller_warmup=True)  # a restart reads the table
    assert cached.stat().st_mtime_ns == mtime


def test_the_engine_leaves_openblas_one_thread_beside_the_models(tiny_pair):
    """The policy's cost fit multiplies through numpy and scipy's OpenBLAS; threads that library
    wakes for each product spin on after it, on the cores the model's threads run on."""
    from threadpoolctl import ThreadpoolController

    openblas = ThreadpoolController().select(internal_api="openblas")
    if not openblas.lib_controllers:
        pytest.skip("numpy and scipy use no OpenBLAS here")
    with openblas.limit(limits=2):  # whatever the process had, restored after the test
        make_engine(*tiny_pair)
        assert {c.num_threads for c in openblas.lib_controllers} == {1}
