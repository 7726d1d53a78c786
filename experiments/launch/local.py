"""Runs a sweep's work units as local processes, one per core:

    python -m experiments.launch --config=configs/countdown.py:emulate \
        --sweep=experiments/studies/claims/sweeps/ablation.py:k=64,seeds=3 --root=runs/ablation [--parallel=N] [--dry_run] \
        [-- --config.rl.steps=60 ...]   # extra flags applied to every unit

Every unit gets ROOT/<name>/ with unit.json (resolved config, config hash, git SHA), the job's own files and
log.txt. A relaunch skips finished units (result.json present and the job's config.json hashes equal) and
resumes unfinished ones from their checkpoints; a workdir that holds a different config is an error.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from typing import Awaitable, Callable

from experiments.launch import workunit
from vcpo_jax.job import config_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_sweep(spec: str) -> list[dict]:
  """`path/to/sweep.py[:arg]` -> the module's get_sweep(arg)."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise ValueError(f"--sweep file does not exist: {path!r}")
  return config_file.load(path).get_sweep(arg)


def absolute_config_spec(spec: str) -> str:
  path, sep, arg = spec.partition(":")
  return os.path.abspath(path) + sep + arg


def prepare_sweep(config: str, sweep: str, root: str, extra: list[str], validate: bool = True):
  """Resolved units and a status per unit; raises if a workdir holds another config."""
  units = workunit.prepare(load_sweep(sweep), absolute_config_spec(config), root, extra, validate=validate)
  status = {u.name: u.status() for u in units}
  conflicts = [n for n, s in status.items() if s == "conflict"]
  if conflicts:
    raise ValueError(f"workdirs under {root} hold runs of a different config: {conflicts} (config.json hash "
                     "differs); delete them or choose another --root")
  return units, status


def write_sweep_record(root: str, config: str, sweep: str, extra: list[str], units, launcher: str):
  os.makedirs(root, exist_ok=True)
  with open(os.path.join(root, "sweep.json"), "w") as f:
    json.dump({"config": config, "sweep": sweep, "extra": extra, "launcher": launcher,
               "units": [{"name": u.name, "labels": u.labels, "flags": u.flags, "config_hash": u.config_hash,
                          "warm_start_key": u.warm_start_key} for u in units]}, f, indent=2)


def warm_start_donors(units, todo) -> dict[str, workunit.WorkUnit]:
  """For each unit to run, the unit whose warm start it copies (the first of its group; None for that one)."""
  donors, first = {}, {}
  for u in units:  # a finished unit with a cached warm start is the best donor: nothing to wait for
    if u.has_warm_start():
      first.setdefault(u.warm_start_key, u)
  for u in todo:
    donor = first.setdefault(u.warm_start_key, u)
    donors[u.name] = None if donor is u else donor
  return donors


StartFn = Callable[[workunit.WorkUnit, int], Awaitable[int]]


async def run_units(todo, donors, start: StartFn, *, parallel: int, poll_s: float = 1.0) -> dict[str, int]:
  """Runs `start(unit, slot)` for every unit with at most `parallel` at once; a unit whose warm start comes
  from a donor waits until the donor's cached warm start exists (or the donor has ended)."""
  pending, running, free_slots, codes = list(todo), {}, list(range(parallel)), {}
  while pending or running:
    for unit in list(pending):
      if not free_slots:
        break
      donor = donors.get(unit.name)
      if donor is not None and not donor.has_warm_start() and donor.name not in codes:
        continue
      if donor is not None:
        await asyncio.to_thread(workunit.share_warm_start, donor, unit)
      pending.remove(unit)
      slot = free_slots.pop(0)
      running[asyncio.create_task(start(unit, slot))] = (unit, slot)
    if not running:
      await asyncio.sleep(poll_s)
      continue
    done, _ = await asyncio.wait(running, timeout=poll_s, return_when=asyncio.FIRST_COMPLETED)
    for task in done:
      unit, slot = running.pop(task)
      codes[unit.name] = task.result() if task.exception() is None else -1
      if task.exception() is not None:
        print(f"{unit.name}: {task.exception()!r}", flush=True)
      free_slots.append(slot)
      print(f"finished {unit.name}: exit {codes[unit.name]}", flush=True)
  return codes


def cpu_for_slot(slot: int) -> int | None:
  cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
  return cpus[slot % len(cpus)] if cpus else None


def default_parallel() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


async def _start_local(unit: workunit.WorkUnit, slot: int) -> int:
  cmd = workunit.run_command(unit, cpu=cpu_for_slot(slot))
  workunit.write_record(unit, "local", cmd)
  print(f"started {unit.name} (cpu {cpu_for_slot(slot)})", flush=True)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
  proc = await asyncio.create_subprocess_exec(*cmd, cwd=REPO, env=env, stdin=asyncio.subprocess.DEVNULL)
  try:
    return await proc.wait()
  except asyncio.CancelledError:
    await stop_process(proc)
    raise


async def stop_process(proc, grace_s: float = 30.0) -> None:
  """Ctrl-C first (the job stops its servers; checkpoints stay valid), SIGKILL if it has not ended in time."""
  if proc.returncode is None:
    proc.send_signal(signal.SIGINT)
    try:
      await asyncio.wait_for(proc.wait(), grace_s)
    except asyncio.TimeoutError:
      proc.kill()
      await proc.wait()


def _raise_interrupt(signum, frame):
  raise KeyboardInterrupt(f"signal {signum}")


def stop_on_signals() -> None:
  """Ctrl-C and SIGTERM stop the launch and its units, also when started in the background (where SIGINT
  arrives ignored)."""
  signal.signal(signal.SIGINT, _raise_interrupt)
  signal.signal(signal.SIGTERM, _raise_interrupt)


def parse_args(argv, description: str):
  parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument("--config", required=True, help="config file[:arg], as for vcpo_jax.main")
  parser.add_argument("--sweep", required=True, help="sweep file[:arg] with get_sweep(arg)")
  parser.add_argument("--root", required=True, help="one workdir per unit under this directory")
  parser.add_argument("--parallel", type=int, default=default_parallel(), help="units at once (default: cores)")
  parser.add_argument("--dry_run", action="store_true", help="resolve and validate every unit; run nothing")
  parser.add_argument("--no_share_warm_start", action="store_true",
                      help="every unit computes its own warm start (by default units with identical warm-start "
                           "inputs copy the first one's)")
  parser.add_argument("--warm_starts_from", action="append", default=[], metavar="ROOT",
                      help="another sweep's root whose cached warm starts units with the same warm-start inputs "
                           "copy (repeatable)")
  args, extra = parser.parse_known_args(argv)
  extra = [e for e in extra if e != "--"]
  bad = [e for e in extra if not e.startswith("--config.")]
  if bad:
    parser.error(f"extra arguments must be --config.<field>=<value> flags, got {bad}")
  if args.parallel < 1:
    parser.error(f"--parallel must be >= 1, got {args.parallel}")
  return args, extra


def plan(args, extra, launcher: str):
  """Shared by both launchers: units, what to run, warm-start donors; prints the plan."""
  for root in args.warm_starts_from:
    if not os.path.isdir(root):
      raise ValueError(f"--warm_starts_from={root!r} is not a directory")
  units, status = prepare_sweep(args.config, args.sweep, args.root, extra)
  todo = [u for u in units if status[u.name] != "done"]
  for u in units:
    print(f"{status[u.name]:8s} {u.name}  [{u.config_hash}]  {' '.join(u.flags)}")
  print(f"{len(units)} units: {len(units) - len(todo)} done, {len(todo)} to run "
        f"({sum(status[u.name] == 'partial' for u in todo)} resume, "
        f"{sum(status[u.name] == 'extend' for u in todo)} extend)", flush=True)
  if not args.dry_run:
    write_sweep_record(args.root, args.config, args.sweep, extra, units, launcher)
    for u in todo:
      if status[u.name] == "extend":
        u.start_extension()
  if args.no_share_warm_start:
    return units, todo, {}
  others = [u for root in args.warm_starts_from for u in workunit.cached_warm_starts(root)]
  donors = warm_start_donors(units + others, todo)
  return units, todo, donors


def main(argv=None) -> int:
  args, extra = parse_args(argv, __doc__)
  try:
    _, todo, donors = plan(args, extra, "local")
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.dry_run or not todo:
    return 0
  stop_on_signals()
  return run_and_report(lambda: run_units(todo, donors, _start_local, parallel=args.parallel), args.root)


def run_and_report(make_coroutine, root: str) -> int:
  """Runs the launch coroutine; the exit code says whether every unit succeeded (130 when interrupted)."""
  try:
    codes = asyncio.run(make_coroutine())
  except KeyboardInterrupt:
    print("stopped; running units were interrupted (relaunch the same command to resume them)", flush=True)
    return 130
  failed = sorted(n for n, c in codes.items() if c)
  if failed:
    print(f"failed units: {failed} (see log.txt in their workdirs under {root})")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
