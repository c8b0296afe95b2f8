"""Serving metrics from per-request timelines, and SLO parsing for goodput.

Definitions (all latencies in seconds; reports print milliseconds):

- TTFT (time to first token): first streamed output - request sent.
- E2E (end-to-end latency): last byte of the response - request sent.
- TPOT (time per output token): (E2E - TTFT) / (output tokens - 1), the mean gap between tokens
  after the first; undefined (None) for a one-token output.
- ITL (inter-token latency): the gaps between successive streamed chunks that carry output. A
  speculative step can commit several tokens that arrive in one chunk, so ITL is a per-chunk
  quantity, while TPOT is per token.
- Percentiles interpolate linearly between order statistics (numpy's default).
- Request throughput = completed requests / benchmark duration; output token throughput = output
  tokens / duration; total token throughput counts prompt tokens too.
- Goodput = completed requests that meet every SLO / duration.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from specdec.engine.errors import SpecdecError

# SLO keys -> human name; values are given in milliseconds on the command line.
SLO_KEYS = {"ttft": "time to first token", "tpot": "time per output token", "e2e": "end-to-end"}


class SLOParseError(SpecdecError):
    """An --slo string that does not parse."""


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are one clock's seconds (time.perf_counter())."""

    send_time: float
    first_token_time: float | None = None
    end_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with output
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    arm: str | None = None  # as the server reported it (X-Specdec-Arm)
    speculative: dict | None = None  # the server's usage.speculative, when it sends one

    @property
    def success(self) -> bool:
        return self.error is None and self.end_time is not None and self.output_tokens > 0

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.send_time

    @property
    def e2e(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None when there is no second token."""
        ttft, e2e = self.ttft, self.e2e
        if ttft is None or e2e is None or self.output_tokens < 2:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


@dataclass(frozen=True)
class Summary:
    """Mean, median, p90 and p99 of a sample (None when the sample is empty)."""

    count: int
    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None

    def scaled(self, factor: float) -> Summary:
        def s(v: float | None) -> float | None:
            return None if v is None else v * factor

        return Summary(self.count, s(self.mean), s(self.median), s(self.p90), s(self.p99))

    def to_dict(self) -> dict:
        return {
            "count": self.count,
            "mean": self.mean,
            "median": self.median,
            "p90": self.p90,
            "p99": self.p99,
        }


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100), linear interpolation between the closest ranks."""
    if not values:
        raise ValueError("percentile of an empty sample")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize(values: Iterable[float | None]) -> Summary:
    sample = [float(v) for v in values if v is not None]
    if not sample:
        return Summary(0, None, None, None, None)
    return Summary(
        count=len(sample),
        mean=float(np.mean(sample)),
        median=percentile(sample, 50),
        p90=percentile(sample, 90),
        p99=percentile(sample, 99),
    )


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft=500,tpot=50"`` (milliseconds) -> ``{"ttft": 0.5, "tpot": 0.05}`` (seconds).

    Keys: ttft, tpot, e2e. Each at most once; values are positive numbers of milliseconds.
    """
    if text is None:
        return {}
    if not text.strip():
        raise SLOParseError("--slo is empty: use e.g. --slo ttft=500,tpot=50 (milliseconds)")
    slo: dict[str, float] = {}
    for part in text.split(","):
        item = part.strip()
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep:
            raise SLOParseError(
                f"bad SLO {item!r} in {text!r}: expected key=milliseconds, e.g. ttft=500"
            )
        if key not in SLO_KEYS:
            raise SLOParseError(
                f"unknown SLO key {key!r} in {text!r}; known keys: {', '.join(SLO_KEYS)}"
            )
        if key in slo:
            raise SLOParseError(f"SLO key {key!r} given twice in {text!r}")
        try:
            ms = float(value.strip().removesuffix("ms"))
        except ValueError:
            raise SLOParseError(
                f"SLO {key} value {value.strip()!r} is not a number of milliseconds"
            ) from None
        if not ms > 0 or ms == float("inf"):
            raise SLOParseError(f"SLO {key} must be a positive number of milliseconds, got {ms:g}")
        slo[key] = ms / 1000.0
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """True when a successful request is within every SLO. An undefined TPOT (one output token)
    has no decode phase to violate the TPOT target, so it counts as met."""
    if not record.success:
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2e": record.e2e}
    return all(values[key] is None or values[key] <= limit for key, limit in slo.items())


def aggregate(
    records: Sequence[RequestRecord], duration: float, slo: dict[str, float] | None = None
) -> dict:
    """Benchmark metrics of one run (one arm at one load level) as a JSON-ready dict."""
    done = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    rate = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    result: dict = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(failed),
        "errors": sorted({r.error for r in failed if r.error})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": rate(len(done)),
        "output_token_throughput": rate(out_tokens),
        "total_token_throughput": rate(in_tokens + out_tokens),
        "ttft_ms": summarize(r.ttft for r in done).scaled(1000).to_dict(),
        "tpot_ms": summarize(r.tpot for r in done).scaled(1000).to_dict(),
        "itl_ms": summarize(x for r in done for x in r.itls).scaled(1000).to_dict(),
        "e2e_ms": summarize(r.e2e for r in done).scaled(1000).to_dict(),
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in done)
        result["slo_ms"] = {k: v * 1000 for k, v in slo.items()}
        result["good_requests"] = good
        result["goodput"] = rate(good)
    spec = _speculation_summary(done)
    if spec:
        result["speculative"] = spec
    return result


def _speculation_summary(records: Sequence[RequestRecord]) -> dict:
    """Acceptance over the run, from the server's per-request usage.speculative counters."""
    drafted = accepted = 0
    lengths: list[float] = []
    for r in records:
        s = r.speculative or {}
        d = s.get("draft_tokens", s.get("num_draft_tokens"))
        a = s.get("accepted_tokens", s.get("num_accepted_tokens"))
        if d is None or a is None:
            continue
        drafted += int(d)
        accepted += int(a)
        if s.get("mean_accepted_length"):
            lengths.append(float(s["mean_accepted_length"]))
    if not drafted:  # plain decode (or a proposer that never found a draft)
        return {}
    return {
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": sum(lengths) / len(lengths) if lengths else None,
    }
