"""The fleet inside one heterogeneous Slurm job: learner nodes (het group 0) + rollout nodes (het group 1).

Run by experiments/launch/slurm_fleet.sh (`sbatch experiments/launch/slurm_fleet.sh [-- --config.x=y]`) on
the job's first node. One `srun` step per process, pinned to its node: JAX process i on the i-th learner
node (process 0's node is the coordinator), SERVERS_PER_NODE servers on each rollout node. The servers'
urls (node name + port) are the learner's rollout.server_urls (experiments/launch/fleet.py). When the
learner's steps end, the servers' steps are ended. DRY_RUN=1 prints every step's command and environment.

Settings (environment): CONFIG (configs/countdown.py), WORKDIR (runs/fleet-$SLURM_JOB_ID), ENGINE (sglang |
embedded), SERVER_PORT (30000), SERVERS_PER_NODE (1), COORDINATOR_PORT (12355), MIN_SERVERS (0),
SHARED_WORKDIR (0 | 1: the workdir is on a filesystem every node mounts), SERVER_MODEL (servers' starting
weights when the workdir is not shared), PYTHON (.venv/bin/python). Slurm sets SLURM_JOB_NODELIST_HET_GROUP_0/1.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys

from experiments.launch import fleet as fleet_lib


def fleet_from_env(env: dict, extra: list[str]) -> fleet_lib.Fleet:
  """The fleet this job's allocation and settings describe; errors name the missing variable."""
  for var in ("SLURM_JOB_NODELIST_HET_GROUP_0", "SLURM_JOB_NODELIST_HET_GROUP_1"):
    if not env.get(var):
      raise fleet_lib.LayoutError(f"{var} is not set: submit experiments/launch/slurm_fleet.sh with sbatch "
                                  "(a heterogeneous job: learner nodes, `#SBATCH hetjob`, rollout nodes)")
  learners = fleet_lib.expand_hostlist(env["SLURM_JOB_NODELIST_HET_GROUP_0"])
  rollout_nodes = fleet_lib.expand_hostlist(env["SLURM_JOB_NODELIST_HET_GROUP_1"])
  per_node, port = int(env.get("SERVERS_PER_NODE", "1")), int(env.get("SERVER_PORT", "30000"))
  hosts = tuple(h for h in rollout_nodes for _ in range(per_node))
  ports = tuple(port + k for _ in rollout_nodes for k in range(per_node))
  config = env.get("CONFIG", "configs/countdown.py")
  return fleet_lib.Fleet(
      config=config, workdir=os.path.abspath(env.get("WORKDIR") or f"runs/fleet-{env.get('SLURM_JOB_ID', 'x')}"),
      learner_hosts=tuple(learners), server_hosts=hosts, server_ports=ports,
      coordinator_port=int(env.get("COORDINATOR_PORT", "12355")), engine=env.get("ENGINE", "sglang"),
      min_servers=int(env.get("MIN_SERVERS", "0")), shared_workdir=env.get("SHARED_WORKDIR", "0") == "1",
      publish=fleet_lib.config_publish(config, extra),
      server_flags=fleet_lib.config_server_flags(config, extra), server_model=env.get("SERVER_MODEL", ""),
      extra=tuple(extra), python=env.get("PYTHON", ".venv/bin/python"))


def srun_command(proc: fleet_lib.Process) -> list[str]:
  """One srun step: the process on its own node of its het group, with its environment added."""
  group = "0" if proc.name.startswith("learner") else "1"
  export = ",".join(["ALL", *(f"{k}={v}" for k, v in proc.env.items())])
  return ["srun", f"--het-group={group}", "--nodes=1", "--ntasks=1", f"--nodelist={proc.host}",
          "--overlap", f"--export={export}", f"--job-name={proc.name}", *proc.argv]


def run(procs: list[fleet_lib.Process]) -> int:
  """Starts every step; waits for the learner's; then ends the servers'. Returns the first failing code."""
  steps = {p.name: subprocess.Popen(srun_command(p)) for p in procs}
  learners = [s for name, s in steps.items() if name.startswith("learner")]
  code = 0
  try:
    for step in learners:
      code = code or step.wait()
      if code:  # one learner process failed: the others cannot go on (jax.distributed would end them too)
        break
  finally:
    for step in steps.values():
      if step.poll() is None:
        step.send_signal(signal.SIGTERM)  # srun passes it to its task
    for step in steps.values():
      try:
        step.wait(timeout=60)
      except subprocess.TimeoutExpired:
        step.kill()
  return code


def main(argv: list[str]) -> int:
  extra = argv[argv.index("--") + 1:] if "--" in argv else argv
  try:
    procs = fleet_lib.processes(fleet_from_env(dict(os.environ), extra))
  except fleet_lib.LayoutError as e:
    print(f"slurm_fleet: refusing to start: {e}", file=sys.stderr)
    return 2
  if os.environ.get("DRY_RUN", "0") == "1":
    for p in procs:
      print(f"{p.name} @{p.host}: env {' '.join(f'{k}={v}' for k, v in p.env.items()) or '-'}")
      print("  " + shlex.join(srun_command(p)))
    return 0
  return run(procs)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
