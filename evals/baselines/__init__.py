"""Reference implementations run by the same eval: transformers generate, plain and assisted."""

from __future__ import annotations

from specdec.evals.baselines.hf_generate import HFGenerateBaseline

__all__ = ["HFGenerateBaseline"]
