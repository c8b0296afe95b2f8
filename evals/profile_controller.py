"""Host time of the adaptive controller per engine step, on synthetic steps (no models, no GPU).

Drives an ``AdaptiveController`` (built as ``specdec.controller.factory`` builds it, its cost model
seeded with GPU-like calibration samples: target step 7 ms + 0.02 ms per row, draft forward
2.7 ms + 0.04 ms per row) through synthetic decode steps at a few batch sizes, at acceptance ~0
(the batch settles at k = 0) and ~0.8 (it speculates), and prints the median and mean
microseconds per step of ``expect_prefill``, ``choose_k`` and ``observe`` (the step's critical
path) and of ``while_target_runs`` ("overlapped": the engine calls it while the device runs the
target forward, where the cost model's refits go)::

    python -m evals.profile_controller                 # every batch size and acceptance
    python -m evals.profile_controller --seqs 64 --acceptance 0.0 --profile  # plus cProfile
    python -m evals.profile_controller --seqs 64 --mode off   # requests that never speculate

The first ``--warmup`` steps (the controller settling, probes backing off) are not timed.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

from evals.controller_sim import draft_forwards, make_seqs, verify_step
from specdec.controller import AcceptanceTracker, AdaptiveController, AdaptiveParams, CostModel
from specdec.controller.cost_model import DraftCost, DraftSample, TargetCost, TargetSample
from specdec.controller.factory import INITIAL_ACCEPTANCE
from specdec.controller_base import StepObservation

K_MAX = 4
TARGET = TargetCost(base=7e-3, per_seq=0.0, slope_low=2e-5, knee=4096, slope_high=2e-5)
DRAFT = DraftCost(per_forward=2.7e-3, per_row=4e-5, per_seq=0.0)
# A cheaper draft (``--cheap-draft``): a batch of 64 speculates at acceptance 0.8 too.
CHEAP_DRAFT = DraftCost(per_forward=0.8e-3, per_row=5e-6, per_seq=0.0)


def build(draft_cost: DraftCost, k_max: int = K_MAX, max_seqs: int = 64) -> AdaptiveController:
    """The factory's controller, seeded with calibration-like samples of ``TARGET`` and
    ``draft_cost``."""
    controller = AdaptiveController(
        k_max,
        cost=CostModel(),
        acceptance=AcceptanceTracker(k_max, "draft_model", INITIAL_ACCEPTANCE["draft_model"]),
        params=AdaptiveParams(),
        per_position_forwards=True,
    )
    sizes = [1 << i for i in range(max_seqs.bit_length()) if 1 << i < max_seqs] + [max_seqs]
    target = [TargetSample(s * r, s, TARGET(s * r, s)) for s in sizes for r in range(1, k_max + 2)]
    draft = [DraftSample(1, s * r, s, draft_cost(s * r, s)) for s in sizes for r in (1, 2)]
    draft += [DraftSample(1, rows, 1, draft_cost(rows, 1)) for rows in (16, 64)]
    controller.cost.seed(target, draft)
    return controller


def run(
    n: int,
    acceptance: float,
    steps: int,
    warmup: int,
    draft_cost: DraftCost = DRAFT,
    seed: int = 0,
    mode: str = "auto",
) -> tuple[dict[str, list[int]], float]:
    """Nanoseconds per call of each controller entry point over the timed steps, and the mean k
    chosen in them."""
    rng = random.Random(seed)
    controller, seqs = build(draft_cost), make_seqs(n, mode=mode)
    times: dict[str, list[int]] = {
        "expect_prefill": [], "choose_k": [], "observe": [], "overlapped": []
    }  # fmt: skip
    clock, sum_k = time.perf_counter_ns, 0
    for step in range(warmup + steps):
        t0 = clock()
        controller.expect_prefill(0, 0)
        t1 = clock()
        ks = controller.choose_k(seqs)
        t2 = clock()
        forwards = draft_forwards(seqs, ks)
        outcomes = [verify_step(seq, k, acceptance, rng) for seq, k in zip(seqs, ks, strict=True)]
        rows = n + sum(ks)
        draft_time = sum(draft_cost(r, s) for r, s in forwards)
        target_time = TARGET(rows, n)
        obs = StepObservation(target_time + draft_time, draft_time, target_time, rows, n)
        obs.draft_forwards, obs.outcomes = forwards, outcomes
        t3 = clock()
        controller.while_target_runs()  # the engine calls it while the target forward runs
        t4 = clock()
        controller.observe(obs)
        t5 = clock()
        if step >= warmup:
            sum_k += sum(ks)
            times["expect_prefill"].append(t1 - t0)
            times["choose_k"].append(t2 - t1)
            times["observe"].append(t5 - t4)
            times["overlapped"].append(t4 - t3)
    return times, sum_k / max(1, steps * n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--cheap-draft", action="store_true", help="draft costs CHEAP_DRAFT")
    parser.add_argument(
        "--mode",
        choices=["auto", "off", "on"],
        default="auto",
        help="the sequences' speculative mode",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile each run (top 25)")
    args = parser.parse_args()
    print(f"{'seqs':>5} {'accept':>6}  {'entry point':<15}{'median us':>10}{'mean us':>10}")
    for n in args.seqs:
        for a in args.acceptance:
            profiler = cProfile.Profile() if args.profile else None
            if profiler:
                profiler.enable()
            draft = CHEAP_DRAFT if args.cheap_draft else DRAFT
            times, mean_k = run(n, a, args.steps, args.warmup, draft, mode=args.mode)
            if profiler:
                profiler.disable()
            for name, ns in times.items():
                med, mean = statistics.median(ns) / 1e3, statistics.fmean(ns) / 1e3
                print(f"{n:>5} {a:>6.2f}  {name:<15}{med:>10.1f}{mean:>10.1f}")
            # The step's critical path: what does not overlap the device's forward.
            critical = [times[name] for name in ("expect_prefill", "choose_k", "observe")]
            total = [sum(v) / 1e3 for v in zip(*critical, strict=True)]
            med, mean = statistics.median(total), statistics.fmean(total)
            print(
                f"{n:>5} {a:>6.2f}  {'critical path':<15}{med:>10.1f}{mean:>10.1f}  mean k {mean_k:.2f}"
            )
            if profiler:
                pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
