"""Speculation policies: how many drafts each decode-ready sequence verifies per step.

The model is stated in docs/controller.md; the engine builds its policy in
``specdec.engine.policy_setup``.
"""

from specdec.controller.policy import AdaptivePolicy, FixedPolicy, SpeculationPolicy

__all__ = ["AdaptivePolicy", "FixedPolicy", "SpeculationPolicy"]
