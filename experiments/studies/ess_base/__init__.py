"""The on-policy ESS ratio study (docs/results/ess_base/)."""
