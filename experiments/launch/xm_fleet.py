"""A run's whole fleet as ONE XManager job group: N learner processes + M rollout servers (docs/multihost.md).

    python -m experiments.launch.xm_fleet --config=configs/tiny.py --workdir=runs/fleet \
        --learners=2 --servers=2 [--engine=embedded|sglang] [--devices_per_process=4] [--min_servers=1] \
        [--dry_run] [-- --config.rl.steps=6 ...]

XManager's Local executor (xmanager 0.8.5, `pip install -e .[xmanager]`) runs every job as a plain local
process: no docker, no Bazel. The launch picks free ports, passes process 0's address to the learners and the
servers' urls to the learner (experiments/launch/fleet.py), and when the learner's processes end it stops the
servers; SIGTERM or Ctrl+C stops the whole group. Each job's output lines reach this process's stdout
prefixed by the job's name. `--dry_run` prints every process's command and environment and starts nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time

from experiments.launch import fleet as fleet_lib
from experiments.launch import xm_launch  # XManager's packaging, experiment and flags, shared with the sweeps


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  """This launch's flags, and the learner's after `--` (argparse, not absl: no flag names shared with
  vcpo_jax.main or other launches imported into the same process)."""
  p = argparse.ArgumentParser(prog="python -m experiments.launch.xm_fleet", description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/countdown.py", help="config file[:variant]")
  p.add_argument("--workdir", required=True, help="the run's workdir")
  p.add_argument("--learners", type=int, default=1, help="JAX learner processes (one job each)")
  p.add_argument("--servers", type=int, default=1, help="rollout servers (one job each)")
  p.add_argument("--engine", choices=fleet_lib.ENGINES, default="embedded", help="embedded or real SGLang")
  p.add_argument("--min_servers", type=int, default=0, help="RL starts once this many servers answer (0: all)")
  p.add_argument("--devices_per_process", type=int, default=0, help="> 0: fake that many CPU devices per learner")
  p.add_argument("--dry_run", action="store_true", help="print each process's command and environment")
  argv = list(argv)
  cut = argv.index("--") if "--" in argv else len(argv)
  return p.parse_args(argv[:cut]), argv[cut + 1:]


def local_fleet(config: str, workdir: str, learners: int, servers: int, extra: list[str], *, engine="embedded",
                min_servers=0, devices=0, ports=None) -> fleet_lib.Fleet:
  """The fleet on this machine: every process on localhost, free ports (or `ports`: coordinator first)."""
  if ports is None:
    from vcpo_jax.rollout.servers.launcher import free_port  # noqa: PLC0415
    ports = [free_port() for _ in range(servers + 1)]
  return fleet_lib.Fleet(
      config=config, workdir=os.path.abspath(workdir), learner_hosts=("localhost",) * learners,
      server_hosts=("127.0.0.1",) * servers, server_ports=tuple(ports[1:]), coordinator_port=ports[0],
      engine=engine, min_servers=min_servers, devices_per_process=devices,
      publish=fleet_lib.config_publish(config, extra),
      server_flags=fleet_lib.config_server_flags(config, extra), extra=tuple(extra))


def _jobs(xm, xm_local, exp, procs: list[fleet_lib.Process]):
  jobs = {}
  for p in procs:
    python, *argv = p.argv
    module_args, flag_args = argv[:2], argv[2:]  # ("-m", module), then --key=value flags
    executable = xm_launch.package(xm, xm_local, exp, python, module_args)
    args = dict(a[2:].split("=", 1) for a in flag_args)
    jobs[p.name] = xm.Job(executable, executor=xm_local.Local(experimental_stream_output=True), args=args,
                          env_vars=p.env, name=p.name)
  return jobs


async def _exited(handles, timeout_s: float = float("inf"), stop_on_failure: bool = False,
                  stop: asyncio.Event | None = None) -> bool:
  """Polls until every handle's process has exited (or one failed, or `stop` is set, or the timeout). The
  processes belong to XManager's own event loop (its thread), which sets their returncode: they cannot be
  awaited from here."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
    codes = [h.process.returncode for h in handles]
    if all(c is not None for c in codes) or (stop_on_failure and any(codes)):
      return True
    await asyncio.sleep(0.5)
  return False


def _group_alive(pgid: int) -> bool:
  try:
    os.killpg(pgid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


async def _end(handles, grace_s: float = 10.0) -> None:
  """SIGTERM each job's process group, then SIGKILL the groups that outlive `grace_s`.

  By group, because a job is `/bin/sh -c COMMAND` in a session of its own (start_new_session), and its
  processes (the server, SGLang's scheduler and detokenizer) are members. The grace is short: a learner
  process outlives SIGTERM (jax.distributed's preemption service takes it), and its checkpoints are atomic,
  so the relaunch resumes from the last one."""
  groups = [h.process.pid for h in handles]
  for pgid in groups:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(pgid, signal.SIGTERM)
  for sig in (signal.SIGKILL, None):
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(map(_group_alive, groups)):
      await asyncio.sleep(0.2)
    for pgid in filter(_group_alive, groups) if sig else ():
      with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


async def launch(procs: list[fleet_lib.Process], title: str) -> int:
  """Adds the one job group; waits for the learner's jobs (or a stop signal); then stops the servers.
  Returns the first failing learner's code, 143 when stopped, else 0."""
  from xmanager import xm, xm_local  # noqa: PLC0415  (optional dependency)
  codes: list = []
  stopped = False
  # The servers we stop (and a job killed mid-run) never return 0: once the learner's codes are in, they decide.
  async with xm_launch.experiment(title, lambda: bool(codes)) as exp:
    work_unit = await exp.add(xm.JobGroup(**_jobs(xm, xm_local, exp, procs)))
    # xmanager 0.8.5's local work unit keeps its jobs' handles (name, process) here; waiting on the
    # learner's alone is how the servers (which never exit by themselves) are stopped when the run is over.
    handles = {h.name: h for h in work_unit._local_execution_handles}  # noqa: SLF001
    learners = [h for name, h in handles.items() if name.startswith("learner")]
    servers = [h for name, h in handles.items() if name.startswith("server")]
    stop = asyncio.Event()  # SIGTERM or Ctrl+C: stop the whole group, then return
    for sig in (signal.SIGTERM, signal.SIGINT):
      asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
      await _exited(learners, stop_on_failure=True, stop=stop)
    finally:
      await _end(servers + learners)
    codes = [h.process.returncode for h in learners]
    stopped = stop.is_set()
  if stopped:
    print("xm_fleet: stopped the group on a signal", flush=True)
    return 143  # as a process ended by SIGTERM
  print(f"xm_fleet: learner exit codes {codes}", flush=True)
  return next((c if c > 0 else 128 - c for c in codes if c), 0)  # -N (killed by signal N) as the shell says


def main(argv: list[str]) -> int:
  args, extra = parse_args(argv)
  try:
    procs = fleet_lib.processes(local_fleet(args.config, args.workdir, args.learners, args.servers, extra,
                                            engine=args.engine, min_servers=args.min_servers,
                                            devices=args.devices_per_process))
  except fleet_lib.LayoutError as e:
    print(f"xm_fleet: refusing to start: {e}", file=sys.stderr)
    return 2
  if args.dry_run:
    print(fleet_lib.describe(procs))
    return 0
  xm_launch.set_flags([], args.workdir)
  title = f"vcpo fleet {os.path.basename(os.path.abspath(args.workdir))}"
  return asyncio.run(launch(procs, title))


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
