"""Where each process runs: GPUs and memory caps for the learner and each embedded server, CPUs for the servers."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
from typing import Mapping, Sequence

# Per-process accelerator memory (read by JAX when its GPU client starts, so set before first device use).
PREALLOCATE_VAR = "XLA_PYTHON_CLIENT_PREALLOCATE"
FAKE_DEVICES_FLAG = "--xla_force_host_platform_device_count"  # CPU emulation of several devices
MEM_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"
_PROC_GPUS = "/proc/driver/nvidia/gpus"


def visible_gpus(environ: Mapping[str, str], proc_gpus_dir: str = _PROC_GPUS,
                 smi: Sequence[str] = ("nvidia-smi", "-L")) -> list[str]:
  """CUDA device ids this process may use (as CUDA_VISIBLE_DEVICES names them); [] on a CPU machine or
  when JAX_PLATFORMS rules out CUDA."""
  platforms = environ.get("JAX_PLATFORMS", "")
  if platforms and not any(p in platforms for p in ("cuda", "gpu")):
    return []
  visible = environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    ids = [d.strip() for d in visible.split(",") if d.strip()]
    # CUDA stops at the first invalid entry; "-1" is the usual way to hide every device.
    return [] if not ids or ids[0] == "-1" else ids
  try:  # the driver's own list (in a container: the GPUs it was given)
    out = subprocess.run(list(smi), capture_output=True, text=True, timeout=20, check=True).stdout
    return [str(i) for i in range(sum(line.startswith("GPU ") for line in out.splitlines()))]
  except (OSError, subprocess.SubprocessError):
    pass
  try:
    return [str(i) for i in range(len(os.listdir(proc_gpus_dir)))]
  except OSError:
    return []


@dataclasses.dataclass(frozen=True)
class DevicePlan:
  """Who uses which GPU. Env values of None mean "remove the variable" (a child must not inherit it)."""
  learner_env: dict
  learner_devices: str | None          # jax_cuda_visible_devices for the learner (None: all visible)
  server_envs: tuple[dict, ...]


def _fraction(field: str, value) -> float:
  value = float(value)
  if not 0.0 <= value < 1.0:
    raise ValueError(f"invalid config: {field}={value!r}: must be in [0, 1) (0 = no cap, no preallocation)")
  return value


def _memory_env(shared: bool, fraction: float) -> dict:
  """A process alone on its devices keeps JAX's defaults; one sharing a device never preallocates and is
  capped at `fraction` of it when that is > 0."""
  if not shared:
    return {PREALLOCATE_VAR: None, MEM_FRACTION_VAR: None}
  return {PREALLOCATE_VAR: "false", MEM_FRACTION_VAR: f"{fraction:.4g}" if fraction > 0 else None}


def plan_devices(gpus: Sequence[str], num_servers: int, *, server_devices: str = "",
                 learner_memory_fraction: float = 0.0, server_memory_fraction: float = 0.0) -> DevicePlan:
  """Places the learner and `num_servers` embedded servers on `gpus` (pure; no GPUs: nothing changes).

  server_devices: "" picks automatically: with one GPU everyone shares it; with n > 1 the servers take the
  last min(num_servers, n - 1) GPUs round-robin and the learner keeps the rest. Otherwise a comma list of
  indices into `gpus`, one per server (cycled). The learner uses every GPU no server uses (all of them if the
  servers use them all). Processes on a shared GPU get their memory fraction (0 = grow on demand, no cap).
  """
  learner_fraction = _fraction("rollout.learner_memory_fraction", learner_memory_fraction)
  server_fraction = _fraction("rollout.server_memory_fraction", server_memory_fraction)
  if not gpus:
    return DevicePlan({}, None, tuple({} for _ in range(num_servers)))
  n = len(gpus)
  if server_devices.strip():
    try:
      chosen = [int(x) for x in server_devices.split(",") if x.strip()]
    except ValueError:
      chosen = [-1]
    if not chosen or any(not 0 <= i < n for i in chosen):
      raise ValueError(f"invalid config: rollout.server_devices={server_devices!r}: must be a comma list of "
                       f"indices into the {n} visible GPU(s) {list(gpus)}")
  else:
    chosen = [0] if n == 1 else list(range(n - min(num_servers, n - 1), n)) or [n - 1]
  server_idx = [chosen[i % len(chosen)] for i in range(num_servers)]
  learner_idx = [i for i in range(n) if i not in server_idx] or list(range(n))
  users = {i: learner_idx.count(i) + server_idx.count(i) for i in range(n)}
  for i in range(n):
    total = learner_fraction * (i in learner_idx) + server_fraction * server_idx.count(i)
    if total > 1.0:
      raise ValueError(f"invalid config: GPU {gpus[i]} is shared by processes whose memory fractions sum to "
                       f"{total:.3g} > 1 (rollout.learner_memory_fraction={learner_fraction}, "
                       f"rollout.server_memory_fraction={server_fraction} per server)")
  learner_env = _memory_env(any(users[i] > 1 for i in learner_idx), learner_fraction)
  learner_devices = None if len(learner_idx) == n else ",".join(map(str, learner_idx))
  server_envs = tuple({"CUDA_VISIBLE_DEVICES": gpus[i], **_memory_env(users[i] > 1, server_fraction)}
                      for i in server_idx)
  return DevicePlan(learner_env, learner_devices, server_envs)


def rollout_plan(rollout, num_servers: int, environ: Mapping[str, str] | None = None) -> DevicePlan:
  """The plan for `num_servers` embedded servers from a job's `rollout` config section (or the http backend's
  typed config: the same field names). The job's whole plan, which knows whether its backend starts servers,
  is job.configuration.device_plan."""
  return plan_devices(visible_gpus(os.environ if environ is None else environ), num_servers,
                      server_devices=getattr(rollout, "server_devices", ""),
                      learner_memory_fraction=getattr(rollout, "learner_memory_fraction", 0.0),
                      server_memory_fraction=getattr(rollout, "server_memory_fraction", 0.0))


def apply_env(env: dict, updates: Mapping[str, str | None]) -> dict:
  """env with `updates` applied (None removes a variable); returns env."""
  for key, value in updates.items():
    if value is None:
      env.pop(key, None)
    else:
      env[key] = value
  return env


def xla_flags(flags: str, fake_devices: int = 0) -> str:
  """XLA_FLAGS `flags` for another process: its fake CPU device count replaced by `fake_devices` (0: none, the
  process sees its real devices); every other flag (a user's GPU tuning, compile options) is kept."""
  kept = [f for f in flags.split() if not f.startswith(FAKE_DEVICES_FLAG)]
  return " ".join(kept + ([f"{FAKE_DEVICES_FLAG}={fake_devices}"] if fake_devices else []))


def configure_learner(plan: DevicePlan) -> None:
  """Applies the learner's part of the plan to this process; must run before JAX first touches a device."""
  if not plan.learner_env and plan.learner_devices is None:
    return
  from jax._src import xla_bridge  # noqa: PLC0415 - only to refuse acting too late
  if xla_bridge.backends_are_initialized():
    raise RuntimeError("configure_learner ran after JAX initialised its devices; call it first in main()")
  apply_env(os.environ, plan.learner_env)
  if plan.learner_devices is not None:
    import jax  # noqa: PLC0415
    jax.config.update("jax_cuda_visible_devices", plan.learner_devices)


def parse_cpus(spec: str, field: str = "rollout.server_cpus") -> frozenset[int] | None:
  """A CPU list as taskset writes it ("1", "8-15", "0,2-3") -> the set of CPU ids; "" -> None (inherit)."""
  spec = str(spec).strip()
  if not spec:
    return None
  cpus = set()
  for part in spec.split(","):
    lo, dash, hi = part.strip().partition("-")
    ok = lo.isdigit() and (hi.isdigit() if dash else not hi)
    a, b = (int(lo), int(hi or lo)) if ok else (-1, -1)
    if not 0 <= a <= b:
      raise ValueError(f"invalid config: {field}={spec!r}: must be CPU ids and ranges like '1', '8-15' or '0,2-3'")
    cpus.update(range(a, b + 1))
  return frozenset(cpus)


def format_cpus(cpus: frozenset[int]) -> str:
  """The inverse of parse_cpus, in taskset's compact form: {0, 2, 3, 4} -> "0,2-4"."""
  parts, ids = [], sorted(cpus)
  while ids:
    end = 0
    while end + 1 < len(ids) and ids[end + 1] == ids[end] + 1:
      end += 1
    parts.append(str(ids[0]) if end == 0 else f"{ids[0]}-{ids[end]}")
    ids = ids[end + 1:]
  return ",".join(parts)


@contextlib.contextmanager
def thread_affinity(cpus: frozenset[int] | None, field: str = "rollout.server_cpus"):
  """Confines the calling thread to `cpus` for the block, so a process it starts inherits exactly them (a
  child takes its parent thread's CPU mask at fork; setting it on the child afterwards races the threads the
  child starts). None: nothing changes."""
  if cpus is None:
    yield
    return
  old = os.sched_getaffinity(0)
  try:
    os.sched_setaffinity(0, cpus)
  except OSError as e:
    raise ValueError(f"invalid config: {field}={format_cpus(cpus)!r}: not CPUs this machine "
                     f"lets the job use ({e.strerror}; it has {os.cpu_count()} CPUs)") from None
  try:
    yield
  finally:
    os.sched_setaffinity(0, old)
