"""Experiment launcher, sweeps and ablation reports."""
