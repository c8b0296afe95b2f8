"""Rows of the eval report: per (configuration, temperature, category), plus an "all" row.

Definitions:
- tokens_per_s = output tokens / summed request wall time (submission to finish, prefill included).
- speedup = tokens_per_s of the speculative configuration / tokens_per_s of plain decode, same
  prompts, same temperature, same run. speedup_cpu is the same ratio with this process's CPU time
  in place of wall time: on a machine shared with other jobs, wall time drifts with their load
  much more than CPU time; the two agree on a quiet machine.
- acceptance_rate = accepted draft tokens / drafted tokens.
- acceptance_per_pos[j] = accepted_per_pos[j] / drafted_per_pos[j]: of the speculative steps that
  drafted position j+1, the share in which it was accepted (which needs every earlier position
  accepted too). The counts can only fall with j; the ratio usually does, but need not when some
  steps draft fewer than k tokens (an n-gram miss, or the end of max_tokens).
- mean_accepted_length = tokens committed per target forward during decode, counting the bonus or
  corrected token (Spec-Bench's "mean accepted tokens"); 1.0 is plain decode.
- draft_time_share / verify_time_share = proposer time / target forward + sampling time, each over
  the summed engine step time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from specdec.engine.sequence import SpecStats
from specdec.evals.runs import ConfigRuns, PromptRun
from specdec.evals.step_timer import StepTotals

if TYPE_CHECKING:
    from specdec.evals.greedy_check import Mismatch

ALL = "all"


@dataclass
class PlainRow:
    temperature: float
    category: str
    num_prompts: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    mean_ttft_ms: float | None
    cpu_seconds: float


@dataclass
class SpecRow:
    proposer: str
    k: int
    temperature: float
    category: str
    num_prompts: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    mean_ttft_ms: float | None
    speedup: float | None
    cpu_seconds: float
    speedup_cpu: float | None
    acceptance_rate: float
    acceptance_per_pos: list[float]
    accepted_per_pos: list[int]  # [k] steps in which position j was accepted
    drafted_per_pos: list[int]  # [k] steps that drafted position j
    mean_accepted_length: float
    num_spec_steps: int
    num_draft_tokens: int
    num_accepted_tokens: int
    draft_time_share: float | None
    verify_time_share: float | None
    greedy_identical: bool | None  # None when the temperature is not 0 (outputs may differ)
    num_mismatches: int
    tree_nodes: int = 0  # > 0: the rows of token trees of at most this many nodes, k deep
    nodes_per_tree_step: float = 0.0
    accepted_per_rank: list[int] = field(default_factory=list)  # accepted nodes by sibling rank


@dataclass
class BaselineRow:
    name: str  # "hf_plain" | "hf_assisted"
    k: int | None
    temperature: float
    category: str
    num_prompts: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    speedup_vs_hf_plain: float | None
    speedup_vs_engine_plain: float | None
    cpu_seconds: float
    speedup_cpu_vs_hf_plain: float | None
    matches_engine_plain: int  # prompts whose output equals the engine's greedy plain output


@dataclass
class EvalReport:
    meta: dict = field(default_factory=dict)
    plain: list[PlainRow] = field(default_factory=list)
    spec: list[SpecRow] = field(default_factory=list)
    baselines: list[BaselineRow] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)
    skipped_prompts: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def categories(self) -> list[str]:
        return list(dict.fromkeys(r.category for r in self.plain))

    def to_dict(self) -> dict:
        return {
            "meta": self.meta,
            "ok": self.ok,
            "plain": [asdict(r) for r in self.plain],
            "spec": [asdict(r) for r in self.spec],
            "baselines": [asdict(r) for r in self.baselines],
            "failures": self.failures,
            "skipped_prompts": self.skipped_prompts,
        }


def with_all(by_category: Mapping[str, Sequence[PromptRun]]) -> dict[str, list[PromptRun]]:
    """The per-category runs plus an "all" entry holding every run."""
    out = {c: list(rs) for c, rs in by_category.items()}
    out[ALL] = [r for rs in by_category.values() for r in rs]
    return out


def _rate(runs: Sequence[PromptRun]) -> tuple[int, float, float]:
    tokens = sum(len(r.output_token_ids) for r in runs)
    seconds = sum(r.seconds for r in runs)
    return tokens, seconds, tokens / seconds if seconds > 0 else 0.0


def _cpu_rate(runs: Sequence[PromptRun]) -> tuple[float, float]:
    """(CPU seconds, output tokens per CPU second)."""
    tokens = sum(len(r.output_token_ids) for r in runs)
    cpu = sum(r.cpu_seconds for r in runs)
    return cpu, tokens / cpu if cpu > 0 else 0.0


def _mean_ttft_ms(runs: Sequence[PromptRun]) -> float | None:
    ttfts = [r.ttft for r in runs if r.ttft is not None]
    return 1000 * sum(ttfts) / len(ttfts) if ttfts else None


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def plain_rows(
    temperature: float, by_category: Mapping[str, Sequence[PromptRun]]
) -> list[PlainRow]:
    rows = []
    for cat, runs in with_all(by_category).items():
        tokens, seconds, tps = _rate(runs)
        cpu = _cpu_rate(runs)[0]
        rows.append(
            PlainRow(temperature, cat, len(runs), tokens, seconds, tps, _mean_ttft_ms(runs), cpu)
        )
    return rows


def spec_rows(
    proposer: str,
    k: int,
    temperature: float,
    runs: ConfigRuns,
    plain: Mapping[str, Sequence[PromptRun]],
    mismatches: Sequence[Mismatch],
    tree_nodes: int = 0,
) -> list[SpecRow]:
    plain_all = with_all(plain)
    steps = dict(runs.steps)
    steps[ALL] = StepTotals()
    for totals in runs.steps.values():
        steps[ALL].add(totals)
    rows = []
    for cat, cat_runs in with_all(runs.runs).items():
        stats = SpecStats()
        for r in cat_runs:
            stats.merge(r.spec_stats)
        tokens, seconds, tps = _rate(cat_runs)
        plain_tps = _rate(plain_all.get(cat, []))[2]
        cpu, cpu_tps = _cpu_rate(cat_runs)
        plain_cpu_tps = _cpu_rate(plain_all.get(cat, []))[1]
        n_bad = sum(1 for m in mismatches if cat in (ALL, m.category))
        rows.append(
            SpecRow(
                proposer=proposer,
                k=k,
                temperature=temperature,
                category=cat,
                num_prompts=len(cat_runs),
                output_tokens=tokens,
                seconds=seconds,
                tokens_per_s=tps,
                mean_ttft_ms=_mean_ttft_ms(cat_runs),
                speedup=_ratio(tps, plain_tps),
                cpu_seconds=cpu,
                speedup_cpu=_ratio(cpu_tps, plain_cpu_tps),
                acceptance_rate=stats.acceptance_rate,
                acceptance_per_pos=stats.acceptance_per_pos(),
                accepted_per_pos=list(stats.accepted_per_pos),
                drafted_per_pos=list(stats.drafted_per_pos),
                mean_accepted_length=stats.mean_accepted_length,
                num_spec_steps=stats.num_spec_steps,
                num_draft_tokens=stats.num_draft_tokens,
                num_accepted_tokens=stats.num_accepted_tokens,
                draft_time_share=steps.get(cat, StepTotals()).draft_share,
                verify_time_share=steps.get(cat, StepTotals()).verify_share,
                greedy_identical=(n_bad == 0) if temperature == 0 else None,
                num_mismatches=n_bad,
                tree_nodes=tree_nodes,
                nodes_per_tree_step=stats.nodes_per_tree_step,
                accepted_per_rank=list(stats.accepted_per_rank),
            )
        )
    return rows


def baseline_rows(
    name: str,
    k: int | None,
    runs: Mapping[str, Sequence[PromptRun]],
    hf_plain: Mapping[str, Sequence[PromptRun]],
    engine_plain: Mapping[str, Sequence[PromptRun]],
) -> list[BaselineRow]:
    hf_all, engine_all = with_all(hf_plain), with_all(engine_plain)
    rows = []
    for cat, cat_runs in with_all(runs).items():
        tokens, seconds, tps = _rate(cat_runs)
        reference = {r.prompt_id: r.output_token_ids for r in engine_all.get(cat, [])}
        same = sum(reference.get(r.prompt_id) == r.output_token_ids for r in cat_runs)
        rows.append(
            BaselineRow(
                name=name,
                k=k,
                temperature=0.0,
                category=cat,
                num_prompts=len(cat_runs),
                output_tokens=tokens,
                seconds=seconds,
                tokens_per_s=tps,
                speedup_vs_hf_plain=_ratio(tps, _rate(hf_all.get(cat, []))[2]),
                speedup_vs_engine_plain=_ratio(tps, _rate(engine_all.get(cat, []))[2]),
                cpu_seconds=_cpu_rate(cat_runs)[0],
                speedup_cpu_vs_hf_plain=_ratio(
                    _cpu_rate(cat_runs)[1], _cpu_rate(hf_all.get(cat, []))[1]
                ),
                matches_engine_plain=same,
            )
        )
    return rows
