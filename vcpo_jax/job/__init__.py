"""The RL job: configuration, data, SFT warm start and RL loop, evaluation, checkpoints, metrics, hosts."""
