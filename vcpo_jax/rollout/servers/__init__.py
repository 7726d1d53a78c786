"""Rollout servers: launching embedded ones, and publishing weights to any (export, install, confirm)."""
