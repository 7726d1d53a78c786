"""Performance suite: ratios measured side by side in one run (python -m benchmarks.cpu.run)."""
