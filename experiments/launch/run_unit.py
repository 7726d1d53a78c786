"""One work unit: `python -m experiments.launch.run_unit [--cpu=N] --config=... --workdir=W [--config.x=y ...]`.

Limits the unit to one thread (pinned to CPU N when given), sends its stdout and stderr to W/log.txt and
replaces itself with `python -m vcpo_jax.main <the other arguments>`. Both launchers start units this way, so
a unit behaves the same under the plain local launcher and under XManager.
"""
from __future__ import annotations

import os
import signal
import sys

from experiments.launch import workunit

# One compute thread per unit: parallelism comes from running one unit per core.
SINGLE_THREAD_ENV = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false", "OMP_NUM_THREADS": "1",
                     "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
                     "TF_NUM_INTEROP_THREADS": "1", "VCPO_PROGRESS": "0", "PYTHONUNBUFFERED": "1"}


def unit_env(environ) -> dict:
  env = dict(environ)
  xla = env.get("XLA_FLAGS", "")
  env.update(SINGLE_THREAD_ENV)
  if xla and "xla_cpu_multi_thread_eigen" not in xla:  # keep the caller's other XLA flags
    env["XLA_FLAGS"] = f"{xla} {SINGLE_THREAD_ENV['XLA_FLAGS']}"
  return env


def split_args(argv: list[str]) -> tuple[int | None, str, list[str]]:
  """(cpu or None, workdir, arguments for vcpo_jax.main)."""
  cpu, workdir, job_args = None, None, []
  for arg in argv:
    if arg.startswith("--cpu="):
      cpu = int(arg.split("=", 1)[1])
      continue
    if arg.startswith("--workdir="):
      workdir = arg.split("=", 1)[1]
    job_args.append(arg)
  if not workdir:
    raise SystemExit(f"experiments.launch.run_unit needs --workdir=..., got {argv}")
  return cpu, workdir, job_args


def main(argv: list[str]) -> None:
  cpu, workdir, job_args = split_args(argv)
  # A launcher started in the background inherits an ignored SIGINT; the job must still stop on Ctrl-C
  # (the launcher's way to stop it cleanly), so it gets the default disposition across exec.
  signal.signal(signal.SIGINT, signal.SIG_DFL)
  os.makedirs(workdir, exist_ok=True)
  if cpu is not None and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {cpu})  # inherited by the job and every thread it starts
  log_fd = os.open(os.path.join(workdir, workunit.LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
  sys.stdout.flush()
  sys.stderr.flush()
  os.dup2(log_fd, 1)
  os.dup2(log_fd, 2)
  os.close(log_fd)
  os.execve(sys.executable, [sys.executable, "-m", "vcpo_jax.main", *job_args], unit_env(os.environ))


if __name__ == "__main__":
  main(sys.argv[1:])
