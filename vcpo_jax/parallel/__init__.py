"""Devices and processes: the mesh and logical sharding rules, jax.distributed set-up, barriers, cross-process gathers."""
