"""The HTTP client side: the rollout client, its server pool, and the staleness-bounded scheduler."""
