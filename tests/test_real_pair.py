"""The embedded default pair (fetched by `specdec pull`, which the test command runs first)."""

from __future__ import annotations

import gc

import pytest
import torch
from specdec.engine.config import EngineConfig
from specdec.engine.weights import COMPLETE_MARKER, specdec_home

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
CHATS = [
    [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Explain in two sentences what a hash map is."},
    ],
]

pytestmark = pytest.mark.real_model


def model_dir(name: str):
    path = specdec_home() / "models" / name
    if not (path / COMPLETE_MARKER).exists():
        pytest.skip(f"{name} is not in the cache: run `specdec pull`")
    return path


def engine_for(target: str, draft: str | None, **kw):
    from specdec.engine.llm_engine import LLMEngine

    cfg = EngineConfig(
        model=str(model_dir(target)),
        draft_model=str(model_dir(draft)) if draft else None,
        speculative_method="draft_model" if draft else "none",
        device="cpu",
        dtype="float32",
        max_model_len=512,
        kv_cache_memory=0.5,
        controller_warmup=False,
        **kw,
    )
    return LLMEngine(cfg, progress=False)


def greedy(n: int):
    from specdec.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("name", [TARGET, DRAFT])
def test_engine_greedy_equals_transformers(name):
    from transformers import AutoModelForCausalLM

    engine = engine_for(name, None)
    prompts = [engine.tokenizer.apply_chat_template(c) for c in CHATS]
    ours = [o.output_token_ids for o in engine.generate(prompts, greedy(32))]
    del engine
    gc.collect()
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir(name)), dtype=torch.float32)
    hf.eval()
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=151643,
            )[0, len(prompt) :].tolist()
        assert got == ref
    del hf
    gc.collect()


def test_speculative_equals_plain_and_accepts_code():
    engine = engine_for(TARGET, DRAFT, num_speculative_tokens=4)
    prompts = [engine.tokenizer.apply_chat_template(c) for c in CHATS]
    plain = engine.generate(prompts, greedy(48), speculative="off")
    spec = engine.generate(prompts, greedy(48), speculative="on")
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in plain]
    code = spec[0].spec_stats
    print(
        f"code prompt acceptance {code.acceptance_rate:.2f}, "
        f"mean accepted length {code.mean_accepted_length:.2f}"
    )
    assert code.acceptance_rate > 0.5
    assert "def" in spec[0].text


def test_the_default_targets_4_bit_blocks_read_back_exactly():
    """The GGUF file behind the default target: its Q4_K tensors read as int4 groups give back
    gguf's own dequantized weights bit for bit; its Q6_K tensors are not offered as groups."""
    import numpy as np
    from specdec.engine.weights import GGUFModel, converted_from

    source = converted_from(model_dir(TARGET))
    assert source is not None, "the default target's conversion names its GGUF file"
    file = GGUFModel(source)
    for gguf_name in ("blk.0.attn_q.weight", "blk.3.ffn_gate.weight", "blk.27.attn_output.weight"):
        hf_name = f"model.layers.{gguf_name.split('.')[1]}." + {
            "attn_q": "self_attn.q_proj", "ffn_gate": "mlp.gate_proj",
            "attn_output": "self_attn.o_proj",
        }[gguf_name.split(".")[2]] + ".weight"  # fmt: skip
        bits, codes, scale, base = file.stored_groups(hf_name)
        assert bits == 4
        rows = codes.shape[0]
        expanded = codes.reshape(rows, -1, 32) * scale[..., None] + base[..., None]
        want = file.read_small_tensor(gguf_name)
        assert np.array_equal(expanded.astype(np.float32).reshape(want.shape), want)
    assert file.stored_groups("model.layers.0.self_attn.v_proj.weight") is None  # Q6_K
    assert file.stored_groups("lm_head.weight") is None  # Q6_K
