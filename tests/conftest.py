"""Shared fixtures: tiny random Qwen2/Llama models (as transformers modules) and engines on them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_hf_model

# Keep test runs reproducible and light on this 2-core machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))

REAL_MODEL_HOME = Path(os.environ.get("SPECDEC_HOME", Path.home() / ".cache" / "specdec"))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def target():
    """A tiny random Qwen2 target (one per test module)."""
    return tiny_hf_model("qwen2", seed=0)


@pytest.fixture(scope="module")
def same_as_target():
    """A draft with the target's very weights: every draft is accepted at temperature 0."""
    return tiny_hf_model("qwen2", seed=0)
