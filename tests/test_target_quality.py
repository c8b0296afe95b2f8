"""The target-format quality program: KL divergence from the reference position by position,
top-1 agreement and perplexity, its arm syntax and its report."""

from __future__ import annotations

import json
import math

import pytest
import torch
from specdec.evals.formats import target_quality
from specdec.evals.formats.measure import next_token_logprobs, perplexity
from specdec.evals.formats.target_quality import TargetArm
from tiny_models import make_engine

IDS = [(7 * i + 3) % 97 + 1 for i in range(40)]


def test_divergence_is_the_kl_divergence_and_zero_against_itself():
    gen = torch.Generator().manual_seed(0)
    ref = torch.log_softmax(torch.randn(5, 50, generator=gen), -1)
    other = torch.log_softmax(torch.randn(5, 50, generator=gen), -1)
    want = torch.nn.functional.kl_div(other, ref, log_target=True, reduction="none").sum(-1)
    assert torch.allclose(target_quality.divergence(ref, other), want, atol=1e-6)
    assert torch.allclose(target_quality.divergence(ref, ref), torch.zeros(5))


def test_a_target_matches_itself_and_a_quantized_copy_diverges(target):
    reference = make_engine(target)
    free = reference.allocator.num_free_blocks
    chunks = [logp for logp, _ in next_token_logprobs(reference, IDS)]
    assert reference.allocator.num_free_blocks == free  # the text's blocks are handed back
    same = target_quality.compare(chunks, reference, IDS, min_context=1)
    assert same["positions"] == len(IDS) - 1
    assert same["kld_mean"] == 0.0 and same["kld_max"] == 0.0
    assert same["top1_agreement"] == 1.0 and same["delta_p_rms"] == 0.0
    assert math.isclose(same["perplexity"], perplexity(reference, IDS), rel_tol=1e-9)

    quantized = make_engine(target, quantization="int8")
    free = quantized.allocator.num_free_blocks
    lossy = target_quality.compare(chunks, quantized, IDS, min_context=1)
    assert quantized.allocator.num_free_blocks == free
    assert 0.0 < lossy["kld_median"] <= lossy["kld_p99"] <= lossy["kld_max"]
    assert lossy["kld_mean"] > 0.0 and lossy["delta_p_rms"] > 0.0
    assert 0.0 <= lossy["top1_agreement"] <= 1.0
    # From 16 tokens of context on: the first 15 positions are left out.
    later = target_quality.compare(chunks, quantized, IDS, min_context=16)
    assert later["positions"] == len(IDS) - 16


@pytest.mark.parametrize(
    "text, message",
    [
        ("bfloat16", "expected DTYPE:QUANTIZATION"),
        ("bfloat16:int8:fast", "expected DTYPE:QUANTIZATION"),
        ("bfloat16:int9", "quantization"),
        ("float16x:none", "dtype"),
    ],
)
def test_bad_arms_are_refused_with_the_syntax(text, message):
    with pytest.raises(ValueError, match=message):
        TargetArm.parse(text)


def test_arms_keep_their_names_and_a_bad_one_stops_the_program_before_any_model_loads(capsys):
    for text in ("bfloat16:int8", "bfloat16:int4:torch-layers", "bfloat16:none:native-layers"):
        assert TargetArm.parse(text).name == text
    with pytest.raises(SystemExit) as stop:
        target_quality.main(["--output-dir", "/nonexistent/never", "--arms", "bfloat16:int8:x"])
    assert stop.value.code == 2
    assert "expected DTYPE:QUANTIZATION" in capsys.readouterr().err


def test_report_lists_every_arm_against_the_reference():
    row = {
        "positions": 703, "kld_mean": 0.0124, "kld_median": 0.0021, "kld_p99": 0.0557,
        "kld_max": 4.25, "top1_agreement": 0.966, "perplexity": 5.35, "delta_p_mean": -0.0017,
        "delta_p_rms": 0.0193,
    }  # fmt: skip
    result = {
        "command": "python -m specdec.evals.formats.target_quality",
        "commit": "abc",
        "environment": {"cpu": "Some CPU"},
        "cpu_flags": "avx2",
        "threads": 2,
        "target": "tiny",
        "tokens": 704,
        "min_context": 16,
        "rows": {
            "float32:none": {"arm": "float32:none", "elementwise": "torch", **row},
            "bfloat16:int8": {"arm": "bfloat16:int8", "elementwise": "native", **row},
        },
    }
    md = target_quality.markdown(result)
    assert "| `bfloat16:int8` | native | 0.01240 | 0.00210 | 0.0557 | 4.2500 | 0.966 |" in md
    assert "`float32:none`" not in md.split("|---|")[-1]  # the reference is the header's
    assert "perplexity 5.350" in md and "Some CPU" in md


def test_result_files_open_with_the_command_commit_and_machine(tmp_path):
    from specdec.evals.environment import result_header, write_result

    header = result_header("specdec.evals.formats.target_quality", ["--arms", "a b"], 2)
    assert header["command"] == "python -m specdec.evals.formats.target_quality --arms 'a b'"
    assert header["threads"] == 2 and header["commit"] and header["environment"]["cpu"]
    write_result(tmp_path / "new", "target_quality", {**header, "rows": {}}, "# report\n")
    assert json.loads((tmp_path / "new" / "target_quality.json").read_text())["threads"] == 2
    assert (tmp_path / "new" / "target_quality.md").read_text() == "# report\n"
