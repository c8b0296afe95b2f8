"""The llama.cpp comparison script: its report, and a clear refusal where llama-cpp-python is
not installed (it is not a dependency of this project)."""

from __future__ import annotations

import importlib.util

import pytest
from specdec.evals.baselines import llamacpp_compare as compare


def test_without_llama_cpp_python_it_says_how_to_get_it(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def no_llama_cpp(name, *args, **kwargs):
        return None if name == "llama_cpp" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", no_llama_cpp)
    with pytest.raises(SystemExit, match="pip install llama-cpp-python"):
        compare.main(["--output-dir", "/nonexistent"])


def test_report_gives_medians_and_the_ratio_to_llama_cpp():
    runs = [
        {"group": "code", "llama_cpp_q4_k_m_plain": 10.0, "specdec_plain": 6.0,
         "specdec_adaptive": 12.0, "specdec_spec_equals_plain": True},
    ]  # fmt: skip
    result = {
        "command": "python -m specdec.evals.baselines.llamacpp_compare",
        "commit": "abc",
        "environment": {"cpu": "Some CPU", "torch_threads": 2},
        "cpu_flags": "avx2",
        "specdec_dtype": "bfloat16",
        "llama_cpp_gguf": "target.gguf",
        "max_tokens": 128,
        "summary": {"code": {k: runs[0][k] for k in compare.ARMS}},
        "runs": runs,
    }
    md = compare.markdown(result)
    assert "| code | 10.00 | 6.00 | 12.00 | 1.20 |" in md
    assert "Some CPU" in md and "on every prompt: True" in md
    assert compare._common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
