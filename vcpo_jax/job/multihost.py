"""Multi-process rollouts: process 0 drives the real backend, the other processes join its parameter gathers.

Process 0 (the leader) drives rollouts (client, scheduler, publisher; or the lag emulator), the data iterator,
evaluation and every file the job writes; the others (followers) hold their shards of the train state and take
part in the collectives. The step's rows reach every process in job/batching.py (next_batch). Control goes
through jax.distributed's key-value store, whose reads have timeouts, so a hung leader ends its followers with an
error naming what they waited for; a dead process is reported by jax.distributed's own heartbeats
(distributed.heartbeat_timeout_s), and a hung process by the per-step barrier. With one process neither backend
here is used: `make train` pays nothing.
"""
from __future__ import annotations

import asyncio
from typing import Any

import jax

from vcpo_jax.parallel import processes
from vcpo_jax.rollout import backend as backend_lib


# ------------------------------------------------------------------------------------ rollout backends
class LeaderBackend(backend_lib.RolloutBackend):
  """Process 0's backend: the real one, its exports able to gather the params with the followers.
  host_params: the inner backend keeps host copies (the lag emulator's ring), gathered here leaf by leaf;
  else it gets the sharded params and its export gathers one tensor at a time (hf_export.export_hf)."""

  def __init__(self, inner: backend_lib.RolloutBackend, host_params: bool):
    self.inner, self.host_params = inner, host_params

  def _params(self, params):
    return jax.tree.map(processes.to_host, params) if self.host_params else params

  async def start(self, version: int, params: Any) -> None:
    with processes.leader_gathers(params, f"start/{version}"):
      await self.inner.start(version, self._params(params))

  async def next_groups(self, version: int):
    return await self.inner.next_groups(version)

  async def publish(self, version: int, params: Any) -> None:
    with processes.leader_gathers(params, f"publish/{version}"):
      await self.inner.publish(version, self._params(params))

  async def wait_published(self) -> None:
    await self.inner.wait_published()

  def last_publish_seconds(self):
    return self.inner.last_publish_seconds()

  def stats(self):
    return self.inner.stats()

  def state_dict(self):
    return self.inner.state_dict()

  def load_state_dict(self, state):
    self.inner.load_state_dict(state)

  async def close(self):
    await self.inner.close()


class FollowerBackend(backend_lib.RolloutBackend):
  """The other processes: no rollouts; they join the gathers the leader's start/publish make."""

  def __init__(self, timeout_s: float):
    self.timeout_s = timeout_s

  async def start(self, version: int, params: Any) -> None:
    await asyncio.to_thread(processes.follow_gathers, params, f"start/{version}", self.timeout_s)

  async def next_groups(self, version: int):
    return []

  async def publish(self, version: int, params: Any) -> None:
    await asyncio.to_thread(processes.follow_gathers, params, f"publish/{version}", self.timeout_s)
