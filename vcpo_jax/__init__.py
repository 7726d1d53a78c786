"""vcpo_jax: Variance-Controlled Policy Optimization for asynchronous RL post-training of LLMs."""
