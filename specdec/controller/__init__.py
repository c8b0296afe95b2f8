"""Speculation policies: how many drafts each decode-ready sequence verifies per step.

``build_policy`` is what the engine calls; the model is stated in docs/controller.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from specdec.controller.cost_table import (
    CalibrationSpec,
    cached_or_measured,
    machine_description,
    measure,
)
from specdec.controller.policy import AdaptivePolicy, FixedPolicy, SpeculationPolicy
from specdec.engine.block_allocator import BlockAllocator
from specdec.engine.config import EngineConfig
from specdec.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Acceptance assumed per position before any verify was seen, per proposer: a same-family draft
# model usually agrees with the target most of the time; prompt lookup less often.
INITIAL_ACCEPTANCE = {"draft_model": 0.7, "ngram": 0.5}
CALIBRATION_SECONDS = 30.0  # every plain and verify shape up to 16 x 7 rows on a 2-core CPU

__all__ = ["AdaptivePolicy", "FixedPolicy", "SpeculationPolicy", "build_policy"]


def build_policy(
    config: EngineConfig,
    proposer_name: str,
    target: ModelRunner,
    draft: ModelRunner | None,
    allocator: BlockAllocator,
    dtype: torch.dtype,
    max_model_len: int,
    clock: Callable[[], float] = time.perf_counter,
    cache: bool = True,
) -> SpeculationPolicy:
    """The policy ``config`` asks for; an adaptive one is seeded with the machine's step-cost
    table when ``controller_warmup`` is set: read from the cache, or measured on the runners
    against ``clock`` (and, with ``cache``, stored for the next start)."""
    k_max = config.num_speculative_tokens
    if config.speculative_policy == "fixed":
        return FixedPolicy(k_max)
    policy = AdaptivePolicy(
        k_max,
        INITIAL_ACCEPTANCE.get(proposer_name, 0.5),
        stop_drafts_early=config.stop_drafts_early,
        has_draft_model=draft is not None,
        max_model_len=max_model_len,
    )
    if config.controller_warmup:
        # Weight formats set the timings as much as the models do: a quantized one is part of the
        # key (unquantized models keep the keys their tables were cached under).
        models = [_with_format(config.model, config.quantization)]
        if draft is not None:
            models.append(_with_format(config.draft_model or "", config.draft_quantization))
        spec = CalibrationSpec(
            max_num_seqs=config.max_num_seqs,
            k_max=k_max,
            max_rows=config.max_num_batched_tokens,
            max_context=max_model_len,
            budget_seconds=CALIBRATION_SECONDS,
        )
        machine = machine_description(target.device, dtype, models)
        if cache:
            table = cached_or_measured(target, draft, allocator, spec, machine, clock=clock)
        else:
            table = measure(target, draft, allocator, spec, machine, clock)
        table.seed(policy.cost)
        logger.info("speculation policy seeded with %d timed shapes", len(table.samples))
    return policy


def _with_format(model: str, quantization: str) -> str:
    return model if quantization == "none" else f"{model} ({quantization})"
