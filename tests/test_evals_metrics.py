"""Serving-metric definitions on hand-made timelines, SLO parsing, arrivals and prompt sets."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from specdec.evals.bench_runner import choose_arms, select_prompts
from specdec.evals.datasets import (
    CATEGORIES,
    DatasetError,
    Prompt,
    load_categories,
    load_prompt_file,
    parse_categories,
)
from specdec.evals.greedy_check import compare_greedy, first_difference
from specdec.evals.loadgen import arrival_offsets
from specdec.evals.metrics import (
    RequestRecord,
    SLOParseError,
    aggregate,
    meets_slo,
    parse_slo,
    percentile,
    summarize,
)


def timeline(send, chunks, tokens, end=None) -> RequestRecord:
    """A request sent at `send` whose output chunks arrive at `chunks`."""
    return RequestRecord(
        send_time=send,
        first_token_time=chunks[0] if chunks else None,
        end_time=end if end is not None else chunks[-1],
        chunk_times=list(chunks),
        output_tokens=tokens,
        prompt_tokens=10,
    )


def test_ttft_tpot_itl_e2e_on_a_hand_made_timeline():
    # Sent at 10.0; chunks at 10.5, 10.6, 10.8, 11.0 (the second-to-last chunk holds 2 tokens).
    r = timeline(10.0, [10.5, 10.6, 10.8, 11.0], tokens=5, end=11.1)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.1)
    # (e2e - ttft) / (tokens - 1) = 0.6 / 4
    assert r.tpot == pytest.approx(0.15)
    assert r.itls == pytest.approx([0.1, 0.2, 0.2])
    assert r.success


def test_tpot_undefined_for_a_single_token_and_unset_without_first_token():
    assert timeline(0.0, [0.3], tokens=1).tpot is None
    r = RequestRecord(send_time=0.0, end_time=1.0, output_tokens=0, error="HTTP 400: bad")
    assert r.ttft is None and r.tpot is None and not r.success


def test_percentiles_interpolate_linearly():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)  # 1 + 0.9 * 3 ranks -> 3.7
    assert percentile(values, 99) == pytest.approx(3.97)
    s = summarize([4.0, None, 1.0, 3.0, 2.0])
    assert (s.count, s.mean, s.median, s.p90) == (4, 2.5, 2.5, pytest.approx(3.7))
    empty = summarize([])
    assert empty.count == 0 and empty.mean is None and empty.p99 is None


def test_aggregate_throughput_and_goodput():
    records = [
        timeline(0.0, [0.2, 0.3, 0.4], tokens=3),  # ttft 200 ms, tpot 100 ms
        timeline(0.0, [0.6, 1.0], tokens=2),  # ttft 600 ms, tpot 400 ms
        timeline(0.5, [0.9, 1.0, 1.1, 1.2], tokens=4),  # ttft 400 ms, tpot 100 ms
        RequestRecord(send_time=1.0, end_time=1.5, error="HTTP 503: busy"),
    ]
    m = aggregate(records, duration=2.0, slo=parse_slo("ttft=500,tpot=150"))
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["errors"] == ["HTTP 503: busy"]
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_token_throughput"] == pytest.approx(9 / 2.0)
    assert m["total_token_throughput"] == pytest.approx((9 + 30) / 2.0)
    assert m["ttft_ms"]["mean"] == pytest.approx(400.0)
    assert m["tpot_ms"]["median"] == pytest.approx(100.0)
    assert m["e2e_ms"]["p90"] == pytest.approx(percentile([400, 1000, 700], 90))
    # Only the first and third meet ttft <= 500 ms and tpot <= 150 ms.
    assert m["good_requests"] == 2
    assert m["goodput"] == pytest.approx(1.0)
    json.dumps(m)  # JSON-ready


def test_meets_slo_per_key():
    r = timeline(0.0, [0.2, 0.3, 0.4], tokens=3)
    assert meets_slo(r, {"ttft": 0.2, "tpot": 0.1, "e2e": 0.4})
    assert not meets_slo(r, {"ttft": 0.19})
    assert not meets_slo(r, {"e2e": 0.39})
    assert meets_slo(timeline(0.0, [0.1], tokens=1), {"tpot": 0.001})  # no decode phase


def test_parse_slo_accepts_milliseconds():
    assert parse_slo("ttft=500,tpot=50") == {"ttft": 0.5, "tpot": 0.05}
    assert parse_slo(" e2e = 2000ms ") == {"e2e": 2.0}
    assert parse_slo(None) == {}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "empty"),
        ("ttft", "expected key=milliseconds"),
        ("latency=5", "unknown SLO key 'latency'"),
        ("ttft=fast", "not a number"),
        ("ttft=-5", "positive"),
        ("ttft=0", "positive"),
        ("ttft=inf", "positive"),
        ("ttft=5,ttft=6", "twice"),
    ],
)
def test_parse_slo_errors_are_clear(text, needle):
    with pytest.raises(SLOParseError, match=needle):
        parse_slo(text)


def test_arrivals_infinite_rate_and_gamma_statistics():
    assert arrival_offsets(3, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0]
    a = arrival_offsets(20001, 4.0, 1.0, seed=1)
    gaps = np.diff(a)
    assert a[0] == 0.0 and all(g >= 0 for g in gaps)
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)  # mean gap = 1 / rate
    assert gaps.var() == pytest.approx(0.25**2, rel=0.1)  # exponential: var = mean^2
    bursty = np.diff(arrival_offsets(20001, 4.0, 0.25, seed=1))
    assert bursty.mean() == pytest.approx(0.25, rel=0.1)
    assert bursty.var() == pytest.approx(0.25**2 / 0.25, rel=0.15)  # var = mean^2 / shape
    assert arrival_offsets(5, 2.0, 1.0, seed=3) == arrival_offsets(5, 2.0, 1.0, seed=3)


def test_greedy_check_reports_the_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    plain = {"a": [5, 6, 7, 8], "b": [1, 2]}
    assert compare_greedy(dict(plain), plain, {"a": "math", "b": "math"}, "ngram", 2) == []
    bad = compare_greedy({"a": [5, 6, 0, 8], "b": [1, 2]}, plain, {"a": "math"}, "ngram", 2)
    assert len(bad) == 1
    assert (bad[0].prompt_id, bad[0].position, bad[0].category) == ("a", 2, "math")
    assert "FAILURE" in bad[0].describe() and "output token 2" in bad[0].describe()
    missing = compare_greedy({"a": [5, 6, 7, 8]}, plain, {}, "ngram", 2)
    assert [m.prompt_id for m in missing] == ["b"]


def test_builtin_prompt_sets():
    assert len(CATEGORIES) == 7
    for cat in CATEGORIES:
        prompts = load_categories([cat])
        assert len(prompts) >= 20, cat
        assert len({p.id for p in prompts}) == len(prompts)
        for p in prompts:
            assert p.category == cat
            # Short enough for CPU runs, long enough to be a real request (30-300 tokens once a
            # chat template wraps them): roughly 80-1500 characters of English or code.
            assert 80 <= len(p.plain_text()) <= 1500, (p.id, len(p.plain_text()))
    chat = load_categories(["multi_turn_chat"])
    assert all(len(p.messages) >= 3 for p in chat)
    assert [len(load_categories(CATEGORIES, limit=2))] == [14]


def test_unknown_category_is_named():
    with pytest.raises(DatasetError, match="unknown category 'poetry'.*known: code_generation"):
        parse_categories("math,poetry")
    assert parse_categories("all") == list(CATEGORIES)


def test_prompt_file_errors_name_the_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(DatasetError, match="empty"):
        load_prompt_file(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n\n{"prompt": "unterminated\n')
    with pytest.raises(DatasetError, match=r"bad\.jsonl:3: not valid JSON"):
        load_prompt_file(bad)
    cases = {
        '["a list"]': "expected a JSON object",
        '{"text": "x"}': "exactly one of",
        '{"prompt": ""}': "non-empty string",
        '{"messages": [{"role": "robot", "content": "x"}]}': "role must be one of",
        '{"messages": [{"role": "user"}]}': 'string "content"',
    }
    for line, needle in cases.items():
        f = tmp_path / "case.jsonl"
        f.write_text('{"prompt": "ok"}\n' + line + "\n")
        with pytest.raises(DatasetError, match=f"case.jsonl:2: .*{needle}"):
            load_prompt_file(f)
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompt_file(tmp_path / "nope.jsonl")
    good = tmp_path / "good.jsonl"
    good.write_text(
        '{"id": "x1", "category": "mine", "prompt": "hello"}\n'
        '{"messages": [{"role": "user", "content": "hi"}]}\n'
    )
    p1, p2 = load_prompt_file(good)
    assert (p1.id, p1.category, p1.chat_messages()) == (
        "x1",
        "mine",
        [{"role": "user", "content": "hello"}],
    )
    assert (p2.id, p2.category, p2.plain_text()) == ("good-02", "good", "hi")


def test_select_prompts_interleaves_categories_and_cycles():
    pool = [Prompt(f"{c}{i}", c, text="t") for c in "ab" for i in range(3)]
    assert [p.id for p in select_prompts(pool, 4)] == ["a0", "b0", "a1", "b1"]
    assert len(select_prompts(pool, 8)) == 8
    assert select_prompts(pool, 8)[6].id == "a0"


def test_arms():
    assert [(a.name, a.speculative) for a in choose_arms(True, None)] == [
        ("spec", "auto"),
        ("plain", "off"),
    ]
    assert choose_arms(True, "on")[0].speculative == "on"
    assert [(a.name, a.speculative) for a in choose_arms(False, "off")] == [("plain", "off")]
    assert choose_arms(False, None)[0].speculative is None
