"""The engine's speculation policy, built from its configuration and seeded with the machine's
step-cost table (read from the cache, or measured on the runners)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

import torch
from specdec.engine.block_allocator import BlockAllocator
from specdec.engine.calibration import (
    CALIBRATION_SECONDS,
    CalibrationSpec,
    cached_or_measured,
    machine_description,
    measure,
)
from specdec.engine.config import EngineConfig
from specdec.engine.model_runner import ModelRunner

from specdec.controller import AdaptivePolicy, FixedPolicy, SpeculationPolicy
from specdec.controller.policy import INITIAL_ACCEPTANCE
from specdec.tree_proposal import TreeShape, level_widths

logger = logging.getLogger(__name__)


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
        return FixedPolicy(k_max, config.spec_tree_max_nodes)
    policy = AdaptivePolicy(
        k_max,
        INITIAL_ACCEPTANCE.get(proposer_name, 0.5),
        stop_drafts_early=config.stop_drafts_early,
        has_draft_model=draft is not None,
        max_model_len=max_model_len,
        tree_nodes=config.spec_tree_max_nodes,
        tree_widths=partial(level_widths, config.spec_tree_max_nodes, shape=tree_shape(config)),
    )
    if config.controller_warmup:
        # Weight formats and a pruned draft head set the timings as much as the models do: they
        # are part of the key (plain models keep the keys their tables were cached under).
        models = [_with_format(config.model, config.quantization)]
        if draft is not None:
            kept = draft.output_token_ids
            pruned = f" (head of {len(kept)} rows)" if kept is not None else ""
            models.append(
                _with_format(config.draft_model or "", config.draft_quantization) + pruned
            )
        spec = CalibrationSpec(
            max_num_seqs=config.max_num_seqs,
            k_max=k_max,
            max_rows=config.max_num_batched_tokens,
            max_context=max_model_len,
            budget_seconds=CALIBRATION_SECONDS,
            tree_nodes=config.spec_tree_max_nodes,
        )
        machine = machine_description(target.device, dtype, models)
        if config.kv_cache_dtype != "auto":  # pages read through a cast: other timings
            machine["kv_cache_dtype"] = config.kv_cache_dtype
        if cache:
            table = cached_or_measured(target, draft, allocator, spec, machine, clock=clock)
        else:
            table = measure(target, draft, allocator, spec, machine, clock)
        table.seed(policy.cost)
        logger.info("speculation policy seeded with %d timed shapes", len(table.samples))
    return policy


def tree_shape(config: EngineConfig) -> TreeShape:
    return TreeShape(config.spec_tree_growth, config.spec_tree_branching)


def _with_format(model: str, quantization: str) -> str:
    return model if quantization == "none" else f"{model} ({quantization})"
