"""The trees benchmark's arm syntax and summary (the measurement itself needs the real pair)."""

from __future__ import annotations

import pytest
from specdec.evals.trees.bench_trees import TreeArm, main, markdown, parse_format, summarize


def test_arm_syntax_and_errors():
    assert TreeArm.parse("plain") == TreeArm("plain", 0, 0)
    assert TreeArm.parse("chain:4") == TreeArm("chain:4", 4, 0)
    assert TreeArm.parse("tree:16:5") == TreeArm("tree:16:5", 5, 16)
    for bad in ("tree:3", "chain:x", "bush:1", "tree:2:4", "chain:0"):
        with pytest.raises(ValueError, match="arm"):
            TreeArm.parse(bad)


def run(group, arm, ms, tpf, equal=True):
    return {"group": group, "arm": arm, "ms_per_token": ms, "tokens_per_forward": tpf,
            "equals_plain": equal}  # fmt: skip


def test_summary_compares_trees_with_the_chain_of_their_depth_and_the_fastest_chain():
    arms = [TreeArm.parse(a) for a in ("plain", "chain:2", "chain:3", "tree:8:3")]
    runs = [
        run("code", "plain", 300, 1.0),
        run("code", "chain:2", 200, 2.5),
        run("code", "chain:3", 180, 3.0),
        run("code", "tree:8:3", 150, 3.6, equal=False),
    ]
    result = {"formats": [{"format": "float32:none/none", "runs": runs}]}
    rows = {r["arm"]: r for r in summarize(result, arms)}
    assert rows["tree:8:3"]["tpf_vs_chain_of_depth"] == pytest.approx(3.6 / 3.0)
    assert rows["tree:8:3"]["speed_vs_fastest_chain"] == pytest.approx(180 / 150)
    assert rows["chain:2"]["speed_vs_plain"] == pytest.approx(1.5)
    assert rows["tree:8:3"]["output_equals_plain"] is False
    result.update(command="c", commit="x", environment={"cpu": "cpu"}, cpu_flags="f", threads=2,
                  rounds=1, prompts_per_group=1, max_tokens=8, summary=list(rows.values()))  # fmt: skip
    assert (
        "| float32:none/none | code | tree:8:3 | 150.0 | 3.60 | 1.200 | 1.200 | 2.000 | NO |"
        in markdown(result)
    )


def test_formats_are_a_bare_dtype_or_the_formats_benchmarks_syntax():
    assert parse_format("bfloat16").name == "bfloat16:none/auto"
    assert parse_format("bfloat16:int8/int4").name == "bfloat16:int8/int4"
    assert parse_format("float32:none/none@int8").kv_cache_dtype == "int8"
    for bad in ("bfloat17", "bfloat16:int3/int4", "bfloat16:int8"):
        with pytest.raises(ValueError):
            parse_format(bad)


def test_bad_formats_exit_2_before_loading_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--output-dir", str(tmp_path / "out"), "--formats", "bfloat16,bfloat16:int3/int4"])
    assert e.value.code == 2
    assert "int3" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
