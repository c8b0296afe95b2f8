"""Token trees through a real `specdec serve`, checked with the openai client: greedy text equals
a plain server's, usage reports the trees, /metrics counts their nodes and ranks."""

from __future__ import annotations

import openai
import pytest
import torch
from helpers_server import ServerProcess, build_script_model, metric_value, start_servers
from transformers import AutoModelForCausalLM

MODEL = "script"
PROMPTS = ["abc", "The quick brown fox", "x = [1, 2, 3]\nprint(", "zzzz", "Hello there, how"]
TREE_ARGS = [
    "--speculative-policy", "fixed", "--speculative-mode", "on", "--num-speculative-tokens", "4",
    "--spec-tree-max-nodes", "8",
]  # fmt: skip


def build_noisy_draft(target_dir, draft_dir) -> None:
    """The target with noise on its lm_head: it often ranks the target's token second."""
    model = AutoModelForCausalLM.from_pretrained(str(target_dir))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        w = model.lm_head.weight
        w.add_(torch.randn(w.shape, generator=g) * w.std() * 0.5)
    model.save_pretrained(str(draft_dir))
    for f in target_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            (draft_dir / f.name).write_bytes(f.read_bytes())


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("api_trees")
    build_script_model(root / MODEL)
    build_noisy_draft(root / MODEL, root / "draft")
    plain = ServerProcess(root / MODEL, None, [], root / "plain.log")
    trees = ServerProcess(root / MODEL, root / "draft", TREE_ARGS, root / "trees.log")
    start_servers(plain, trees)
    yield plain, trees
    plain.stop()
    trees.stop()


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_greedy_completions_with_trees_equal_plain_decode(servers):
    plain, trees = servers
    for prompt in PROMPTS:
        texts = [
            client(s)
            .completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
            .choices[0]
            .text
            for s in (plain, trees)
        ]
        assert texts[1] == texts[0], prompt


def test_streamed_chat_with_trees_equals_plain_and_reports_the_trees(servers):
    plain, trees = servers
    messages = [{"role": "user", "content": "Tell me about trees."}]
    outs = []
    for s in (plain, trees):
        chunks = list(
            client(s).chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=32,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        outs.append((text, chunks[-1].usage))
    assert outs[1][0] == outs[0][0]
    spec = outs[1][1].model_extra["speculative"]
    assert spec["nodes_per_tree_step"] > 1
    assert sum(spec["accepted_per_rank"]) == spec["accepted_tokens"]


def test_metrics_count_tree_nodes_and_ranks(servers):
    _, trees = servers
    client(trees).completions.create(model=MODEL, prompt="abc", max_tokens=16, temperature=0)
    text = client(trees).with_options(timeout=10)._client.get(f"{trees.url}/metrics").text
    steps = metric_value(text, "specdec:spec_decode_num_tree_steps_total")
    nodes = metric_value(text, "specdec:spec_decode_num_tree_nodes_total")
    assert steps > 0 and nodes > steps
    ranked = metric_value(text, "specdec:spec_decode_num_accepted_tokens_per_rank_total")
    accepted = metric_value(text, "specdec:spec_decode_num_accepted_tokens_total")
    assert ranked == accepted
