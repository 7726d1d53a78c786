"""Work units: a sweep entry resolved to the job's exact config, its hash, record, status and command line."""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from typing import Any, Mapping

import ml_collections
from absl import flags
from ml_collections import config_flags

from experiments.launch import sweep as sweep_lib
from vcpo_jax.job import warm_start_cache

RECORD = "unit.json"           # written by the launcher before each launch
JOB_CONFIG = "config.json"     # written by the job itself (train.train_and_evaluate)
RESULT = "result.json"         # written by the job when it finishes
LOG = "log.txt"                # the unit's stdout + stderr (experiments.launch.run_unit)
WARM_START_MARKER = os.path.join("base", "warm_start.json")  # the job's warm-start cache marker


def flag_value(value: Any) -> str:
  """A value as `--config.x=<value>` expects it: strings raw (config_flags keeps quotes literally)."""
  if isinstance(value, str):
    return value
  if isinstance(value, float):
    return repr(value)
  return str(value)


def override_flags(overrides: Mapping[str, Any]) -> list[str]:
  return [f"--config.{key}={flag_value(value)}" for key, value in overrides.items()]


def resolve_config(config_spec: str, flag_list: list[str]) -> ml_collections.ConfigDict:
  """The config exactly as `vcpo_jax.main` would parse it from `--config=<spec> <flag_list>`."""
  argv = ["resolve", f"--config={config_spec}", *flag_list]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "config file", flag_values=flag_values, lock_config=True,
                                  sys_argv=argv)
  flag_values(argv)
  return flag_values.config


def config_dict(config: ml_collections.ConfigDict) -> dict:
  """Plain JSON data of a config, the same way the job writes config.json."""
  return json.loads(config.to_json_best_effort())


def hash_dict(data: Mapping) -> str:
  return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def warm_start_key(data: dict) -> str:
  """Units with equal keys compute identical warm-start weights: the hash of the settings that make them, the
  ones the job's own reuse check compares (vcpo_jax/job/warm_start_cache.py). Evaluation-only settings are left
  out: a unit that shares a warm start made under others re-evaluates it (the job does), it does not retrain."""
  return hash_dict(warm_start_cache.weight_settings(warm_start_cache.warm_start_settings(data)))


@dataclasses.dataclass
class WorkUnit:
  name: str
  labels: dict
  overrides: dict
  config_spec: str
  flags: list[str]            # --config.x=y flags: the unit's overrides, then the launch-wide extras
  workdir: str
  config: dict                # resolved config, as JSON data
  config_hash: str

  @property
  def warm_start_key(self) -> str:
    return warm_start_key(self.config)

  def job_args(self) -> list[str]:
    """Arguments of `vcpo_jax.main` (and of `experiments.launch.run_unit`, which passes them through)."""
    return [f"--config={self.config_spec}", f"--workdir={self.workdir}", *self.flags]

  def status(self) -> str:
    """'done' (result for this config), 'partial' (started, same config), 'new', 'extend' (the workdir holds
    this config with fewer rl.steps: the job resumes from its last checkpoint and runs on), or 'conflict'."""
    job_config = os.path.join(self.workdir, JOB_CONFIG)
    if not os.path.exists(job_config):
      return "new"
    with open(job_config) as f:
      held = json.load(f)
    if hash_dict(held) != self.config_hash:
      return "extend" if extends(held, self.config) else "conflict"
    return "done" if os.path.exists(os.path.join(self.workdir, RESULT)) else "partial"

  def start_extension(self) -> None:
    """Moves the shorter run's result.json aside (result_<steps>.json) so the unit reads as unfinished until
    the longer run writes its own."""
    with open(os.path.join(self.workdir, JOB_CONFIG)) as f:
      steps = json.load(f)["rl"]["steps"]
    result = os.path.join(self.workdir, RESULT)
    if os.path.exists(result):
      os.replace(result, os.path.join(self.workdir, f"result_{steps}.json"))

  def has_warm_start(self) -> bool:
    return os.path.exists(os.path.join(self.workdir, WARM_START_MARKER))


def extends(held: dict, wanted: dict) -> bool:
  """`wanted` is `held` run for more RL steps, nothing else changed, and no learning-rate schedule that reads
  rl.steps (decay_steps 0) would change under the steps already run."""
  schedule = held.get("optim", {}).get("schedule") or {}
  if schedule.get("name", "constant") != "constant" and not schedule.get("decay_steps"):
    return False
  longer = wanted.get("rl", {}).get("steps", 0) > held.get("rl", {}).get("steps", 0)
  same = lambda c: {**c, "rl": {k: v for k, v in c.get("rl", {}).items() if k != "steps"}}  # noqa: E731
  return longer and hash_dict(same(held)) == hash_dict(same(wanted))


def prepare(units: list[dict], config_spec: str, root: str, extra_flags: list[str] = (),
            validate: bool = True) -> list[WorkUnit]:
  """Names, resolves and (by default) validates every unit with the job's own validation; no side effects."""
  prepared, errors = [], []
  for unit in sweep_lib.name_units(units):
    flag_list = override_flags(sweep_lib.overrides(unit)) + list(extra_flags)
    try:
      config = resolve_config(config_spec, flag_list)
      if validate:
        from vcpo_jax.job import configuration  # noqa: PLC0415  (pulls in jax; only when validating)
        configuration.validate_config(config)
    except Exception as e:  # noqa: BLE001  (every invalid unit is reported, by name)
      errors.append(f"  {unit['name']}: {type(e).__name__}: {e}\n    flags: {' '.join(flag_list)}")
      continue
    data = config_dict(config)
    prepared.append(WorkUnit(name=unit["name"], labels=sweep_lib.labels(unit),
                             overrides=sweep_lib.overrides(unit), config_spec=config_spec, flags=flag_list,
                             workdir=os.path.abspath(os.path.join(root, unit["name"])), config=data,
                             config_hash=hash_dict(data)))
  if errors:
    raise ValueError(f"{len(errors)} of {len(units)} work units are invalid:\n" + "\n".join(errors))
  return prepared


def git_info(repo: str = ".") -> dict:
  def git(*args):
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=False).stdout.strip()
  sha = git("rev-parse", "HEAD")
  return {"git_sha": sha or None, "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def environment() -> dict:
  versions = {}
  for package in ("jax", "jaxlib", "flax", "optax", "numpy", "ml_collections", "xmanager"):
    try:
      versions[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      pass
  return {"python": platform.python_version(), "platform": platform.platform(), "host": socket.gethostname(),
          "cpus": os.cpu_count(), "packages": versions}


def write_record(unit: WorkUnit, launcher: str, command: list[str]) -> dict:
  """unit.json: name, labels, overrides, resolved config and hash, git SHA, environment, launch history."""
  os.makedirs(unit.workdir, exist_ok=True)
  path = os.path.join(unit.workdir, RECORD)
  launches = []
  if os.path.exists(path):
    with open(path) as f:
      launches = json.load(f).get("launches", [])
  launch = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "launcher": launcher, "command": command, **git_info(os.path.dirname(os.path.dirname(__file__)))}
  record = {"name": unit.name, "labels": unit.labels, "overrides": unit.overrides,
            "config_spec": unit.config_spec, "flags": unit.flags, "config_hash": unit.config_hash,
            "config": unit.config, "environment": environment(), "launches": [*launches, launch]}
  with open(path + ".tmp", "w") as f:
    json.dump(record, f, indent=2)
  os.replace(path + ".tmp", path)
  return record


def cached_warm_starts(root: str) -> list[WorkUnit]:
  """The units under another sweep's root that hold a cached warm start (donors for this sweep's units with
  the same warm-start key), from their unit.json records."""
  found = []
  for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
    workdir = os.path.join(root, name)
    if not os.path.exists(os.path.join(workdir, WARM_START_MARKER)):
      continue
    with open(os.path.join(workdir, RECORD)) as f:
      r = json.load(f)
    found.append(WorkUnit(name=r["name"], labels=r["labels"], overrides=r["overrides"], config_spec=r["config_spec"],
                          flags=r["flags"], workdir=os.path.abspath(workdir), config=r["config"],
                          config_hash=r["config_hash"]))
  return found


def share_warm_start(donor: WorkUnit, unit: WorkUnit) -> bool:
  """Copies donor's cached warm start into unit's workdir (atomically); False if the donor has none."""
  if unit.has_warm_start() or not donor.has_warm_start():
    return unit.has_warm_start()
  src, dst = os.path.join(donor.workdir, "base"), os.path.join(unit.workdir, "base")
  tmp = dst + ".copying"
  shutil.rmtree(tmp, ignore_errors=True)
  shutil.copytree(src, tmp)
  shutil.rmtree(dst, ignore_errors=True)  # a partial warm start of an earlier, killed attempt
  os.replace(tmp, dst)
  return True


def run_command(unit: WorkUnit, cpu: int | None = None, python: str = sys.executable) -> list[str]:
  cpu_flag = [] if cpu is None else [f"--cpu={cpu}"]
  return [python, "-m", "experiments.launch.run_unit", *cpu_flag, *unit.job_args()]
