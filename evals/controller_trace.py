"""Per-step trace of a speculation run: what the adaptive controller's model predicted, what ran.

``TracingController`` wraps any controller (plain, fixed k or adaptive) and, for every engine step
that had decode-ready sequences, records the k's that ran, the step's measured target and draft
seconds, the cost model's prediction for that very shape (made before the model sees the step),
and expected vs committed tokens under the acceptance estimates. Every arm is priced by the same
adaptive model, so a trace answers "was the decision wrong, or the prediction, or the machine":

- predicted vs measured time per shape shows where the cost model is off (a CPU row count whose
  kernels are slower than the fit says, a draft shape that costs more than its forwards sum to);
- expected vs committed tokens shows whether acceptance estimates run high where they select
  (the adaptive arm's own per-sequence estimates; another arm's sequences, on an engine of their
  own, at the model's engine-wide estimate);
- the same shape measured in two arms at different times shows how much the machine drifted.

Steps without decodes (a prefill alone) get a line too, and every run ends with a ``kind: run``
line (its wall time), so ``wall_time_table`` can say where each arm's time went: pure decode steps
at a full batch, pure decode steps below it (a batch filling or draining), steps carrying prefill
rows, and time between steps. ``summarize`` groups pure decode steps by (arm, decodes, sorted k's)
into a markdown table.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import TextIO

from engine.sequence import Sequence
from specdec.controller.acceptance import expected_tokens_table
from specdec.controller.adaptive import AdaptiveController
from specdec.controller_base import SpeculationController, StepObservation


class TracingController:
    """Implements ``SpeculationController`` by delegation; writes one JSON line per step.

    Args:
        inner: the controller that decides.
        model: the adaptive controller whose cost model and acceptance estimates price each step
            (may be ``inner`` itself).
        sink: where the JSON lines go.
        tags: fields added to every line (arm, workload, concurrency, round).
    """

    def __init__(
        self,
        inner: SpeculationController,
        model: AdaptiveController,
        sink: TextIO,
        tags: dict[str, object],
    ) -> None:
        self.inner = inner
        self.model = model
        self.sink = sink
        self.tags = tags
        self._expected: dict[int, list[float]] = {}
        self._ks: list[int] = []
        self._predicted_step: float | None = None
        self._inputs: dict[str, object] | None = None  # what the adaptive decision weighed

    def expect_prefill(self, rows: int, seqs: int) -> None:
        self.inner.expect_prefill(rows, seqs)

    def while_target_runs(self) -> None:
        self.inner.while_target_runs()

    @property
    def stops_drafts_early(self) -> bool:
        return self.inner.stops_drafts_early

    def keep_drafting(self, seqs: list[Sequence], confidences: list[list[float]]) -> list[bool]:
        return self.inner.keep_drafting(seqs, confidences)

    def choose_k(self, seqs: list[Sequence]) -> list[int]:
        ks = self.inner.choose_k(seqs)
        own = self.inner is self.model
        prior = self.model.acceptance.prior()
        # Expected tokens per draft length, read at the length actually drafted: a draft stopped
        # early by its confidence is judged by what that length was expected to commit. Another
        # arm's sequences live on another engine whose sequence ids the model's tracker also
        # uses for its own, so they are priced at its engine-wide estimate.
        self._expected = {
            s.seq_id: expected_tokens_table(
                self.model.acceptance.estimate(s.seq_id, prior) if own else prior
            )
            for s in seqs
        }
        self._ks = list(ks)
        self._predicted_step = self.model.predicted_step_time_s if own else None
        self._inputs = self.model.decision_inputs(seqs) if own and seqs else None
        return ks

    def observe(self, obs: StepObservation) -> None:
        decodes = [o for o in obs.outcomes if o.seq.seq_id in self._expected]
        line: dict[str, object] = {
            **self.tags,
            "kind": "step",
            "t": time.perf_counter(),
            "step_s": obs.step_time,
            "rows": obs.num_target_tokens,
            "seqs": obs.num_seqs,
            "decodes": len(self._expected),
            "prefill_rows": obs.num_target_tokens - sum(1 + o.num_drafted for o in decodes),
            "target_s": max(obs.step_time - obs.draft_time, 0.0),
            "draft_s": obs.draft_time,
        }
        if self._expected:
            cost = self.model.cost
            # Prices are kept at the reference speed; at the speed the model believed the
            # machine ran at when it decided, they are predictions of this step's seconds.
            speed = cost.speed_index
            plain_rows = obs.num_target_tokens - sum(o.num_drafted for o in decodes)
            line |= {
                "ks": self._ks,  # decided (the scheduler may clip a k near max_tokens)
                "drafted": [o.num_drafted for o in decodes],  # verified
                "speed_index": speed,
                "predicted_target_s": speed * cost.target_time(obs.num_target_tokens, obs.num_seqs),
                "predicted_draft_s": speed * cost.draft_time(obs.draft_forwards),
                # the same step with every decode plain: what speculating was weighed against
                "predicted_plain_s": speed * cost.target_time(plain_rows, obs.num_seqs),
                "predicted_step_s": self._predicted_step,
                "draft_forwards": obs.draft_forwards,
                "expected_tokens": sum(
                    self._expected[o.seq.seq_id][o.num_drafted] for o in decodes
                ),
                "committed_tokens": sum(1 + o.num_accepted for o in decodes),
            }
            if self._inputs is not None:
                line["decision"] = self._inputs
        self.sink.write(json.dumps(line) + "\n")
        self._expected, self._inputs = {}, None
        self.inner.observe(obs)

    def stats(self) -> dict:
        return self.inner.stats()

    def end_run(self, wall_s: float, output_tokens: int) -> None:
        """Close a run with its wall time (the denominator of its throughput)."""
        line = {**self.tags, "kind": "run", "wall_s": wall_s, "output_tokens": output_tokens}
        self.sink.write(json.dumps(line) + "\n")


def _steps(lines: Iterable[dict]) -> list[dict]:
    return [line for line in lines if line.get("kind", "step") == "step"]


def summarize(lines: Iterable[dict], min_steps: int = 3) -> str:
    """Markdown table of pure decode steps (no prefill rows) by (arm, decodes, sorted k's):
    medians of measured and predicted target/draft ms, mean expected and committed tokens, and
    measured vs predicted tokens/s."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for line in _steps(lines):
        if line["prefill_rows"] == 0 and line["decodes"] > 0:
            key = (line.get("workload", ""), line.get("concurrency", 0), line.get("arm", ""))
            groups[(*key, line["decodes"], tuple(sorted(line["ks"])))].append(line)
    out = [
        "| workload | c | arm | decodes | k's | steps | target ms (pred) | draft ms (pred) "
        "| tokens exp / got | tok/s (pred) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, steps in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        if len(steps) < min_steps:
            continue

        def med(field: str, steps: list[dict] = steps) -> float:
            return statistics.median(s[field] for s in steps)

        t, pt = med("target_s"), med("predicted_target_s")
        d, pd = med("draft_s"), med("predicted_draft_s")
        exp = statistics.fmean(s["expected_tokens"] for s in steps)
        got = statistics.fmean(s["committed_tokens"] for s in steps)
        workload, c, arm, decodes, ks = key
        out.append(
            f"| {workload} | {c} | {arm} | {decodes} | {','.join(map(str, ks))} | {len(steps)} "
            f"| {t * 1e3:.0f} ({pt * 1e3:.0f}) | {d * 1e3:.0f} ({pd * 1e3:.0f}) "
            f"| {exp:.2f} / {got:.2f} | {got / max(t + d, 1e-9):.2f} ({exp / max(pt + pd, 1e-9):.2f}) |"
        )
    return "\n".join(out) + "\n"


def wall_time_table(lines: Iterable[dict]) -> str:
    """Markdown table: where each arm's wall time went, per (workload, concurrency, arm), as the
    median over its runs of seconds (and steps) in pure decode steps at ``concurrency`` decodes,
    pure decode steps with fewer (the batch filling up or draining), steps carrying prefill rows
    (prefill alone or beside decodes), and between steps (the driver, request bookkeeping)."""
    runs: dict[tuple, dict[int, dict[str, float]]] = defaultdict(dict)
    for line in lines:
        key = (line.get("workload", ""), line.get("concurrency", 0), line.get("arm", ""))
        acc = runs[key].setdefault(
            line.get("round", 0),
            {"full": 0.0, "n_full": 0, "part": 0.0, "n_part": 0, "prefill": 0.0, "n_prefill": 0},
        )
        if line.get("kind") == "run":
            acc["wall"] = line["wall_s"]
            continue
        kind = "prefill" if line["prefill_rows"] > 0 else "part"
        if kind == "part" and line["decodes"] >= line.get("concurrency", 0):
            kind = "full"
        acc[kind] += line["step_s"]
        acc[f"n_{kind}"] += 1
    out = [
        "| workload | c | arm | runs | wall s | full-batch decode s (steps) "
        "| partial-batch decode s (steps) | prefill-carrying s (steps) | between steps s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, by_round in sorted(runs.items(), key=lambda kv: tuple(map(str, kv[0]))):
        done = [r for r in by_round.values() if "wall" in r]
        if not done:
            continue

        def med(field: str, done: list[dict[str, float]] = done) -> float:
            return statistics.median(r[field] for r in done)

        between = statistics.median(r["wall"] - r["full"] - r["part"] - r["prefill"] for r in done)
        workload, c, arm = key
        out.append(
            f"| {workload} | {c} | {arm} | {len(done)} | {med('wall'):.1f} "
            f"| {med('full'):.1f} ({med('n_full'):.0f}) | {med('part'):.1f} ({med('n_part'):.0f}) "
            f"| {med('prefill'):.1f} ({med('n_prefill'):.0f}) | {between:.2f} |"
        )
    return "\n".join(out) + "\n"
