"""experiments/launch/slurm_fleet.sh on a real Slurm: a cluster of two node names on this machine
(tests/slurm_cluster.py), each node 1 CPU and no GPU, the het job's resources from sbatch's command line; the
learner runs on one node, an embedded server on the other, and nothing is left running afterwards."""
import json
import os
import re
import subprocess

import pytest

from tests import slurm_cluster
from tests import waits

pytestmark = [pytest.mark.extra, pytest.mark.slow, pytest.mark.integration,
              pytest.mark.cpu_only(reason="the nodes are shrunk to one CPU and no GPU")]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
# Each component's resources, learner : servers (the script's #SBATCH lines ask for 2 nodes x 8 GPUs each).
SMALL = ["--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0", "--time=00:10:00"]
JOB_FLAGS = [f"--config.rl.steps={STEPS}", "--config.task.eval_size=2", "--config.eval_every=100",
             "--config.checkpoint_every=100"]


def _pids_naming(*paths: str) -> list[str]:
  """Live processes whose command line names one of `paths`, and any slurmstepd."""
  return [f"{pid}: {cmd[:200]}" for pid, cmd in waits.live_pids(
      lambda cmd: cmd.startswith("slurmstepd") or any(p in cmd for p in paths))]


def _component_nodes(cluster, job_id: str) -> dict[str, str]:
  """{het component: its node} from scontrol (the job stays listed for MinJobAge after it ends)."""
  out = cluster.run(["scontrol", "-o", "show", "job", job_id]).stdout
  return {re.search(r"HetJobOffset=(\d+)", line).group(1): re.search(r"\bNodeList=(\S+)", line).group(1)
          for line in out.splitlines() if "HetJobOffset=" in line}


def test_the_fleet_runs_as_one_het_job_on_a_real_two_node_slurm(tmp_path):
  # Opt-in: it installs system packages and starts root daemons, which a CI host need not allow.
  if os.environ.get("VCPO_TEST_SLURM") != "1":
    pytest.skip("opt-in: make test-slurm (VCPO_TEST_SLURM=1)")
  if os.environ.get("VCPO_TEST_SLURM_INSTALL") == "1":
    slurm_cluster.install()
  why = slurm_cluster.missing()
  if why:
    pytest.skip(f"no Slurm cluster on this machine: {why}")
  base, workdir, out = str(tmp_path / "slurm"), str(tmp_path / "run"), str(tmp_path / "job.out")
  os.makedirs(base)
  with slurm_cluster.cluster(base) as cluster:
    env = dict(cluster.env, PYTHONPATH=REPO, VCPO_PROGRESS="0", CONFIG="configs/tiny.py", WORKDIR=workdir,
               ENGINE="embedded", SHARED_WORKDIR="1", SERVER_PORT=str(slurm_cluster.free_port()),
               COORDINATOR_PORT=str(slurm_cluster.free_port()))
    submit = subprocess.run(["sbatch", "--parsable", f"--output={out}", *SMALL, ":", *SMALL,
                             "experiments/launch/slurm_fleet.sh", "--", *JOB_FLAGS],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]
    state = cluster.wait_job(job_id, timeout_s=240)
    log = open(out).read() if os.path.exists(out) else "(no job output)"
    assert state == "COMPLETED", f"{state}\n{log[-4000:]}\n{cluster.logs()}"
    nodes = _component_nodes(cluster, job_id)
    assert sorted(nodes) == ["0", "1"] and sorted(nodes.values()) == sorted(cluster.nodes), nodes

    steps = [json.loads(line)["step"] for line in open(os.path.join(workdir, "metrics.jsonl")) if line.strip()]
    assert sorted(set(steps)) == list(range(1, STEPS + 1)), steps
    served = re.findall(r"weight_version=v(\d+)", log)  # the embedded server's log, in the job's output
    assert sorted(set(map(int, served))) == list(range(STEPS + 1)), log[-4000:]  # v0: the warm start
    info = json.load(open(os.path.join(workdir, "fleet", "server0.json")))
    assert info["engine"] == "embedded" and info["url"].endswith(env["SERVER_PORT"]), info
    assert not _pids_naming(workdir), "job processes outlived the job"
  assert all(p.poll() is not None for p in cluster.daemons), "a Slurm or munge daemon is still running"
  assert not _pids_naming(workdir, base), "processes outlived the cluster"
