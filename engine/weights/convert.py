"""Convert a GGUF file into a Hugging Face model directory (config, safetensors, tokenizer).

The directory is built in a hidden sibling and renamed into place only when every file, the
``.complete`` marker last, is written, so a reader never sees a half-converted model.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from specdec.engine.weights.cache import COMPLETE_MARKER
from specdec.engine.weights.gguf_file import GGUFModel, save_tokenizer_from_gguf
from specdec.engine.weights.safetensors_writer import DEFAULT_SHARD_BYTES, ShardedSafetensorsWriter
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

# Qwen2 chat models end a turn with <|im_end|> but may also emit <|endoftext|>; generation must
# stop at either.
_QWEN2_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


def _build_prefix(out_dir: Path) -> str:
    return f".{out_dir.name}.building-"


def remove_stale_builds(out_dir: Path) -> None:
    """Delete half-built siblings of ``out_dir`` left by an interrupted conversion.

    Only safe while holding the cache lock for ``out_dir`` (no other build can be running).
    """
    out_dir = Path(out_dir)
    if out_dir.parent.is_dir():
        for stale in out_dir.parent.glob(_build_prefix(out_dir) + "*"):
            shutil.rmtree(stale, ignore_errors=True)


def generation_config_for(model: GGUFModel, config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: bos/pad ids and every token id that ends generation."""
    eos_ids: list[int] = []
    if config.get("eos_token_id") is not None:
        eos_ids.append(int(config["eos_token_id"]))
    if model.architecture == "qwen2" and model.meta("tokenizer.chat_template") is not None:
        for token in _QWEN2_STOP_TOKENS:
            token_id = model.special_tokens.get(token)
            if token_id is not None and token_id not in eos_ids:
                eos_ids.append(token_id)
    generation: dict[str, Any] = {"bos_token_id": config.get("bos_token_id")}
    generation["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None)
    if config.get("pad_token_id") is not None:
        generation["pad_token_id"] = config["pad_token_id"]
    return generation


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


def convert_gguf_to_hf_dir(
    gguf_path: Path,
    out_dir: Path,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Convert ``gguf_path`` into the HF directory ``out_dir`` and return ``out_dir``.

    Writes config.json, generation_config.json, ``model-XXXXX-of-YYYYY.safetensors`` shards of at
    most ``max_shard_bytes`` with model.safetensors.index.json, the tokenizer files when the GGUF
    carries a tokenizer, and finally ``.complete``. An existing ``out_dir`` is replaced.
    """
    gguf_path = Path(gguf_path).expanduser().absolute()
    out_dir = Path(out_dir).expanduser().absolute()
    model = GGUFModel(gguf_path)
    config = model.hf_config(dtype)
    plan = model.weight_plan()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    build_dir = Path(tempfile.mkdtemp(prefix=_build_prefix(out_dir), dir=out_dir.parent))
    try:
        os.chmod(build_dir, 0o755)  # mkdtemp makes it owner-only; the result is a normal dir
        _write_json(build_dir / "config.json", config)
        _write_json(build_dir / "generation_config.json", generation_config_for(model, config))
        entries = [(hf_name, shape) for _, hf_name, shape in plan]
        bar = tqdm(
            total=len(plan),
            desc=f"converting {gguf_path.name}",
            unit="tensor",
            disable=not progress,
        )
        # The bar is updated by hand: iterating through tqdm would keep the previous tensor alive
        # while the next one is dequantized, doubling peak memory.
        with bar, ShardedSafetensorsWriter(build_dir, entries, dtype, max_shard_bytes) as writer:
            for name, tensor in model.iter_weights(dtype):
                writer.write(name, tensor)
                del tensor
                bar.update(1)
        save_tokenizer_from_gguf(gguf_path, build_dir, model)
        marker = {"source": str(gguf_path), "dtype": str(dtype).removeprefix("torch.")}
        _write_json(build_dir / COMPLETE_MARKER, marker)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(build_dir, out_dir)
    except BaseException:
        shutil.rmtree(build_dir, ignore_errors=True)
        raise
    logger.info("converted %s -> %s", gguf_path, out_dir)
    return out_dir
