"""The same sweeps through XManager (optional extra: `pip install -e .[xmanager]`, xmanager 0.8.5):

    python -m experiments.launch.xm_launch --config=configs/countdown.py:emulate \
        --sweep=experiments/studies/claims/sweeps/lag.py --root=runs/lag [--parallel=N] [--dry_run] [--xm_<flag>=...] \
        [-- --config.rl.steps=60 ...]

XManager's Local executor runs each work unit as a plain local process (`python -m experiments.launch.run_unit`, no
docker or Bazel). It would start every unit at once, so units are added to the experiment only as slots free
up (one per core by default); each unit writes its own log under its workdir. XManager's SQLite metadata
goes to ROOT/xm/experiments.sqlite3 (`--xm_db_yaml_config_path=ROOT/xm/db.yaml`, written here).
Finished units are skipped and warm starts shared exactly as by experiments.launch.local (the same code plans both).
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable

from experiments.launch import local as launch, workunit


def db_config(root: str) -> str:
  """Writes ROOT/xm/db.yaml pointing XManager's SQLite database inside the run root; returns its path."""
  xm_dir = os.path.join(os.path.abspath(root), "xm")
  os.makedirs(xm_dir, exist_ok=True)
  path = os.path.join(xm_dir, "db.yaml")
  with open(path, "w") as f:
    f.write("sql_connector: sqlite\nsql_connection_settings:\n  backend: sqlite\n"
            f"  db_name: {os.path.join(xm_dir, 'experiments.sqlite3')}\n")
  return path


def package(xm, xm_local, experiment, python: str, module_args: list[str]):
  """One local XManager executable: `python -m MODULE` with this checkout on PYTHONPATH (no docker, no Bazel)."""
  env = {"PYTHONPATH": os.pathsep.join(filter(None, [launch.REPO, os.environ.get("PYTHONPATH")]))}
  [executable] = experiment.package([xm.binary(path=python, args=list(module_args),
                                               executor_spec=xm_local.Local.Spec(), env_vars=env)])
  return executable


@contextlib.asynccontextmanager
async def experiment(title: str, decided: Callable[[], bool]):
  """XManager's local experiment. On exit XManager awaits every job again and raises for one that did not
  return 0 (a failed unit, a server we stopped): once `decided()` says the codes are in, that error is dropped."""
  from xmanager import xm_local  # noqa: PLC0415  (optional dependency)
  try:
    async with xm_local.create_experiment(experiment_title=title) as exp:
      yield exp
  except RuntimeError:
    if not decided():
      raise


def set_flags(xm_flags: list[str], root: str) -> None:
  """Parses XManager's absl flags; its SQLite database goes inside `root` unless a --xm_db_yaml_config_path says."""
  from absl import flags  # noqa: PLC0415
  from xmanager import xm_flags as _  # noqa: F401, PLC0415  (defines the --xm_* flags)
  if not any(a.startswith("--xm_db_yaml_config_path") for a in xm_flags):
    xm_flags = [*xm_flags, f"--xm_db_yaml_config_path={db_config(root)}"]
  flags.FLAGS([sys.argv[0], *xm_flags])


def job_args(unit: workunit.WorkUnit, cpu: int | None) -> dict[str, str]:
  """`--key=value` flags of experiments.launch.run_unit as XManager's args dict (all strings: XManager would turn
  a bool into `--flag` / `--noflag`, which config_flags does not parse)."""
  args = {} if cpu is None else {"cpu": str(cpu)}
  for arg in unit.job_args():
    key, _, value = arg[2:].partition("=")
    args[key] = value
  return args


async def _run(args, todo, donors) -> dict[str, int]:
  from xmanager import xm, xm_local  # noqa: PLC0415  (optional dependency)
  title = f"vcpo {os.path.basename(os.path.abspath(args.root))} {os.path.basename(args.sweep)}"
  codes: dict[str, int] = {}

  async def start_in(exp, executable, unit: workunit.WorkUnit, slot: int) -> int:
    cpu = launch.cpu_for_slot(slot)
    workunit.write_record(unit, "xmanager", workunit.run_command(unit, cpu=cpu))
    job = xm.Job(executable, executor=xm_local.Local(experimental_stream_output=False), args=job_args(unit, cpu),
                 name=unit.name)
    work_unit = await exp.add(job)
    print(f"started {unit.name} as work unit {work_unit.work_unit_id} (cpu {cpu})", flush=True)
    try:
      await work_unit.wait_until_complete()
    except (xm.ExperimentUnitError, xm.ExperimentUnitFailedError) as e:
      print(f"{unit.name}: {e}", flush=True)
      return 1
    return 0

  async with experiment(title, lambda: any(codes.values())) as exp:  # a failed unit's code is already in codes
    executable = package(xm, xm_local, exp, sys.executable, ["-m", "experiments.launch.run_unit"])
    print(f"XManager experiment {exp.experiment_id}: {title}", flush=True)
    codes.update(await launch.run_units(
        todo, donors, lambda unit, slot: start_in(exp, executable, unit, slot), parallel=args.parallel))
  return codes


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  xm_flags = [a for a in argv if a.startswith("--xm_")]
  args, extra = launch.parse_args([a for a in argv if not a.startswith("--xm_")], __doc__)
  try:
    _, todo, donors = launch.plan(args, extra, "xmanager")
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.dry_run or not todo:
    return 0
  set_flags(xm_flags, args.root)
  launch.stop_on_signals()
  return launch.run_and_report(lambda: _run(args, todo, donors), args.root)


if __name__ == "__main__":
  sys.exit(main())
