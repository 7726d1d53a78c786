"""The machine, software versions and git commit a benchmark ran on (`python -m benchmarks.common.environment`)."""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from typing import Sequence

from benchmarks.common import model_choice

VERSION_PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "flax", "optax", "orbax-checkpoint",
                    "torch", "transformers")


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.lower().startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def package_versions(names: Sequence[str] = VERSION_PACKAGES) -> dict[str, str | None]:
  out = {}
  for name in names:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def git_commit(root: str | None = None) -> str:
  """Short HEAD commit of the checkout ('+uncommitted' when tracked files differ); $BENCH_COMMIT overrides
  (a copy of the tree without .git)."""
  if os.environ.get("BENCH_COMMIT"):
    return os.environ["BENCH_COMMIT"]
  root = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  try:
    run = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=10)
    sha = run("rev-parse", "--short", "HEAD").stdout.strip()
    dirty = run("status", "--porcelain", "--untracked-files=no").stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return (sha + ("+uncommitted" if dirty else "")) if sha else "unknown"


def environment() -> dict:
  """Date, machine and software versions; the jax backend and devices are read from a live jax."""
  import jax
  devices = jax.devices()
  return {
      "model": model_choice.resolve_model(backend=jax.default_backend()),
      "commit": git_commit(),
      "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
      "cpu_model": cpu_model(),
      "cpu_cores": os.cpu_count(),
      "load_avg": [round(x, 1) for x in os.getloadavg()],  # 1, 5, 15 min: a shared machine's timings follow it
      "python": sys.version.split()[0],
      "platform": platform.platform(),
      "backend": jax.default_backend(),
      "devices": f"{len(devices)} x {devices[0].device_kind}",
      "versions": package_versions(),
  }


if __name__ == "__main__":
  # run.py asks a child process for this, so the parent never initialises (and preallocates) an accelerator.
  print(json.dumps(environment()))
