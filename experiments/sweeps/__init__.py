"""Sweeps: each module has get_sweep() -> list of {config path: value} overrides, one per work unit."""
