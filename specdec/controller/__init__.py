"""Speculation policies: how many drafts each decode-ready sequence verifies per step.

docs/controller.md states the model; ``specdec.engine.policy_setup`` builds the engine's policy.
"""

from specdec.controller.policy import AdaptivePolicy, FixedPolicy, SpeculationPolicy

__all__ = ["AdaptivePolicy", "FixedPolicy", "SpeculationPolicy"]
