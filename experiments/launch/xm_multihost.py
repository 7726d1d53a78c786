"""One multi-process learner run as an XManager job group: N jobs, one JAX process each (docs/multihost.md).

    python -m experiments.launch.xm_multihost --config=configs/countdown.py:emulate --workdir=runs/mh \
        --num_processes=2 [--devices_per_process=4] [--dry_run] [-- --config.rl.steps=60 ...]

UNTESTED with XManager itself (it is an optional extra, `pip install -e .[xmanager]`, not installed where
this was written); `--dry_run` prints the processes' commands without it (checked in tests). The executor
is XManager's Local one: the N processes run on this machine and talk over localhost, each with
`devices_per_process` fake CPU devices when > 0 (the two-process setup of tests/test_multihost.py). On a
cluster, replace the executor with yours and `coordinator_address` with process 0's host:port there (or
pass --auto, for schedulers jax.distributed detects: TPU pods, SLURM, Open MPI).
"""
from __future__ import annotations

import os
import sys

from absl import app, flags

from vcpo_jax.parallel import placement

_CONFIG = flags.DEFINE_string("config", "configs/countdown.py", "config file[:variant]")
_WORKDIR = flags.DEFINE_string("workdir", None, "the run's workdir (shared by every process)")
_NUM = flags.DEFINE_integer("num_processes", 2, "JAX processes (one job each)")
_DEVICES = flags.DEFINE_integer("devices_per_process", 0, "> 0: fake that many CPU devices per process")
_PORT = flags.DEFINE_integer("port", 0, "coordinator port on localhost (0 = a free one)")
_AUTO = flags.DEFINE_bool("auto", False, "let jax.distributed detect the cluster instead of explicit ids")
_DRY = flags.DEFINE_bool("dry_run", False, "print each process's command and exit")
flags.mark_flag_as_required("workdir")


def process_args(config: str, workdir: str, num: int, process_id: int, port: int, auto: bool,
                 extra: list[str]) -> dict[str, str]:
  """vcpo_jax.main's flags for one process as XManager's args dict (all strings, `--key=value`)."""
  args = {"config": config, "workdir": os.path.abspath(workdir)}
  if auto:
    args["config.distributed.auto"] = "True"
  else:
    args.update({"config.distributed.num_processes": str(num), "config.distributed.process_id": str(process_id),
                 "config.distributed.coordinator_address": f"localhost:{port}"})
  for arg in extra:
    key, _, value = arg.lstrip("-").partition("=")
    args[key] = value
  return args


def process_env(devices: int) -> dict[str, str]:
  return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": placement.xla_flags("", devices)} \
      if devices > 0 else {}


def main(argv):
  from vcpo_jax.rollout.servers.launcher import free_port  # noqa: PLC0415
  port = _PORT.value or free_port()
  jobs = {f"process{i}": process_args(_CONFIG.value, _WORKDIR.value, _NUM.value, i, port, _AUTO.value, argv[1:])
          for i in range(_NUM.value)}
  env = process_env(_DEVICES.value)
  if _DRY.value:
    for name, args in jobs.items():
      print(name, " ".join(f"{k}={v}" for k, v in env.items()), sys.executable, "-m vcpo_jax.main",
            " ".join(f"--{k}={v}" for k, v in args.items()))
    return
  from xmanager import xm, xm_local  # noqa: PLC0415  (optional dependency)

  with xm_local.create_experiment(experiment_title=f"vcpo multihost {os.path.basename(_WORKDIR.value)}") as exp:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    [executable] = exp.package([xm.binary(path=sys.executable, args=["-m", "vcpo_jax.main"],
                                          executor_spec=xm_local.Local.Spec(), env_vars={"PYTHONPATH": repo})])
    # One job group: XManager starts its jobs together, as jax.distributed needs (it waits for all N).
    exp.add(xm.JobGroup(**{name: xm.Job(executable, executor=xm_local.Local(), args=args, env_vars=env, name=name)
                           for name, args in jobs.items()}))

if __name__ == "__main__":
  app.run(main)
