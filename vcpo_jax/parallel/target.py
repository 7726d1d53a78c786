"""The device kind a program is built for: the running device, or a target named for an ahead-of-time compile."""
from __future__ import annotations

import contextlib
import dataclasses
import threading

import jax

# HBM per device by device_kind (substring, first match), for targets that report no memory (topology devices
# of an ahead-of-time compile). Vendors' figures; XLA's own check at compile time is the final word.
HBM_BYTES_BY_KIND = (
    ("TPU v5 lite", 16 * 2**30), ("TPU v5e", 16 * 2**30), ("TPU v5p", 95 * 2**30), ("TPU v5", 95 * 2**30),
    ("TPU v6", 32 * 2**30), ("TPU v4", 32 * 2**30),
    ("H200", 141 * 10**9), ("H100", 80 * 10**9), ("A100", 80 * 10**9),
)


@dataclasses.dataclass(frozen=True)
class Target:
  """platform is jax's backend name ("cpu", "gpu", "tpu"); memory_bytes per device, None when unknown."""
  platform: str
  device_kind: str
  memory_bytes: int | None = None

  @property
  def memory_source(self) -> str:
    return f"{self.device_kind}'s memory" if self.memory_bytes else f"{self.platform} reports no memory limit"


_lock = threading.Lock()
_override: list[Target] = []  # process-wide (not a contextvar): the learner traces in a worker thread


def kind_memory_bytes(device_kind: str) -> int | None:
  for name, nbytes in HBM_BYTES_BY_KIND:
    if name.lower() in device_kind.lower():
      return nbytes
  return None


def from_device(device) -> Target:
  """The Target of a jax device: a running one (its bytes_limit) or a topology's (the HBM table)."""
  platform = {"cuda": "gpu", "rocm": "gpu"}.get(device.platform, device.platform)
  memory = None
  try:
    stats = device.memory_stats()
    memory = int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None
  except Exception:  # noqa: BLE001 - CPU and topology devices raise or return None
    pass
  return Target(platform, device.device_kind, memory or kind_memory_bytes(device.device_kind))


def current() -> Target:
  """The target being compiled for: the innermost `compiling_for`, else this process's first local device."""
  with _lock:
    if _override:
      return _override[-1]
  return from_device(jax.local_devices()[0])


@contextlib.contextmanager
def compiling_for(target: Target):
  """Within the block, choices that depend on the device (attention kernel, remat, micro-batching) read `target`."""
  with _lock:
    _override.append(target)
  try:
    yield target
  finally:
    with _lock:
      _override.remove(target)
