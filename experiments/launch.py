"""Runs a sweep's work units locally, one `vcpo_jax.main` process each: `python -m experiments.launch
--config=configs/countdown.py --sweep=experiments/sweeps/ablation.py[:arg] --root=runs/ablation [--parallel=1]
[--dry_run] [-- extra --config.x=y flags applied to every unit]`."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time


def load_sweep(spec: str) -> list[dict]:
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise ValueError(f"--sweep file does not exist: {path!r}")
  module_spec = importlib.util.spec_from_file_location("sweep", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  units = module.get_sweep(arg)
  names = [u.get("name") for u in units]
  if any(not n for n in names) or len(set(names)) != len(names):
    raise ValueError(f"every work unit of {path} needs a unique 'name', got {names}")
  return units


def unit_command(config: str, workdir: str, overrides: dict, extra: list[str]) -> list[str]:
  flags = [f"--config.{key}={json.dumps(value) if isinstance(value, str) else value}"
           for key, value in overrides.items() if key != "name"]
  return [sys.executable, "-m", "vcpo_jax.main", f"--config={config}", f"--workdir={workdir}", *flags, *extra]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--config", required=True)
  parser.add_argument("--sweep", required=True)
  parser.add_argument("--root", required=True, help="one workdir per unit under this directory")
  parser.add_argument("--parallel", type=int, default=1)
  parser.add_argument("--dry_run", action="store_true")
  args, extra = parser.parse_known_args(argv)
  extra = [e for e in extra if e != "--"]
  units = load_sweep(args.sweep)
  os.makedirs(args.root, exist_ok=True)
  commands = {u["name"]: unit_command(args.config, os.path.join(args.root, u["name"]), u, extra) for u in units}
  with open(os.path.join(args.root, "sweep.json"), "w") as f:
    json.dump({"config": args.config, "sweep": args.sweep, "units": units, "extra": extra}, f, indent=2)
  if args.dry_run:
    for name, cmd in commands.items():
      print(name, " ".join(cmd))
    return 0
  pending, running, failed = list(commands.items()), {}, []
  env = dict(os.environ, VCPO_PROGRESS="0")
  while pending or running:
    while pending and len(running) < args.parallel:
      name, cmd = pending.pop(0)
      log = open(os.path.join(args.root, f"{name}.log"), "w")
      running[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log)
      print(f"started {name}", flush=True)
    for name, (proc, log) in list(running.items()):
      if proc.poll() is not None:
        log.close()
        del running[name]
        print(f"finished {name}: exit {proc.returncode}", flush=True)
        if proc.returncode:
          failed.append(name)
    time.sleep(1)
  if failed:
    print(f"failed units: {failed} (see their .log files in {args.root})")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
