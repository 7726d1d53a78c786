"""Starts and stops embedded rollout server processes; a server that cannot start reports its own output."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Mapping, Sequence

from vcpo_jax import orphans
from vcpo_jax.parallel import placement


def free_port(host: str = "127.0.0.1") -> int:
  with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
  """Pids of every live descendant of `pid` (Linux /proc; empty elsewhere)."""
  children: dict[int, list[int]] = {}
  for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
      continue
    children.setdefault(ppid, []).append(int(entry))
  out, todo = [], [pid]
  while todo:
    for child in children.get(todo.pop(), []):
      out.append(child)
      todo.append(child)
  return out


def is_alive(pid: int) -> bool:
  """Whether `pid` runs (a zombie has exited); Linux /proc."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def end_process_tree(proc: subprocess.Popen, grace_s: float = 5.0):
  """SIGTERM the child, its process group and its descendants (collected before signalling), then SIGKILL
  what is left after `grace_s`. Why by pid as well as by group: a training run starts its rollout servers in
  sessions of their own, which a process-group signal would not reach."""
  pids = [proc.pid] + descendants(proc.pid)
  for sig in (signal.SIGTERM, signal.SIGKILL):
    with contextlib.suppress(ProcessLookupError, PermissionError):
      os.killpg(proc.pid, sig)  # its own group (start_new_session), members that left the tree included
    for pid in pids:
      with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(is_alive(p) for p in pids):
      time.sleep(0.1)  # the child stays unreaped (a zombie is not alive): its pid names its session below
    if not any(is_alive(p) for p in pids):
      break
  orphans.reap_session(proc.pid, grace_s)  # what the kill orphaned, where this process is PID 1 (a container)
  with contextlib.suppress(subprocess.TimeoutExpired):
    proc.communicate(timeout=grace_s)


def server_environ(environ: Mapping[str, str], updates: Mapping[str, str | None]) -> dict:
  """A server's environment: the parent's, as one device (not the parent's fake CPU devices: tests, CPU
  emulation; its other XLA flags kept), no up-front grab of a GPU, then the device plan's `updates`."""
  env = dict(environ)
  if "XLA_FLAGS" in env:
    env["XLA_FLAGS"] = placement.xla_flags(env["XLA_FLAGS"])
  # Without a device plan a server still never grabs most of a GPU up front: the process that started
  # it (a learner, a test) may be using the same device. No effect on CPU.
  env[placement.PREALLOCATE_VAR] = "false"
  return placement.apply_env(env, updates)


class ServerStartError(RuntimeError):
  """The server process exited or never became healthy; the message carries its output."""


class EmbeddedServer:
  """One `python -m vcpo_jax.serving.server` process on loopback."""

  def __init__(self, model_path: str, *, weights_root: str, host: str = "127.0.0.1", port: int = 0,
               weight_version: str = "v0", extra_args: tuple[str, ...] = (), log_dir: str | None = None,
               env: Mapping[str, str | None] | None = None, cpus: frozenset[int] | None = None):
    self.env_updates = dict(env or {})
    self.cpus = cpus
    self.host, self.port = host, port or free_port(host)
    self.url = f"http://{host}:{self.port}"
    self.argv = [sys.executable, "-m", "vcpo_jax.serving.server", "--model-path", model_path,
                 "--host", host, "--port", str(self.port), "--weights-root", weights_root,
                 "--weight-version", weight_version, "--parent-pid", str(os.getpid()), *extra_args]
    log_dir = log_dir or tempfile.gettempdir()
    os.makedirs(log_dir, exist_ok=True)
    self.log_path = os.path.join(log_dir, f"server-{self.port}.log")
    self.proc: subprocess.Popen | None = None

  def start(self):
    env = server_environ(os.environ, self.env_updates)
    with placement.thread_affinity(self.cpus):
      self._log = open(self.log_path, "w")
      self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    return self

  def output(self) -> str:
    try:
      with open(self.log_path) as f:
        return f.read()[-4000:]
    except OSError:
      return ""

  def wait_healthy(self, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        raise ServerStartError(f"rollout server on port {self.port} exited with code {self.proc.returncode}; "
                               f"its output:\n{self.output()}")
      try:
        with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
          if r.status == 200:
            return self
      except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        pass
      time.sleep(0.2)
    self.stop()
    raise ServerStartError(f"rollout server on port {self.port} not healthy after {timeout:.0f}s; "
                           f"its output:\n{self.output()}")

  def stop(self, timeout: float = 10.0):
    if self.proc is None or self.proc.poll() is not None:
      return
    end_process_tree(self.proc, grace_s=timeout)
    self._log.close()


def start_servers(n: int, model_path: str, *, weights_root: str, base_port: int = 0, log_dir=None,
                  weight_version: str = "v0", timeout: float = 180.0,
                  extra_args: tuple[str, ...] = (), envs: Sequence[Mapping] | None = None,
                  cpus: frozenset[int] | None = None) -> list[EmbeddedServer]:
  """Starts n servers concurrently and waits for all; on any failure stops them all and re-raises.
  envs[i] (e.g. DevicePlan.server_envs) updates server i's environment; `cpus` confines every server."""
  if envs is not None and len(envs) != n:
    raise ValueError(f"envs has {len(envs)} entries for {n} servers")
  servers = [EmbeddedServer(model_path, weights_root=weights_root, port=(base_port + i if base_port else 0),
                            log_dir=log_dir, weight_version=weight_version, extra_args=tuple(extra_args),
                            env=None if envs is None else envs[i], cpus=cpus)
             for i in range(n)]
  try:
    for s in servers:
      s.start()
    for s in servers:
      s.wait_healthy(timeout)
  except BaseException:
    stop_servers(servers)
    raise
  return servers


def stop_servers(servers):
  for s in servers:
    s.stop()
