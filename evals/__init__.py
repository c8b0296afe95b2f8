"""Offline acceptance-rate evals, the serving benchmark and baselines."""
