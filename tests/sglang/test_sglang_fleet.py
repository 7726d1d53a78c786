"""The fleet from one XManager launch with real SGLang servers: 2 learner processes x 4 fake CPU devices +
2 SGLang servers (third_party/launch_sglang.sh through experiments.launch.fleet_server) run the main job."""
import json
import os
import subprocess
import sys

import pytest

from tests.sglang.conftest import REPO, SGLANG_PYTHON, requires_sglang

pytest.importorskip("xmanager", reason="XManager is an optional extra (pip install -e '.[xmanager]')")
pytestmark = [pytest.mark.sglang, requires_sglang, pytest.mark.integration, pytest.mark.timeout(3600)]
STEPS = 3
FLAGS = [f"--config.rl.steps={STEPS}", "--config.rl.prompts_per_step=4", "--config.rl.group_size=4",
         "--config.algo.micro_batch_size=16", "--config.sft.steps=10", "--config.task.eval_size=16",
         "--config.eval_every=1000", "--config.checkpoint_every=1000", "--config.mesh.data=1",
         "--config.mesh.fsdp=4", "--config.mesh.tensor=2", "--config.distributed.timeout_s=900"]


def test_fleet_with_real_sglang_servers(tmp_path):
  workdir = str(tmp_path / "fleet")
  os.makedirs(workdir)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  # launch_sglang.sh's settings for this CPU machine; the learner ignores them. Two servers starting at once
  # next to the learner: 0.05 of host memory (the script's CPU default) can leave one no KV cache.
  env.update(VCPO_PROGRESS="0", DEVICE="cpu", DTYPE="float32", PYTHON=SGLANG_PYTHON, MEM_FRACTION="0.1")
  log_path = os.path.join(workdir, "launch.log")
  with open(log_path, "w") as log:
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.launch.xm_fleet", "--config=configs/countdown.py",
         f"--workdir={workdir}", "--learners=2", "--servers=2", "--engine=sglang", "--devices_per_process=4",
         "--", *FLAGS], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
  rc = proc.wait(timeout=3000)
  with open(log_path) as f:
    out = f.read()
  assert rc == 0, out[-5000:]
  assert "xm_fleet: learner exit codes [0, 0]" in out and "sglang.launch_server" in out
  with open(os.path.join(workdir, "consumed.jsonl")) as f:
    steps = [json.loads(line) for line in f]
  assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
  consumed = [i for r in steps for i in r["indices"]]
  assert len(consumed) == len(set(consumed)) == 4 * STEPS
