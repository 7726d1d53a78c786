"""Multi-process learner: jax.distributed set-up, process 0 as the rollout leader, rows fed per process, bounded waits.

Process 0 (the leader) drives rollouts (client, scheduler, publisher; or the lag emulator), the data iterator,
evaluation and every file the job writes; the others (followers) hold their shards of the train state and take
part in the collectives. Control goes through jax.distributed's key-value store, whose reads have timeouts, so
a hung leader ends its followers with an error naming what they waited for; a dead process is reported by
jax.distributed's own heartbeats (distributed.heartbeat_timeout_s), and a hung process by the per-step barrier.
With one process every function here is a no-op or a plain device_get: `make train` pays nothing.
"""
from __future__ import annotations

import asyncio
import dataclasses
import io
from typing import Any, Optional

import jax
import numpy as np

from vcpo_jax.learner.batch import RLBatch
from vcpo_jax.parallel import processes, sharding
from vcpo_jax.rollout import backend as backend_lib

# ------------------------------------------------------------------------------------------ rows per process
def process_rows(mesh, num_rows: int) -> dict[int, tuple[int, int]]:
  """process index -> [start, stop) of the batch rows its devices hold under the step's row sharding."""
  spans: dict[int, set] = {}
  for device, index in sharding.batch_sharding(mesh, 1).devices_indices_map((num_rows,)).items():
    rows = index[0]
    spans.setdefault(device.process_index, set()).update(range(*rows.indices(num_rows)))
  out = {}
  for p, rows in spans.items():
    lo, hi = min(rows), max(rows) + 1
    if len(rows) != hi - lo:
      raise ValueError(f"the mesh gives process {p} non-contiguous batch rows; order the mesh's devices by "
                       "process (sharding.make_mesh does)")
    out[p] = (lo, hi)
  return out


def _pack(batch: RLBatch) -> bytes:
  buf = io.BytesIO()
  np.savez(buf, **{f.name: np.asarray(getattr(batch, f.name)) for f in dataclasses.fields(batch)
                   if getattr(batch, f.name) is not None})
  return buf.getvalue()


def _unpack(data: bytes) -> RLBatch:
  with np.load(io.BytesIO(data)) as z:
    return RLBatch(**{k: z[k] for k in z.files})


def _slice(batch: RLBatch, lo: int, hi: int) -> RLBatch:
  return jax.tree.map(lambda x: np.asarray(x)[lo:hi], batch)


def feed_rows(batch: Optional[RLBatch], step: int, mesh, num_rows: int, timeout_s: float) -> RLBatch:
  """The step's batch as global arrays sharded like the step expects (rows over data x fsdp), each process
  feeding only its own rows. The leader passes the whole host batch and sends each follower its rows; a
  follower passes None and waits (at most timeout_s) for them. Single process: the batch unchanged."""
  if not processes.multi_process():
    return batch
  spans, me = process_rows(mesh, num_rows), jax.process_index()
  if processes.is_leader():
    for p, (lo, hi) in spans.items():
      if p != me:
        processes.kv_set(f"rows/{step}/{p}", _pack(_slice(batch, lo, hi)))
    local = _slice(batch, *spans[me])
  else:
    local = _unpack(processes.kv_get(f"rows/{step}/{me}", timeout_s, f"the leader's batch for step {step}"))
  processes.barrier(f"step/{step}", timeout_s)  # everyone is here before the step's collectives start
  if processes.is_leader():  # every follower has read its rows (it is past the barrier)
    for p in spans:
      if p != me:
        processes.kv_delete(f"rows/{step}/{p}")

  def to_global(x):
    return jax.make_array_from_process_local_data(sharding.batch_sharding(mesh, x.ndim), x,
                                                  (num_rows,) + x.shape[1:])
  return jax.tree.map(to_global, local)


# ------------------------------------------------------------------------------------ rollout backends
class LeaderBackend(backend_lib.RolloutBackend):
  """Process 0's backend: the real one, its exports able to gather the params with the followers.
  host_params: the inner backend keeps host copies (the lag emulator's ring), gathered here leaf by leaf;
  else it gets the sharded params and its export gathers one tensor at a time (hf.export_hf)."""

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
