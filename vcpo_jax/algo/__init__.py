"""The method as pure functions: importance ratios, ESS, OPOB, advantages, policy losses (no I/O)."""
