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
import contextlib
import dataclasses
import functools
import io
import logging
import threading
from typing import Any, Iterator, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from vcpo_jax import sharding
from vcpo_jax.batch import RLBatch
from vcpo_jax.rollout import backend as backend_lib

_PREFIX = "vcpo"
_DONE = -1


class ProcessGroupError(RuntimeError):
  """Another process of the job did not arrive in time (hung or dead)."""


# ----------------------------------------------------------------------------------------------- set-up
def initialize(d) -> None:
  """`d` is the config's `distributed` section. auto: jax.distributed finds the cluster (TPU pods, SLURM,
  Open MPI, ...); num_processes > 1: explicit coordinator address and process id; else nothing happens."""
  if d is None or (not d.get("auto", False) and d.num_processes == 1):
    return
  if d.heartbeat_timeout_s < 1:
    raise ValueError(f"invalid config: distributed.heartbeat_timeout_s={d.heartbeat_timeout_s!r}: must be >= 1")
  # The shutdown barrier waits for the others as long as a heartbeat may be missing, not JAX's 5 minutes.
  kwargs = dict(heartbeat_timeout_seconds=int(d.heartbeat_timeout_s),
                shutdown_timeout_seconds=int(d.heartbeat_timeout_s),
                initialization_timeout=int(d.get("initialization_timeout_s", 300)))
  if d.get("auto", False):
    jax.distributed.initialize(**kwargs)
  else:
    if not isinstance(d.num_processes, int) or d.num_processes < 1:
      raise ValueError(f"invalid config: distributed.num_processes={d.num_processes!r}: must be an int >= 1")
    if not d.coordinator_address:
      raise ValueError("invalid config: distributed.coordinator_address='': needed when "
                       f"distributed.num_processes={d.num_processes} (host:port of process 0)")
    if not isinstance(d.process_id, int) or not 0 <= d.process_id < d.num_processes:
      raise ValueError(f"invalid config: distributed.process_id={d.process_id!r}: must be in "
                       f"[0, {d.num_processes})")
    jax.distributed.initialize(coordinator_address=d.coordinator_address, num_processes=d.num_processes,
                               process_id=d.process_id, **kwargs)
  logging.info("process %d of %d: %d local devices of %d", jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())


def multi_process() -> bool:
  return jax.process_count() > 1


def is_leader() -> bool:
  return jax.process_index() == 0


def _client():
  from jax._src import distributed  # noqa: PLC0415 - the only handle on the key-value store and barriers
  return distributed.global_state.client


def _wait_error(what: str, timeout_s: float, e: Exception) -> ProcessGroupError:
  return ProcessGroupError(
      f"process {jax.process_index()} of {jax.process_count()}: {what} did not happen within {timeout_s:g} s "
      f"(distributed.timeout_s): another process is hung or dead ({type(e).__name__}: {e})")


def barrier(name: str, timeout_s: float) -> None:
  """Every process reaches `name` within timeout_s, or each one that got there raises ProcessGroupError."""
  if not multi_process():
    return
  try:
    _client().wait_at_barrier(f"{_PREFIX}/{name}", int(timeout_s * 1000))
  except jax.errors.JaxRuntimeError as e:
    raise _wait_error(f"barrier {name!r} (every process)", timeout_s, e) from e


def _get(key: str, timeout_s: float, what: str) -> bytes:
  try:
    return _client().blocking_key_value_get_bytes(f"{_PREFIX}/{key}", int(timeout_s * 1000))
  except jax.errors.JaxRuntimeError as e:
    raise _wait_error(what, timeout_s, e) from e


def _set(key: str, value: bytes) -> None:
  _client().key_value_set_bytes(f"{_PREFIX}/{key}", value)


def _delete(key: str) -> None:
  _client().key_value_delete(f"{_PREFIX}/{key}")


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
  if not multi_process():
    return batch
  spans, me = process_rows(mesh, num_rows), jax.process_index()
  if is_leader():
    for p, (lo, hi) in spans.items():
      if p != me:
        _set(f"rows/{step}/{p}", _pack(_slice(batch, lo, hi)))
    local = _slice(batch, *spans[me])
  else:
    local = _unpack(_get(f"rows/{step}/{me}", timeout_s, f"the leader's batch for step {step}"))
  barrier(f"step/{step}", timeout_s)  # everyone is here before the step's collectives start
  if is_leader():  # every follower has read its rows (it is past the barrier)
    for p in spans:
      if p != me:
        _delete(f"rows/{step}/{p}")

  def to_global(x):
    return jax.make_array_from_process_local_data(sharding.batch_sharding(mesh, x.ndim), x,
                                                  (num_rows,) + x.shape[1:])
  return jax.tree.map(to_global, local)


# ------------------------------------------------------------------------------------- params to the host
class _Section:
  def __init__(self, name: str, leaves: list):
    self.name, self.leaves, self.count = name, leaves, 0
    self.index = {id(x): i for i, x in enumerate(leaves)}


_section: Optional[_Section] = None
_section_lock = threading.Lock()


def _local_copy(x: jax.Array) -> Optional[np.ndarray]:
  """The whole array from this process's own shards, or None when other processes hold parts of it."""
  out = np.empty(x.shape, x.dtype)
  covered = np.zeros(x.shape, bool)
  for shard in x.addressable_shards:
    out[shard.index] = np.asarray(shard.data)
    covered[shard.index] = True
  return out if covered.all() else None


@functools.lru_cache(maxsize=None)
def _replicator(mesh):
  # A jitted reshard to fully replicated: always a program on every device, so every process must join.
  return jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, PartitionSpec()))


def _allgather(x: jax.Array) -> np.ndarray:
  return np.asarray(_replicator(x.sharding.mesh)(x).addressable_data(0))


def to_host(x) -> np.ndarray:
  """One parameter as a host numpy array. An array with parts on other processes only is gathered (a
  collective): only inside `leader_gathers`, whose followers join the same gather."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  local = _local_copy(x)
  if local is not None:
    return local
  with _section_lock:
    section = _section
    if section is None or id(x) not in section.index:
      raise RuntimeError("to_host of an array sharded over several processes outside multihost.leader_gathers "
                         "(its followers would not join the gather)")
    key = f"gather/{section.name}/{section.count}"
    _set(key, str(section.index[id(x)]).encode())
    out = _allgather(x)
    _delete(key)  # every follower read it: it joined the gather
    section.count += 1
    return out


@contextlib.contextmanager
def leader_gathers(tree: Any, name: str) -> Iterator[None]:
  """Leader: within this block, to_host(leaf of tree) gathers that leaf with the followers (who run
  follow_gathers(tree, name)), in whatever order and as often as the code inside asks."""
  global _section
  if not multi_process():
    yield
    return
  with _section_lock:
    _section = _Section(name, jax.tree.leaves(tree))
  try:
    yield
  finally:
    with _section_lock:
      _set(f"gather/{name}/{_section.count}", str(_DONE).encode())
      _section = None


def follow_gathers(tree: Any, name: str, timeout_s: float) -> None:
  """Follower: joins each gather the leader's `leader_gathers(tree, name)` block makes, until it ends."""
  leaves = jax.tree.leaves(tree)
  n = 0
  while True:
    key = f"gather/{name}/{n}"
    index = int(_get(key, timeout_s, f"the leader's parameter gather {name!r} #{n}"))
    if index == _DONE:
      return
    _allgather(leaves[index])
    n += 1


def host_tree(tree: Any, name: str, timeout_s: float) -> Any:
  """The whole tree on the leader's host (one leaf gathered at a time); None on followers."""
  if not multi_process():
    return jax.device_get(tree)
  if not is_leader():
    follow_gathers(tree, name, timeout_s)
    return None
  with leader_gathers(tree, name):
    return jax.tree.map(to_host, tree)


# ------------------------------------------------------------------------------------ rollout backends
class LeaderBackend(backend_lib.RolloutBackend):
  """Process 0's backend: the real one, its exports able to gather the params with the followers.
  host_params: the inner backend keeps host copies (the lag emulator's ring), gathered here leaf by leaf;
  else it gets the sharded params and its export gathers one tensor at a time (hf.export_hf)."""

  def __init__(self, inner: backend_lib.RolloutBackend, host_params: bool):
    self.inner, self.host_params = inner, host_params

  def _params(self, params):
    return jax.tree.map(to_host, params) if self.host_params else params

  async def start(self, version: int, params: Any) -> None:
    with leader_gathers(params, f"start/{version}"):
      await self.inner.start(version, self._params(params))

  async def next_groups(self, version: int):
    return await self.inner.next_groups(version)

  async def publish(self, version: int, params: Any) -> None:
    with leader_gathers(params, f"publish/{version}"):
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
    await asyncio.to_thread(follow_gathers, params, f"start/{version}", self.timeout_s)

  async def next_groups(self, version: int):
    return []

  async def publish(self, version: int, params: Any) -> None:
    await asyncio.to_thread(follow_gathers, params, f"publish/{version}", self.timeout_s)
