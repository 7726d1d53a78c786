"""The whole fleet from one XManager launch (Local executor): 2 learner processes x 4 fake CPU devices + 2
embedded servers run the tiny job; one server is SIGKILLed mid-run, the group is stopped and relaunched,
and the run resumes from its checkpoint and finishes with every prompt consumed once."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from tests import waits

pytest.importorskip("xmanager", reason="XManager is an optional extra (pip install -e '.[xmanager]')")
pytestmark = [pytest.mark.slow, pytest.mark.integration,
              pytest.mark.cpu_only(reason="each learner process fakes 4 CPU devices")]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, GROUPS_PER_STEP, MAX_LAG = 10, 2, 1  # configs/tiny.py: rl.prompts_per_step=2, rl.max_lag=1
JOB_FLAGS = [f"--config.rl.steps={STEPS}", "--config.mesh.data=1", "--config.mesh.fsdp=4",
             "--config.mesh.tensor=2", "--config.task.eval_size=2", "--config.eval_every=100",
             "--config.checkpoint_every=1", "--config.distributed.heartbeat_timeout_s=10",
             "--config.distributed.timeout_s=300"]


def _launch(workdir: str, log_name: str) -> subprocess.Popen:
  env = dict(os.environ, VCPO_PROGRESS="0")
  with open(os.path.join(workdir, log_name), "w") as log:
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.launch.xm_fleet", "--config=configs/tiny.py", f"--workdir={workdir}",
         "--learners=2", "--servers=2", "--devices_per_process=4", "--min_servers=1", "--", *JOB_FLAGS],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _read(workdir: str, name: str) -> str:
  with open(os.path.join(workdir, name)) as f:
    return f.read()


def _fleet_pids(workdir: str) -> list[int]:
  """Live processes whose command line names the workdir (learners, servers), this test excluded."""
  return [pid for pid, _ in waits.live_pids(lambda cmd: workdir in cmd and "experiments.launch.xm_fleet" not in cmd)]


def _wait_for(path: str, launcher: subprocess.Popen, workdir: str, log: str, timeout: float = 400):
  def appeared():
    assert launcher.poll() is None, f"the launch ended before {path} appeared:\n{_read(workdir, log)[-4000:]}"
    return os.path.exists(path)
  waits.wait_until(appeared, timeout, f"{path} to appear", interval_s=0.2)


def test_fleet_survives_a_dead_server_and_resumes_after_a_relaunch(tmp_path):
  workdir = str(tmp_path / "fleet")
  os.makedirs(workdir)
  first = _launch(workdir, "launch1.log")
  try:
    _wait_for(os.path.join(workdir, "checkpoints", "2"), first, workdir, "launch1.log")
    server1 = json.loads(_read(workdir, "fleet/server1.json"))
    os.kill(server1["pid"], signal.SIGKILL)  # mid-run: the client routes around it
    _wait_for(os.path.join(workdir, "checkpoints", "4"), first, workdir, "launch1.log")
    first.send_signal(signal.SIGTERM)  # stop the whole group
    assert waits.wait_process(first, 120, "the launch to stop its group") == 143
  finally:
    if first.poll() is None:
      first.kill()
  waits.wait_until(lambda: not _fleet_pids(workdir), 60, "every process of the stopped group to exit")
  log1 = _read(workdir, "launch1.log")
  assert "xm_fleet: stopped the group on a signal" in log1, log1[-4000:]
  metrics = [json.loads(line) for line in _read(workdir, "metrics.jsonl").splitlines()]
  assert any(m.get("rollout/marked_down", 0) >= 1 for m in metrics), "the client never saw server1 die"

  second = _launch(workdir, "launch2.log")
  assert second.wait(timeout=600) == 0, _read(workdir, "launch2.log")[-4000:]
  log2 = _read(workdir, "launch2.log")
  resumed = re.search(r"resumed from checkpoint at step (\d+)", log2)
  assert resumed and 4 <= int(resumed.group(1)) < STEPS, log2[-4000:]  # stopped mid-run, then went on
  assert "xm_fleet: learner exit codes [0, 0]" in log2
  assert not _fleet_pids(workdir)  # the servers were stopped when the learner finished

  records = {}
  for line in _read(workdir, "consumed.jsonl").splitlines():  # a resumed run re-logs the steps it re-ran
    record = json.loads(line)
    records[record["step"]] = record["indices"]
  assert sorted(records) == list(range(1, STEPS + 1))
  consumed = [i for step in sorted(records) for i in records[step]]
  assert all(len(records[s]) == GROUPS_PER_STEP for s in records)
  assert len(consumed) == len(set(consumed)), f"a prompt was consumed twice: {records}"
  missing = set(range(max(consumed) + 1)) - set(consumed)
  # Only groups admitted last may still have been in flight when the run ended; none was lost before.
  assert all(i > max(consumed) - GROUPS_PER_STEP * (MAX_LAG + 1) for i in missing), (missing, records)
