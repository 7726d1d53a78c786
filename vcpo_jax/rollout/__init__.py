"""Rollout side: the backend seam and its types; the HTTP client, server launching and publishing, lag emulation."""
