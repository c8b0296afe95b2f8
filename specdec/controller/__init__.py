"""Adaptive speculation control: choose k per sequence per step from measured acceptance and cost.

``build_controller(config, engine)`` is what the engine calls; the pieces are importable for tests
and benchmarks.
"""

from __future__ import annotations

from specdec.controller.acceptance import AcceptanceTracker, expected_tokens, expected_tokens_table
from specdec.controller.adaptive import AdaptiveController, AdaptiveParams
from specdec.controller.calibration import CalibrationResult, calibrate
from specdec.controller.cost_model import CostModel, DraftCost, TargetCost, TargetSample
from specdec.controller.draft_stop import ConfidenceCalibration
from specdec.controller.factory import build_controller

__all__ = [
    "ConfidenceCalibration",
    "AcceptanceTracker",
    "AdaptiveController",
    "AdaptiveParams",
    "CalibrationResult",
    "CostModel",
    "DraftCost",
    "TargetCost",
    "TargetSample",
    "build_controller",
    "calibrate",
    "expected_tokens",
    "expected_tokens_table",
]
