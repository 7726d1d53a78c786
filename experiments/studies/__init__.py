"""One folder per study: its driver, sweep and page helpers."""
