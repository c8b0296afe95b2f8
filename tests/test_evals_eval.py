"""`specdec eval` end to end on tiny random models: outputs, statistics, the greedy check, CLI."""

from __future__ import annotations

import argparse
import json

import pytest
from specdec.api.cli import main as cli_main
from specdec.engine.errors import SpecdecError
from specdec.evals.commands import eval as eval_command
from specdec.evals.datasets import Prompt
from specdec.evals.eval_report import write_eval_outputs
from specdec.evals.offline import EvalSettings, evaluate
from tiny_models import make_engine, tiny_hf_model

PROMPTS = [
    Prompt("m1", "math", text="What is 12 + 7? Answer with one number."),
    Prompt("t1", "translation", text="Translate: the cat sleeps. Le chat dort. The dog"),
    Prompt("m2", "math", text="Two apples and three pears are how many fruits?"),
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def pair():
    return tiny_hf_model("qwen2", seed=0), tiny_hf_model("qwen2", seed=1, layers=1)


def factory_for(target, draft, plain_target=None):
    """Engines on the tiny pair; `plain_target` swaps the plain engine's model (to break it)."""

    def factory(method: str, k: int, tree_nodes: int = 0):
        model = plain_target if method == "none" and plain_target is not None else target
        return make_engine(
            model,
            draft if method == "draft_model" else None,
            speculative_method=method,
            num_speculative_tokens=max(1, k),
            num_kv_blocks=96,
            spec_tree_max_nodes=tree_nodes,
            speculative_policy="fixed" if tree_nodes else "adaptive",
        )

    return factory


def test_eval_end_to_end_writes_well_formed_outputs(pair, tmp_path):
    target, draft = pair
    settings = EvalSettings(ks=(1, 3), temperatures=(0.0, 1.0), max_tokens=6)
    report = evaluate(PROMPTS[:2], factory_for(target, draft), settings, progress=False)
    assert report.ok, report.failures
    paths = write_eval_outputs(report, tmp_path)

    data = json.loads(paths["json"].read_text())
    assert data["ok"] is True and data["failures"] == []
    assert data["meta"]["num_prompts"] == {"math": 1, "translation": 1}
    # 2 proposers x 2 ks x 2 temperatures x (2 categories + "all")
    assert len(data["spec"]) == 24
    assert len(data["plain"]) == 2 * 3
    for row in data["spec"]:
        assert 0.0 <= row["acceptance_rate"] <= 1.0
        assert len(row["acceptance_per_pos"]) <= row["k"]
        # Accepting position j needs every earlier one accepted, and drafting j needs j-1 drafted.
        acc, drafted = row["accepted_per_pos"], row["drafted_per_pos"]
        assert all(a >= b for a, b in zip(acc, acc[1:], strict=False))
        assert all(a >= b for a, b in zip(drafted, drafted[1:], strict=False))
        assert sum(acc) == row["num_accepted_tokens"] and sum(drafted) == row["num_draft_tokens"]
        assert row["acceptance_per_pos"] == pytest.approx(
            [a / d for a, d in zip(acc, drafted, strict=True)]
        )
        if row["num_draft_tokens"]:
            assert row["acceptance_rate"] == pytest.approx(
                row["num_accepted_tokens"] / row["num_draft_tokens"]
            )
        assert 1.0 <= row["mean_accepted_length"] <= row["k"] + 1
        assert row["speedup"] > 0 and row["speedup_cpu"] > 0 and row["cpu_seconds"] > 0
        assert row["draft_time_share"] + row["verify_time_share"] <= 1.0 + 1e-9
        if row["proposer"] == "draft_model":
            assert row["draft_time_share"] > 0 and row["num_draft_tokens"] > 0
        assert row["greedy_identical"] is (True if row["temperature"] == 0 else None)
    # The "all" row adds up its categories.
    for proposer, k, temp in [("draft_model", 3, 1.0), ("ngram", 1, 0.0)]:
        rows = {
            r["category"]: r
            for r in data["spec"]
            if (r["proposer"], r["k"], r["temperature"]) == (proposer, k, temp)
        }
        for key in ("num_draft_tokens", "num_accepted_tokens", "output_tokens", "num_prompts"):
            assert rows["all"][key] == rows["math"][key] + rows["translation"][key]

    md = paths["markdown"].read_text()
    for heading in ("## All categories (2 prompts)", "## math (1 prompts)", "## translation"):
        assert heading in md
    assert "| draft_model k=3 | 1 |" in md and "| ngram k=1 | 0 |" in md
    assert md.count("| plain | 0 |") == 3  # one per table
    assert "FAILURE" not in md
    for kind in ("acceptance_plot", "speedup_plot"):
        blob = paths[kind].read_bytes()
        assert blob.startswith(PNG_MAGIC) and len(blob) > 5000


def test_tree_rows_sit_beside_chain_rows(pair, tmp_path):
    target, draft = pair
    settings = EvalSettings(
        proposers=("draft_model",), ks=(3,), tree_nodes=(6,), temperatures=(0.0,), max_tokens=6
    )
    report = evaluate(PROMPTS[:2], factory_for(target, draft), settings, progress=False)
    assert report.ok, report.failures  # greedy trees equal plain decode
    rows = [r for r in report.spec if r.category == "all"]
    assert sorted(r.tree_nodes for r in rows) == [0, 6]
    tree = next(r for r in rows if r.tree_nodes)
    assert 1 < tree.nodes_per_tree_step <= 6
    assert sum(tree.accepted_per_rank) == tree.num_accepted_tokens
    paths = write_eval_outputs(report, tmp_path)
    assert "draft_model k=3 tree=6" in paths["markdown"].read_text()


def test_greedy_mismatch_is_a_loud_failure(pair, tmp_path, capsys):
    target, draft = pair
    other = tiny_hf_model("qwen2", seed=7)  # plain decode on a different model must disagree
    settings = EvalSettings(proposers=("ngram",), ks=(2,), temperatures=(0.0,), max_tokens=6)
    report = evaluate(PROMPTS, factory_for(target, draft, other), settings, progress=False)
    assert not report.ok
    assert {f["prompt_id"] for f in report.failures} == {"m1", "m2", "t1"}
    assert all(r.greedy_identical is False for r in report.spec)

    assert eval_command.finish(report, str(tmp_path)) == 1
    err = capsys.readouterr().err
    assert "FAILURE: ngram k=2 m1" in err and "not lossless" in err
    assert "## FAILURES" in (tmp_path / "eval.md").read_text()
    assert json.loads((tmp_path / "eval.json").read_text())["ok"] is False


def eval_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    eval_command.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_eval_cli_on_saved_models_with_transformers_baselines(pair, tmp_path, capsys):
    target, draft = pair
    target.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p.text}) + "\n" for p in PROMPTS[:2]))
    args = eval_args(
        "--model", str(tmp_path / "target"), "--draft-model", str(tmp_path / "draft"),
        "--dataset", str(dataset), "--ks", "2", "--temperatures", "0", "--max-tokens", "6",
        "--baselines", "--baseline-limit", "1", "--output-dir", str(tmp_path / "out"),
        "--no-progress",
        "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "96", "--page-size", "4",
        "--max-model-len", "256",
    )  # fmt: skip
    assert eval_command.run(args) == 0
    assert "| draft_model k=2 | 0 |" in capsys.readouterr().out
    data = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert data["meta"]["draft"] == str(tmp_path / "draft")
    base = {(r["name"], r["k"]): r for r in data["baselines"] if r["category"] == "all"}
    assert set(base) == {("hf_plain", None), ("hf_assisted", 2)}
    for row in base.values():
        assert row["num_prompts"] == 1 and row["tokens_per_s"] > 0  # --baseline-limit 1
        # transformers greedy (plain and assisted) reproduces the engine's greedy output
        assert row["matches_engine_plain"] == 1
    assert base[("hf_plain", None)]["speedup_vs_hf_plain"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--categories", "math,poetry"], "unknown category 'poetry'"),
        (["--ks", "2,x"], "--ks: 'x' is not"),
        (["--ks", "0"], "out of range"),
        (["--tree-nodes", "0"], "out of range"),
        (["--tree-nodes", "65"], "out of range"),
        (["--proposers", "medusa"], "unknown value(s) 'medusa'"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--draft-model", "none"], "no --draft-model"),
    ],
)
def test_eval_bad_input_is_refused_before_loading_models(argv, needle):
    # A SpecdecError becomes "error: <message>" and exit status 2 in the `specdec` CLI. Input is
    # checked before any model is loaded, so the bogus --model is never reached.
    with pytest.raises(SpecdecError) as info:
        eval_command.run(eval_args("--model", "/nonexistent", *argv))
    assert needle in info.value.message


def test_eval_bad_input_through_the_cli(capsys):
    code = cli_main(["eval", "--model", "/nonexistent", "--categories", "poetry"])
    err = capsys.readouterr().err
    assert code == 2
    assert "error: unknown category 'poetry'" in err and "Traceback" not in err
