"""Sweep definitions: each module has get_sweep(arg) -> list of work units (experiments/launch/sweep.py)."""
