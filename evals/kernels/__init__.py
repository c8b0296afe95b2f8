"""Measurements of single native kernels inside the engine, side by side with the torch path."""
