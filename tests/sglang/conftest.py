"""Real SGLang 0.5.23 servers (CPU engine) for the opt-in `make test-sglang` suite; skipped everywhere else."""
import contextlib
import os
import signal
import subprocess
import time
import urllib.request

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SGLANG_PYTHON = os.environ.get("SGLANG_PYTHON") or os.path.expanduser(
    "~/.cache/vcpo_jax/sglang-cpu/venv/bin/python")
ENABLED = os.environ.get("VCPO_TEST_SGLANG") == "1"
requires_sglang = pytest.mark.skipif(
    not (ENABLED and os.path.exists(SGLANG_PYTHON)),
    reason="real-SGLang tests run only with `make test-sglang` (VCPO_TEST_SGLANG=1 and the SGLang CPU venv)")


def pytest_configure(config):
  config.addinivalue_line("markers", "sglang: needs real SGLang servers (make test-sglang; skipped otherwise)")


class SGLangServer:
  """One `third_party/launch_sglang.sh` server (DEVICE=cpu, float32) on loopback, in its own process group."""

  def __init__(self, model_dir: str, port: int, log_path: str, *, weight_version: str = "v0",
               flags: tuple = (), **env):
    self.url, self.port, self.log_path = f"http://127.0.0.1:{port}", port, log_path
    environ = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    environ.update(HOST="127.0.0.1", DEVICE="cpu", DTYPE="float32", PYTHON=SGLANG_PYTHON,
                   WEIGHT_VERSION=weight_version, **env)
    with open(log_path, "w") as log:
      extra = ("--", *flags) if flags else ()  # SGLang's own flags (e.g. LoRA's)
      self.proc = subprocess.Popen([os.path.join(REPO, "third_party", "launch_sglang.sh"), model_dir, str(port),
                                    *extra],
                                   stdout=log, stderr=subprocess.STDOUT, env=environ, start_new_session=True)

  def wait_ready(self, timeout: float = 300.0) -> "SGLangServer":
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        raise RuntimeError(f"SGLang exited with {self.proc.returncode}:\n{self.output()}")
      try:
        with urllib.request.urlopen(self.url + "/get_model_info", timeout=2) as r:
          if r.status == 200:
            return self
      except OSError:
        pass
      time.sleep(1.0)
    self.stop()
    raise RuntimeError(f"SGLang on port {self.port} not ready after {timeout:.0f}s:\n{self.output()}")

  def output(self) -> str:
    with contextlib.suppress(OSError), open(self.log_path) as f:
      return f.read()[-4000:]
    return ""

  def kill(self) -> None:
    """SIGKILL to the whole group (HTTP server, scheduler, detokenizer): a server that dies outright."""
    with contextlib.suppress(ProcessLookupError):
      os.killpg(self.proc.pid, signal.SIGKILL)
    self.proc.wait()

  def stop(self) -> None:
    if self.proc.poll() is not None:
      return self.kill()  # reap the group's leftovers too
    with contextlib.suppress(ProcessLookupError):
      os.killpg(self.proc.pid, signal.SIGTERM)
    try:
      self.proc.wait(30)
    except subprocess.TimeoutExpired:
      pass
    self.kill()


def start_servers(model_dir: str, log_dir: str, n: int, **kw) -> list[SGLangServer]:
  """n servers started together (each takes ~40-60 s to load on CPU); all stopped if any fails."""
  from vcpo_jax.rollout.servers.launcher import free_port
  servers = [SGLangServer(model_dir, free_port(), os.path.join(log_dir, f"sglang{i}.log"), **kw)
             for i in range(n)]
  try:
    for s in servers:
      s.wait_ready()
  except BaseException:
    for s in servers:
      s.stop()
    raise
  return servers
