"""One package per study: its sweeps, its runner and its page generator."""
