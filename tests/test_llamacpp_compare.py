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
    arm = "bfloat16:none/int4"
    runs = [
        {"group": "code", "llama_cpp_plain": 10.0, f"{arm} plain": 6.0,
         f"{arm} adaptive": 12.0, f"{arm} spec_equals_plain": True},
        {"group": "code", "llama_cpp_plain": 14.0, f"{arm} plain": 8.0,
         f"{arm} adaptive": 16.0, f"{arm} spec_equals_plain": True},
        {"group": "chat", "llama_cpp_plain": 10.0, f"{arm} plain": 5.0,
         f"{arm} adaptive": 9.0, f"{arm} spec_equals_plain": False},
    ]  # fmt: skip
    summary = compare.summarize(runs, [arm])
    assert summary["code"] == {
        "llama_cpp_plain": 12.0,
        f"{arm} plain": 7.0,
        f"{arm} adaptive": 14.0,
    }
    result = {
        "command": "python -m specdec.evals.baselines.llamacpp_compare",
        "commit": "abc",
        "environment": {"cpu": "Some CPU", "torch_threads": 2},
        "cpu_flags": "avx2",
        "arms": {arm: "bfloat16"},
        "llama_cpp_gguf": "target.gguf",
        "llama_cpp_file_type": "Q4_K_M",
        "max_tokens": 128,
        "summary": summary,
        "runs": runs,
    }
    md = compare.markdown(result)
    assert "| code | 12.00 | 7.00 (0.58x) | 14.00 (1.17x) |" in md
    assert "| chat | 10.00 | 5.00 (0.50x) | 9.00 (0.90x) |" in md
    assert "Some CPU" in md and "on every prompt: False" in md
    assert "| prompts | llama.cpp Q4_K_M plain |" in md
    assert compare._common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2


def test_gguf_file_type_reads_llama_cpps_name(tmp_path):
    from helpers_weights import tiny_model, write_gguf

    path = write_gguf(tiny_model("qwen2", tied=False), tmp_path / "tiny.gguf")
    assert compare.gguf_file_type(str(path)) == "ALL_F32"
