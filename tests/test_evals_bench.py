"""`specdec bench` against a live tiny-model `specdec serve` process, in both arms."""

from __future__ import annotations

import argparse
import json

import pytest
from helpers_server import ServerProcess, build_script_model, free_port, start_servers
from specdec.api.cli import main as cli_main
from specdec.evals.bench_runner import ServerUnreachableError
from specdec.evals.commands import bench as bench_command
from specdec.evals.datasets import DatasetError
from specdec.evals.metrics import SLOParseError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The script model as target and as draft: greedy drafts are always accepted."""
    root = tmp_path_factory.mktemp("bench-server")
    build_script_model(root / "model")
    proc = ServerProcess(
        root / "model",
        root / "model",
        ["--served-model-name", "tiny", "--num-speculative-tokens", "3"],
        root / "server.log",
    )
    start_servers(proc)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-data") / "prompts.jsonl"
    lines = [
        {"id": "a", "category": "chat", "messages": [{"role": "user", "content": "Hi"}]},
        {"id": "b", "category": "chat", "messages": [{"role": "user", "content": "Hello"}]},
        {"id": "c", "category": "code", "prompt": "def f(x):"},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_command.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bench_ab_sweep_against_a_live_server(server, dataset, tmp_path, capsys):
    out = tmp_path / "out"
    args = bench_args(
        "--base-url", server.url, "--dataset", str(dataset), "--num-prompts", "3",
        "--warmup", "1", "--max-tokens", "8", "--concurrency", "1,3", "--ab", "--speculative", "on",
        "--slo", "ttft=60000,tpot=60000", "--output-dir", str(out), "--no-progress",
    )  # fmt: skip
    assert bench_command.run(args) == 0
    printed = capsys.readouterr().out
    assert "spec c=1" in printed and "plain c=3" in printed
    assert "spec / plain at concurrency 3" in printed

    result = json.loads((out / "bench.json").read_text())
    assert result["meta"]["model"] == "tiny"
    runs = result["runs"]
    assert [(r["arm"], r["concurrency"]) for r in runs] == [
        ("spec", 1),
        ("plain", 1),
        ("spec", 3),
        ("plain", 3),
    ]
    for run in runs:
        m = run["metrics"]
        assert (m["completed"], m["failed"]) == (3, 0), m["errors"]
        # The server answered in the arm the request asked for (X-Specdec-Arm).
        assert run["server_arms"] == {run["arm"]: 3}
        assert m["total_output_tokens"] == sum(r["output_tokens"] for r in run["requests"])
        assert all(1 <= r["output_tokens"] <= 8 for r in run["requests"])
        assert 0 < m["ttft_ms"]["mean"] <= m["e2e_ms"]["mean"]
        assert m["ttft_ms"]["median"] <= m["ttft_ms"]["p90"] <= m["ttft_ms"]["p99"]
        assert m["tpot_ms"]["count"] >= 1 and m["itl_ms"]["count"] >= 1
        assert m["request_throughput"] == pytest.approx(3 / m["duration_s"])
        # Generous SLOs: every request is good, so goodput equals request throughput.
        assert m["goodput"] == pytest.approx(m["request_throughput"])
        for r in run["requests"]:
            assert r["tpot_ms"] == pytest.approx(
                (r["e2e_ms"] - r["ttft_ms"]) / (r["output_tokens"] - 1)
            )
    spec_runs = [r for r in runs if r["arm"] == "spec"]
    plain_runs = [r for r in runs if r["arm"] == "plain"]
    # The draft is the target itself: greedy drafts are accepted.
    for run in spec_runs:
        assert run["metrics"]["speculative"]["acceptance_rate"] > 0.9
        assert run["metrics"]["speculative"]["mean_accepted_length"] > 1.5
    assert all("speculative" not in r["metrics"] for r in plain_runs)
    # Same workload in both arms: the same prompts in the same order.
    assert [x["prompt_id"] for x in spec_runs[0]["requests"]] == ["a", "c", "b"]
    assert [x["prompt_id"] for x in plain_runs[0]["requests"]] == ["a", "c", "b"]
    for name in ("latency_percentiles.png", "throughput_tpot_vs_concurrency.png"):
        assert (out / name).read_bytes().startswith(PNG_MAGIC)


def test_bench_poisson_arrivals_completions_endpoint(server, dataset, tmp_path):
    args = bench_args(
        "--base-url", server.url, "--dataset", str(dataset), "--num-prompts", "4",
        "--warmup", "0", "--no-prime-cache", "--max-tokens", "4", "--endpoint", "completions",
        "--request-rate", "20", "--burstiness", "0.5", "--speculative", "off",
        "--output-dir", str(tmp_path), "--no-progress",
    )  # fmt: skip
    assert bench_command.run(args) == 0
    (run,) = json.loads((tmp_path / "bench.json").read_text())["runs"]
    assert (run["arm"], run["concurrency"], run["request_rate"]) == ("plain", None, 20.0)
    assert run["metrics"]["completed"] == 4 and run["server_arms"] == {"plain": 4}


def test_failed_requests_make_a_clear_non_zero_exit(server, dataset, tmp_path, capsys):
    args = bench_args(
        "--base-url", server.url, "--dataset", str(dataset), "--num-prompts", "2",
        "--warmup", "0", "--model", "no-such-model", "--output-dir", str(tmp_path),
        "--no-progress",
    )  # fmt: skip
    assert bench_command.run(args) == 1
    err = capsys.readouterr().err
    assert "2 of 2 requests failed" in err and "HTTP 404" in err


def test_unreachable_server_is_a_clear_error(dataset):
    args = bench_args("--base-url", f"http://127.0.0.1:{free_port()}", "--dataset", str(dataset))
    with pytest.raises(ServerUnreachableError, match="cannot reach the server at .*specdec serve"):
        bench_command.run(args)


def test_unreachable_server_through_the_cli(dataset, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    code = cli_main(["bench", "--base-url", url, "--dataset", str(dataset)])
    err = capsys.readouterr().err
    assert code != 0
    assert f"error: cannot reach the server at {url}" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "error", "needle"),
    [
        (["--slo", "ttft=soon"], SLOParseError, "not a number"),
        (["--categories", "poetry"], DatasetError, "unknown category 'poetry'"),
        (["--concurrency", "0"], Exception, "out of range"),
        (["--request-rate", "0"], Exception, "--request-rate must be > 0"),
        (["--num-prompts", "0"], Exception, "--num-prompts must be >= 1"),
    ],
)
def test_bad_input_is_refused_before_contacting_the_server(argv, error, needle):
    # The port is closed: reaching the server check would raise ServerUnreachableError instead.
    args = bench_args("--base-url", f"http://127.0.0.1:{free_port()}", *argv)
    with pytest.raises(error, match=needle) as info:
        bench_command.run(args)
    assert not isinstance(info.value, ServerUnreachableError)


def test_empty_and_malformed_prompt_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    for path, needle in ((empty, "empty"), (bad, "bad.jsonl:2")):
        with pytest.raises(DatasetError, match=needle):
            bench_command.run(bench_args("--dataset", str(path)))
