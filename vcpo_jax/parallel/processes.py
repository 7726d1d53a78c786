"""Processes of one job: jax.distributed set-up, the key-value store with bounded waits, barriers, and
gathers of arrays sharded over several processes to one host (collectives every process joins).

With one process every function here is a no-op or a plain device_get.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Any, Iterator, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

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


def kv_get(key: str, timeout_s: float, what: str) -> bytes:
  try:
    return _client().blocking_key_value_get_bytes(f"{_PREFIX}/{key}", int(timeout_s * 1000))
  except jax.errors.JaxRuntimeError as e:
    raise _wait_error(what, timeout_s, e) from e


def kv_set(key: str, value: bytes) -> None:
  _client().key_value_set_bytes(f"{_PREFIX}/{key}", value)


def kv_delete(key: str) -> None:
  _client().key_value_delete(f"{_PREFIX}/{key}")


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
      raise RuntimeError("to_host of an array sharded over several processes outside processes.leader_gathers "
                         "(its followers would not join the gather)")
    key = f"gather/{section.name}/{section.count}"
    kv_set(key, str(section.index[id(x)]).encode())
    out = _allgather(x)
    kv_delete(key)  # every follower read it: it joined the gather
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
      kv_set(f"gather/{name}/{_section.count}", str(_DONE).encode())
      _section = None


def follow_gathers(tree: Any, name: str, timeout_s: float) -> None:
  """Follower: joins each gather the leader's `leader_gathers(tree, name)` block makes, until it ends."""
  leaves = jax.tree.leaves(tree)
  n = 0
  while True:
    key = f"gather/{name}/{n}"
    index = int(kv_get(key, timeout_s, f"the leader's parameter gather {name!r} #{n}"))
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
