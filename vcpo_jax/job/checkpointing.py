"""Orbax checkpoints of the train state together with host-side JSON state (data iterator, scheduler, RNG)."""
from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves {state (pytree), host (JSON)} per step; restores the latest. Orbax writes to a temporary directory
  and renames on commit, so a failed save never damages the previous checkpoint.

  Several processes: every process calls save/restore (collectives; each writes its own shards of the state
  to the shared directory); the JSON part is written by process 0 (the leader's data iterator and rollout
  state, multihost.py) and read back by all."""

  def __init__(self, directory: str, max_to_keep: int = 3):
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             enable_async_checkpointing=False))
    self.failed_saves = 0

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, host_state: dict) -> bool:
    """Returns False (and logs why) when the write failed; the previous checkpoint stays usable."""
    try:
      self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                       host=ocp.args.JsonSave(host_state)), force=True)
      self._manager.wait_until_finished()
      return True
    except Exception as e:  # noqa: BLE001 - any storage error must not kill the run
      self.failed_saves += 1
      logging.error("checkpoint save at step %d to %s failed: %s: %s", step, self.directory,
                    type(e).__name__, e)
      return False

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[int, Any, dict] | None:
    """(step, state, host_state) of the latest (or given) checkpoint, or None when there is none."""
    step = self.latest_step() if step is None else step
    if step is None:
      return None
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), host=ocp.args.JsonRestore()))
    return step, restored["state"], restored["host"]

  def close(self):
    self._manager.close()


def abstract_like(state: Any) -> Any:
  """ShapeDtypeStructs (with shardings) describing `state`, for restoring onto the same devices."""
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), state)
