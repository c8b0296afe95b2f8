"""`specdec generate` and `specdec pull --list` as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers_server import build_script_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "model"
    build_script_model(path)
    return path


def specdec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specdec.api.cli", "--log-level", "WARNING", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_generate_streams_text_and_reports_speculation(model_dir):
    res = specdec(
        "generate", "Hello", "--model", str(model_dir), "--draft-model", str(model_dir),
        "--max-tokens", "12", "--speculative", "on", "--stats", "--no-controller-warmup",
        "--kv-cache-memory", "0.05", "--max-model-len", "256",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "Hi é中👋!" in res.stdout
    assert "12 tokens, finish=length, acceptance=1.00" in res.stderr


def test_generate_unknown_model_is_a_clear_error():
    res = specdec("generate", "x", "--model", "/no/such/model", "--speculative-method", "none")
    assert res.returncode == 2
    assert "no model named or found" in res.stderr and "Traceback" not in res.stderr


def test_pull_lists_the_default_pair():
    res = specdec("pull", "--list")
    assert res.returncode == 0
    assert res.stdout.split() == ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"]
