"""Build the engine's speculation controller from its config (and calibrate it on the engine)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from specdec.controller.acceptance import AcceptanceTracker
from specdec.controller.adaptive import AdaptiveController, AdaptiveParams
from specdec.controller.calibration import calibrate
from specdec.controller.cost_model import CostModel
from specdec.controller_base import SpeculationController

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

# Acceptance assumed per position before any verify was seen, per proposer: a same-family draft
# model usually agrees with the target most of the time; prompt lookup less often.
INITIAL_ACCEPTANCE = {"draft_model": 0.7, "ngram": 0.5}
CALIBRATION_SECONDS = 30.0  # every plain and verify shape up to 16 x 5 rows on a 2-core CPU


def build_controller(config: EngineConfig, engine: LLMEngine) -> SpeculationController:
    """The adaptive controller for this engine, calibrated on its models when asked to.

    Needs ``engine.target_runner``, ``engine.allocator`` and ``engine.proposer`` to exist.
    """
    k_max = config.num_speculative_tokens
    proposer = getattr(engine, "proposer", None)
    name = getattr(proposer, "name", "none")
    has_model = getattr(proposer, "runner", None) is not None
    controller = AdaptiveController(
        k_max,
        cost=CostModel(),
        acceptance=AcceptanceTracker(k_max, name, INITIAL_ACCEPTANCE.get(name, 0.5)),
        params=AdaptiveParams(stop_drafts_early=config.stop_drafts_early),
        per_position_forwards=has_model,
    )
    if proposer is not None and config.controller_warmup:
        result = calibrate(engine, k_max, CALIBRATION_SECONDS)
        controller.cost.seed(result.target, result.draft)
        logger.info("speculation controller seeded: %s", controller.summary())
    return controller
