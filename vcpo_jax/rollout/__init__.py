"""Rollout side: SGLang-protocol client, scheduler, weight publisher and the embedded JAX server."""
