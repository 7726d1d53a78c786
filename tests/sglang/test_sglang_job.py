"""The main job (configs/countdown.py, async, k=2) against real SGLang servers, from a fresh workdir."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.sglang import verify_tags
from tests.sglang.conftest import REPO, requires_sglang, start_servers

pytestmark = [pytest.mark.sglang, requires_sglang, pytest.mark.integration, pytest.mark.timeout(3600)]
# CPU-sized: 4 prompts x 4 samples per step, a short warm start, evaluation only at the end.
SMALL = ["--config.rl.prompts_per_step=4", "--config.rl.group_size=4", "--config.algo.micro_batch_size=16",
         "--config.sft.steps=10", "--config.task.eval_size=16", "--config.eval_every=1000",
         "--config.checkpoint_every=1000", "--config.rl.max_lag=2"]


def _env(workdir):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
  # Every completed sample is logged, to recompute its tokens under the weights its tags name.
  env.update(JAX_PLATFORMS="cpu", VCPO_PROGRESS="0", VCPO_ROLLOUT_SAMPLE_LOG=os.path.join(workdir, "samples.jsonl"))
  return env


def _run(module, workdir, *flags, timeout=1200, wait=True):
  argv = [sys.executable, "-m", module, "--config=configs/countdown.py", f"--workdir={workdir}", *SMALL,
          "--config.rollout.keep_versions=100", *flags]
  log = open(os.path.join(str(workdir) + ".log"), "w")
  proc = subprocess.Popen(argv, cwd=REPO, env=_env(str(workdir)), stdout=log, stderr=subprocess.STDOUT)
  if wait:
    rc = proc.wait(timeout)
    assert rc == 0, open(str(workdir) + ".log").read()[-5000:]
  return proc


def _metrics(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _check_run(workdir, steps):
  rows = _metrics(workdir)
  assert [r["step"] for r in rows] == list(range(1, steps + 1))
  consumed = [json.loads(line) for line in open(os.path.join(workdir, "consumed.jsonl"))]
  indices = [i for c in consumed for i in c["indices"]]
  assert len(indices) == len(set(indices)) == steps * 4  # no prompt group lost or consumed twice
  lags = [r[k] for r in rows for k in r if k.startswith("rollout/max_lag_seen")]
  assert lags and max(lags) <= 2
  with open(os.path.join(workdir, "result.json")) as f:
    assert json.load(f)["steps"] == steps
  tags = verify_tags.worst_gap(os.path.join(workdir, "samples.jsonl"), os.path.join(workdir, "weights"))
  print(f"\n{workdir}: lag hist {[r.get('lag/max') for r in rows]}, tags {tags}")
  assert tags["worst"] < 1e-4  # every token is what the weights its version tag names give (float32)
  return rows


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
  """docs/sglang.md's sequence from nothing: export the starting weights, start servers on WORKDIR/base."""
  root = tmp_path_factory.mktemp("job")
  work = root / "w1"
  _run("vcpo_jax.job.export_base", work)
  assert os.path.isfile(work / "base" / "config.json")
  servers = start_servers(str(work / "base"), str(root), 2)
  try:
    yield root, work, servers
  finally:
    for s in servers:
      s.stop()


def _fresh_workdir(root, name, base):
  work = root / name
  shutil.copytree(base, work / "base")  # the same warm start, skipped by the job
  return work


def test_job_k2_against_one_server(fresh):
  root, work, servers = fresh
  _run("vcpo_jax.main", work, "--config.rl.steps=6", f"--config.rollout.server_urls={servers[0].url}")
  _check_run(str(work), 6)


def test_job_k2_against_two_servers(fresh):
  root, work, servers = fresh
  work2 = _fresh_workdir(root, "w2", work / "base")
  urls = ",".join(s.url for s in servers)
  _run("vcpo_jax.main", work2, "--config.rl.steps=6", f"--config.rollout.server_urls={urls}")
  rows = _check_run(str(work2), 6)
  assert rows[-1].get("rollout/publish_server_failures", 0) == 0


def test_server_killed_mid_run_loses_and_duplicates_nothing(fresh):
  root, work, servers = fresh
  work3 = _fresh_workdir(root, "w3", work / "base")
  urls = ",".join(s.url for s in servers)
  proc = _run("vcpo_jax.main", work3, "--config.rl.steps=8", f"--config.rollout.server_urls={urls}",
              wait=False)
  try:
    deadline = time.monotonic() + 900
    while len(_metrics(str(work3))) < 2:
      assert proc.poll() is None and time.monotonic() < deadline, open(str(work3) + ".log").read()[-5000:]
      time.sleep(0.5)
    servers[1].kill()
    assert proc.wait(1200) == 0, open(str(work3) + ".log").read()[-5000:]
  finally:
    if proc.poll() is None:
      proc.kill()
  rows = _check_run(str(work3), 8)
  assert rows[-1]["rollout/publish_server_failures"] >= 1
