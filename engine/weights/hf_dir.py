"""Read a local Hugging Face model directory: its config.json and its safetensors weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from specdec.engine.errors import CorruptModelFileError, ModelNotFoundError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

MODEL_DIR_HELP = (
    "A model directory must contain config.json, the weights as *.safetensors "
    "(model.safetensors or shards listed in model.safetensors.index.json) and the tokenizer files "
    "(tokenizer.json, tokenizer_config.json). For the embedded default models run "
    "`specdec pull <name>` (names: qwen2.5-coder-1.5b-instruct, qwen2.5-coder-0.5b-instruct), "
    "or pass a .gguf file."
)


def load_hf_config(model_dir: Path) -> dict:
    """Return the parsed config.json of ``model_dir``.

    Raises ModelNotFoundError when the directory or its config.json is missing, and
    CorruptModelFileError when config.json is not valid JSON.
    """
    model_dir = Path(model_dir).expanduser()
    config_path = model_dir / CONFIG_FILE
    if not config_path.is_file():
        raise ModelNotFoundError(f"{model_dir} has no {CONFIG_FILE}. {MODEL_DIR_HELP}")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptModelFileError(
            f"{config_path} is not valid JSON ({exc}); the model directory is damaged, "
            "restore or re-create it."
        ) from exc
    if not isinstance(config, dict):
        raise CorruptModelFileError(f"{config_path} must hold a JSON object.")
    return config


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of ``model_dir`` in load order.

    Preference: the shards named by model.safetensors.index.json, then model.safetensors, then
    every *.safetensors file (sorted, so the order is stable).
    """
    model_dir = Path(model_dir).expanduser()
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CorruptModelFileError(
                f"{index_path} is damaged ({exc!r}); re-create the model directory."
            ) from exc
        # dict.fromkeys keeps first-appearance order while dropping repeats.
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise CorruptModelFileError(
                f"{model_dir} is incomplete: shards {missing} listed in {INDEX_FILE} are missing."
            )
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{model_dir} has no *.safetensors weights. {MODEL_DIR_HELP}")
    return files


def iter_safetensors_weights(
    model_dir: Path, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every weight of ``model_dir``, one tensor at a time.

    Tensors are read lazily with ``safe_open`` so only the tensor being yielded is materialised;
    floating tensors are converted to ``dtype`` when it is given.
    """
    for path in safetensors_files(model_dir):
        try:
            handle = safe_open(str(path), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise CorruptModelFileError(
                f"{path} cannot be read as safetensors ({exc}); the file is damaged, "
                "delete the model directory and re-create it."
            ) from exc
        with handle as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open handles are not iterable
                tensor = sf.get_tensor(name)
                if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                yield name, tensor
