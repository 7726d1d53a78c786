"""The learner: RL batch type, learner config, jitted RL step, per-sequence grad norms, state, optimizer."""
