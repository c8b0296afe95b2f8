"""Speculation: proposers, rejection sampling, adaptive controller, acceptance statistics."""
