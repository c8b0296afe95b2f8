"""The draft-format quality program: agreement read one token per forward, and its report."""

from __future__ import annotations

from specdec.engine.sampling_params import SamplingParams
from specdec.evals.draft_vocab.corpus import CorpusRecord
from specdec.evals.formats import draft_quality
from tiny_models import make_engine, noisy_copy


def _record(engine, prompt: list[int], tokens: int) -> CorpusRecord:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    out = engine.generate([prompt], params, speculative="off")[0].output_token_ids
    return CorpusRecord("p", "code_generation", tuple(prompt), tuple(out))


def test_a_draft_equal_to_the_target_agrees_everywhere_and_a_noisy_one_does_not(target):
    prompt = [5, 9, 13, 2, 7, 30]
    same = make_engine(target, target, speculative_mode="off")
    free0 = same.allocator.num_free_blocks
    record = _record(same, prompt, 16)
    assert draft_quality.draft_agreement(same, record, -1) == [True] * 16
    assert same.allocator.num_free_blocks == free0
    for fmt in ("int8-dynamic", "int4"):  # a lossy format of the same weights, read row by row
        lossy = make_engine(target, target, speculative_mode="off", draft_quantization=fmt)
        flags = draft_quality.draft_agreement(lossy, record, -1)
        assert len(flags) == 16 and sum(flags) >= 8
    noisy = make_engine(target, noisy_copy(target, 0.1), speculative_mode="off")
    flags = draft_quality.draft_agreement(noisy, record, -1)
    assert 0 < sum(flags) < 16


def test_report_lists_every_format_with_its_ratio():
    row = {
        "draft_quantization": "int4", "agreement": 0.9, "draft_step_ms": 20.0,
        "target_step_ms": 120.0, "draft_over_target": 20 / 120, "draft_weight_bytes": 6.8e8,
        **{f"k{k}_acceptance": 0.8 for k in draft_quality.KS},
        **{f"k{k}_tokens_per_verify": 3.0 for k in draft_quality.KS},
    }  # fmt: skip
    result = {
        "command": "python -m specdec.evals.formats.draft_quality",
        "commit": "abc",
        "environment": {"cpu": "Some CPU"},
        "cpu_flags": "avx2",
        "threads": 2,
        "dtype": "bfloat16",
        "outputs": 21,
        "rounds": 5,
        "rows": {"int4": row},
    }
    md = draft_quality.markdown(result)
    assert "| `int4` | 0.900 | 0.800 | 3.00 |" in md
    assert "| 20.0 | 120.0 | 0.167 | 680 |" in md and "Some CPU" in md
