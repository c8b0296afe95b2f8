"""What machine and software produced a result, recorded next to the numbers."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from specdec.engine.calibration import cpu_model


def environment_info() -> dict:
    import torch

    info = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return info


def command_line() -> str:
    """The invocation as a `specdec ...` command (argv[0] is the entry point or a module)."""
    return shlex.join(["specdec", *sys.argv[1:]])


def git_commit() -> str:
    """Short hash of the checkout this code runs from ("unknown" outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def result_header(module: str, argv: Sequence[str] | None, threads: int) -> dict:
    """What a measurement program's result opens with: the command that made it (``python -m
    module ARGS``, ``argv`` or the process's own), the commit, the machine, its CPU's vector
    flags and the thread count."""
    from specdec.engine.cpu_features import vector_flags_summary

    args = list(argv) if argv is not None else sys.argv[1:]
    return {
        "command": f"python -m {module} {shlex.join(args)}".rstrip(),
        "commit": git_commit(),
        "environment": environment_info(),
        "cpu_flags": vector_flags_summary(),
        "threads": threads,
    }


def provenance_line(result: dict) -> str:
    """ "`command` at commit X; CPU (vector flags), N threads" of a ``result_header`` result."""
    env = result["environment"]
    return (
        f"`{result['command']}` at commit {result['commit']}; {env['cpu']}"
        f" ({result['cpu_flags']}), {result['threads']} threads"
    )


def write_result(output_dir: Path, name: str, result: dict, markdown: str) -> None:
    """``name.json`` and ``name.md`` in ``output_dir`` (made where missing)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (output_dir / f"{name}.md").write_text(markdown)
