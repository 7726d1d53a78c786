"""The fleet's launch plans (XManager and Slurm) line by line, the layout refusal, and min_servers."""
import asyncio
import os
import subprocess
import sys

import pytest

from experiments.launch import fleet, fleet_server, slurm_fleet, xm_fleet
from vcpo_jax.rollout.client import pool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def _local(learners=2, servers=2, extra=(), **kw):
  return xm_fleet.local_fleet("configs/tiny.py", "/w", learners, servers, list(extra),
                              ports=[5000, 6001, 6002, 6003][:servers + 1], **kw)


def test_local_fleet_gives_every_process_its_whole_command_line():
  procs = fleet.processes(_local(devices=4, min_servers=1, extra=["--config.rl.steps=5"]))
  assert [p.name for p in procs] == ["server0", "server1", "learner0", "learner1"]
  for j in range(2):
    assert procs[j].env == {} and procs[j].argv == (
        PY, "-m", "experiments.launch.fleet_server", "--engine=embedded", f"--name=server{j}",
        "--model_dir=/w/base", "--ready_file=/w/base/warm_start.json", "--host=127.0.0.1",
        f"--port={6001 + j}", "--weights_root=/w/weights", "--info_dir=/w/fleet")
  for i in range(2):
    assert procs[2 + i].env == {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    assert procs[2 + i].argv == (
        PY, "-m", "vcpo_jax.main", "--config=configs/tiny.py", "--workdir=/w",
        "--config.rollout.server_urls=http://127.0.0.1:6001,http://127.0.0.1:6002",
        "--config.rollout.min_servers=1", "--config.distributed.num_processes=2",
        f"--config.distributed.process_id={i}", "--config.distributed.coordinator_address=localhost:5000",
        "--config.rl.steps=5")


def test_one_learner_process_gets_no_distributed_flags():
  [server, learner] = fleet.processes(_local(learners=1, servers=1))
  assert server.name == "server0" and not any("distributed" in a for a in learner.argv)
  assert "--config.rollout.server_urls=http://127.0.0.1:6001" in learner.argv and learner.env == {}


def test_xm_dry_run_prints_each_process(capsys):
  assert xm_fleet.main(["--workdir=/w", "--config=configs/tiny.py", "--learners=2", "--servers=1",
                        "--devices_per_process=4", "--dry_run", "--", "--config.rl.steps=3"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert [line.split(" ")[0] for line in lines] == ["server0", "learner0", "learner1"]
  assert lines[1].startswith("learner0 @localhost: JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_")
  assert lines[1].endswith("--config.rl.steps=3") and "--config.distributed.process_id=0" in lines[1]


SLURM_ENV = {"SLURM_JOB_NODELIST_HET_GROUP_0": "l[1-2]", "SLURM_JOB_NODELIST_HET_GROUP_1": "r[08-09]",
             "SLURM_JOB_ID": "77", "WORKDIR": "/shared/run", "SHARED_WORKDIR": "1", "PYTHON": "py"}


def test_slurm_plan_runs_one_srun_step_per_process_on_its_node():
  procs = fleet.processes(slurm_fleet.fleet_from_env(SLURM_ENV, ["--config.rl.steps=5"]))
  cmds = {p.name: slurm_fleet.srun_command(p) for p in procs}
  assert cmds["server1"] == [
      "srun", "--het-group=1", "--nodes=1", "--ntasks=1", "--nodelist=r09", "--overlap", "--export=ALL",
      "--job-name=server1", "py", "-m", "experiments.launch.fleet_server", "--engine=sglang", "--name=server1",
      "--model_dir=/shared/run/base", "--ready_file=/shared/run/base/warm_start.json", "--host=0.0.0.0",
      "--port=30000", "--weights_root=/shared/run/weights", "--info_dir=/shared/run/fleet"]
  assert cmds["learner1"] == [
      "srun", "--het-group=0", "--nodes=1", "--ntasks=1", "--nodelist=l2", "--overlap", "--export=ALL",
      "--job-name=learner1", "py", "-m", "vcpo_jax.main", "--config=configs/countdown.py", "--workdir=/shared/run",
      "--config.rollout.server_urls=http://r08:30000,http://r09:30000", "--config.rollout.min_servers=0",
      "--config.distributed.num_processes=2", "--config.distributed.process_id=1",
      "--config.distributed.coordinator_address=l1:12355", "--config.rl.steps=5"]
  assert sorted(cmds) == ["learner0", "learner1", "server0", "server1"]


def test_slurm_servers_per_node_take_consecutive_ports():
  f = slurm_fleet.fleet_from_env({**SLURM_ENV, "SERVERS_PER_NODE": "2", "SERVER_PORT": "31000"}, [])
  assert fleet.server_urls(f) == ["http://r08:31000", "http://r08:31001", "http://r09:31000", "http://r09:31001"]


def test_slurm_without_a_het_job_says_how_to_submit():
  with pytest.raises(fleet.LayoutError, match="SLURM_JOB_NODELIST_HET_GROUP_1 is not set: submit"):
    slurm_fleet.fleet_from_env({"SLURM_JOB_NODELIST_HET_GROUP_0": "l1"}, [])


def test_remote_servers_without_shared_workdir_or_wire_are_refused():
  env = {k: v for k, v in SLURM_ENV.items() if k != "SHARED_WORKDIR"}
  with pytest.raises(fleet.LayoutError, match=r"rollout.publish='disk'.*SHARED_WORKDIR=1.*publish=wire"):
    fleet.processes(slurm_fleet.fleet_from_env(env, []))
  # Over the wire the weights need no shared workdir, but the servers still need starting weights.
  with pytest.raises(fleet.LayoutError, match="--server_model=DIR"):
    fleet.processes(slurm_fleet.fleet_from_env(env, ["--config.rollout.publish=wire"]))
  wire = fleet.processes(slurm_fleet.fleet_from_env({**env, "SERVER_MODEL": "/models/q"},
                                                    ["--config.rollout.publish=wire"]))
  assert "--model_dir=/models/q" in wire[0].argv and not any(a.startswith("--ready_file") for a in wire[0].argv)


def test_a_local_fleet_is_never_refused_and_bad_counts_are():
  fleet.check(_local())  # every process on this machine: the workdir is the servers' too
  with pytest.raises(fleet.LayoutError, match=r"min_servers=3 must be in \[0, 2\]"):
    fleet.check(_local(min_servers=3))
  with pytest.raises(fleet.LayoutError, match="must look like --config"):
    fleet.processes(_local(extra=["--steps=3"]))


def test_config_publish_reads_the_flag_then_the_file():
  assert fleet.config_publish("configs/tiny.py", ["--config.rollout.publish=wire"]) == "wire"
  assert fleet.config_publish("configs/tiny.py:emulate", []) == "disk"
  with pytest.raises(fleet.LayoutError, match="does not exist"):
    fleet.config_publish("configs/nope.py", [])


def test_expand_hostlist():
  assert fleet.expand_hostlist("r[01-03,7],l1,gpu-a[9-10]x") == ["r01", "r02", "r03", "r7", "l1", "gpu-a9x",
                                                                 "gpu-a10x"]


def test_fleet_server_commands():
  args, extra = fleet_server.parse(["--engine=sglang", "--model_dir=/m", "--port=7", "--host=0.0.0.0", "--",
                                    "--tp-size", "2"])
  assert fleet_server.server_command(args, extra) == [
      "bash", os.path.join(REPO, "third_party", "launch_sglang.sh"), "/m", "7", "--", "--tp-size", "2"]
  assert fleet_server.server_env(args)["HOST"] == "0.0.0.0"
  args, extra = fleet_server.parse(["--model_dir=/m", "--port=7", "--weights_root=/w"])
  cmd = fleet_server.server_command(args, extra)
  assert cmd[:3] == [sys.executable, "-m", "vcpo_jax.serving.server"]
  assert cmd[3:13] == ["--model-path", "/m", "--host", "127.0.0.1", "--port", "7", "--weight-version", "v0",
                       "--weights-root", "/w"]


def test_fleet_server_gives_up_waiting_with_a_clear_error(tmp_path):
  with pytest.raises(SystemExit, match="did not appear within 0.05s"):
    fleet_server.wait_for(str(tmp_path / "never"), 0.05, poll_s=0.01)


def test_min_servers_deadline_names_the_setting_and_the_silent_servers():
  async def wait():
    async with pool.ServerPool(["http://127.0.0.1:9", "http://127.0.0.1:1"], health_interval=0.05,
                               health_timeout=0.5) as p:
      await p.wait_for_servers(1, 0.2, "rollout.min_servers=1")
  with pytest.raises(pool.RolloutError, match=r"0 of 2 rollout servers answered within 0.2s, "
                                              r"rollout.min_servers=1 asks for 1; not answering"):
    asyncio.run(wait())


@pytest.mark.integration
def test_slurm_script_dry_mode_prints_every_step():
  env = {**os.environ, **SLURM_ENV, "DRY_RUN": "1", "PYTHON": sys.executable}
  out = subprocess.run(["bash", "experiments/launch/slurm_fleet.sh", "--", "--config.rl.steps=5"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert [line.split(" ")[0] for line in lines[::2]] == ["server0", "server1", "learner0", "learner1"]
  assert lines[5].strip().startswith("srun --het-group=0 --nodes=1 --ntasks=1 --nodelist=l1 ")
  assert lines[5].endswith("--config.rl.steps=5")
  refused = subprocess.run(["bash", "experiments/launch/slurm_fleet.sh"], cwd=REPO, capture_output=True,
                           env={k: v for k, v in env.items() if k != "SHARED_WORKDIR"}, text=True, timeout=120)
  assert refused.returncode == 2 and "refusing to start" in refused.stderr and not refused.stdout
