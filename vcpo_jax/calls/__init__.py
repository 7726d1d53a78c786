"""Calls kept off the rollout event loop: bounded pools (inline, thread, worker processes), a timeout per call."""
