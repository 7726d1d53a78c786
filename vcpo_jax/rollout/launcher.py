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


def free_port(host: str = "127.0.0.1") -> int:
  with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


class ServerStartError(RuntimeError):
  """The server process exited or never became healthy; the message carries its output."""


class EmbeddedServer:
  """One `python -m vcpo_jax.rollout.server` process on loopback."""

  def __init__(self, model_path: str, *, weights_root: str, host: str = "127.0.0.1", port: int = 0,
               weight_version: str = "v0", extra_args: tuple[str, ...] = (), log_dir: str | None = None):
    self.host, self.port = host, port or free_port(host)
    self.url = f"http://{host}:{self.port}"
    self.argv = [sys.executable, "-m", "vcpo_jax.rollout.server", "--model-path", model_path,
                 "--host", host, "--port", str(self.port), "--weights-root", weights_root,
                 "--weight-version", weight_version, "--parent-pid", str(os.getpid()), *extra_args]
    log_dir = log_dir or tempfile.gettempdir()
    os.makedirs(log_dir, exist_ok=True)
    self.log_path = os.path.join(log_dir, f"server-{self.port}.log")
    self.proc: subprocess.Popen | None = None

  def start(self):
    self._log = open(self.log_path, "w")
    # JAX in the server must not grab the fake multi-device flag of the parent (tests) or all CPU threads.
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
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
    with contextlib.suppress(ProcessLookupError):
      os.killpg(self.proc.pid, signal.SIGTERM)
    try:
      self.proc.wait(timeout)
    except subprocess.TimeoutExpired:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait()
    self._log.close()


def start_servers(n: int, model_path: str, *, weights_root: str, base_port: int = 0, log_dir=None,
                  weight_version: str = "v0", timeout: float = 180.0,
                  extra_args: tuple[str, ...] = ()) -> list[EmbeddedServer]:
  """Starts n servers concurrently and waits for all; on any failure stops them all and re-raises."""
  servers = [EmbeddedServer(model_path, weights_root=weights_root, port=(base_port + i if base_port else 0),
                            log_dir=log_dir, weight_version=weight_version, extra_args=tuple(extra_args))
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
