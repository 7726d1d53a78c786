"""The main job end to end on a tiny config: async with a real embedded server, lag emulation, resume after
SIGKILL with the same data order, invalid config before anything starts, failed checkpoint writes."""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request


import pytest

import waits
from configs import tiny
from vcpo_jax.job import train
from vcpo_jax.model import config as model_config
from tests import xla_env

pytestmark = [pytest.mark.slow]


def tiny_config(**overrides):
  c = tiny.get_config()
  for key, value in overrides.items():
    section, _, field = key.rpartition(".")
    (c[section] if section else c)[field] = value
  return c


def _jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


@pytest.mark.integration
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_async_run_with_embedded_server_on_rollout_server_cpus(tmp_path):
  """The async job with one embedded server, confined by rollout.server_cpus (its own log line says where it
  runs; the learner's CPUs stay as they were): metrics, evaluations, checkpoints, kept weight versions, and a
  rerun in the same workdir resumes at the end and does nothing more."""
  import glob
  cpu = max(os.sched_getaffinity(0))
  mine = os.sched_getaffinity(0)
  config = lambda: tiny_config(**{"rollout.server_cpus": str(cpu)})  # noqa: E731
  result = train.train_and_evaluate(config(), str(tmp_path))
  assert result["steps"] == 3 and os.sched_getaffinity(0) == mine
  [log] = glob.glob(str(tmp_path / "logs" / "server-*.log"))
  assert f"CPUs [{cpu}]" in open(log).read()
  assert 0.0 <= result["final"]["eval/greedy_accuracy"] <= 1.0
  scalars = _jsonl(tmp_path / "metrics.jsonl")
  assert [s["step"] for s in scalars] == [1, 2, 3]
  for s in scalars:
    assert 0.0 < s["ess_ratio"] <= 1.0
    assert s["lag/max"] <= 1
    # The learner's wait for the publish is part of the step; the publish itself runs beside the next one.
    phases = [s[f"throughput/{p}_seconds"] for p in ("wait", "learn", "publish_blocked")]
    assert min(phases) >= 0.0 and sum(phases) == pytest.approx(s["throughput/step_seconds"], rel=1e-6)
    assert s["throughput/publish_seconds"] > 0.0
  assert "eval/greedy_accuracy" in scalars[1]
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tensorboard"))
  assert sorted(os.listdir(tmp_path / "checkpoints"))[-1] == "3"
  # Weight directories beyond keep_versions were deleted.
  assert len([d for d in os.listdir(tmp_path / "weights") if d.startswith("v")]) <= 3
  # Rerunning with the same workdir resumes at the end and does nothing more.
  again = train.train_and_evaluate(config(), str(tmp_path))
  assert again["steps"] == 3 and len(_jsonl(tmp_path / "metrics.jsonl")) == 3


def _run_main(workdir, extra=()):
  cmd = [sys.executable, "-m", "vcpo_jax.main", "--config=configs/tiny.py:emulate", f"--workdir={workdir}",
         "--config.rl.steps=8", "--config.rl.max_lag=2", "--config.eval_every=100",
         "--config.checkpoint_every=2", *extra]
  env = dict(os.environ, VCPO_PROGRESS="0")
  env["XLA_FLAGS"] = xla_env.xla_flags()
  return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)


def _consumed_by_step(workdir):
  by_step = {}
  for entry in _jsonl(os.path.join(workdir, "consumed.jsonl")):
    by_step[entry["step"]] = entry["indices"]  # a step replayed after a kill is overwritten
  return by_step


def test_resume_after_sigkill_continues_steps_and_data_order(tmp_path):
  straight, killed = tmp_path / "straight", tmp_path / "killed"
  proc = _run_main(straight)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-3000:]

  proc = _run_main(killed)
  ckpt = killed / "checkpoints"

  def first_checkpoint():
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    return ckpt.exists() and "2" in os.listdir(ckpt)

  # With the compiles cached by the first run a step takes milliseconds: watch closely and freeze the job
  # (SIGSTOP) as soon as its first checkpoint is committed, so it cannot run to the end before the kill.
  try:
    waits.wait_until(first_checkpoint, 600, "the killed run's checkpoint of step 2", interval_s=0.005)
  finally:
    os.kill(proc.pid, signal.SIGSTOP)
    os.kill(proc.pid, signal.SIGKILL)
    waits.wait_process(proc, 60, "the SIGKILLed job to exit")
  steps_before = max(_consumed_by_step(killed))
  assert steps_before < 8, "the run finished before it could be killed"
  proc = _run_main(killed)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-3000:]
  assert "resumed from checkpoint at step" in out
  assert _consumed_by_step(killed) == _consumed_by_step(straight)
  assert json.load(open(killed / "result.json"))["steps"] == 8
  # The emulator's past versions were checkpointed too: the resumed run samples every step from the same
  # stale policy as the straight one (same lags; same importance weights, hence the same ESS).
  straight_m, killed_m = _metrics_by_step(straight), _metrics_by_step(killed)
  assert sorted(killed_m) == list(range(1, 9))
  for step in range(1, 9):
    lags = {k: v for k, v in straight_m[step].items() if k.startswith("lag/frac_")}
    assert lags and {k: killed_m[step][k] for k in lags} == lags, step
    assert killed_m[step]["ess_ratio"] == pytest.approx(straight_m[step]["ess_ratio"], rel=1e-5), step


def _metrics_by_step(workdir):
  return {entry["step"]: entry for entry in _jsonl(os.path.join(workdir, "metrics.jsonl"))}


def test_invalid_config_fails_before_anything_starts(tmp_path):
  with pytest.raises(ValueError, match=r"rl\.max_lag"):
    train.train_and_evaluate(tiny_config(**{"rl.max_lag": -2}), str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()


def _server_pids(workdir):
  """The job's embedded servers: started on its weights root (WORKDIR/weights, or the RAM-backed directory it
  links to)."""
  roots = {str(workdir), os.path.realpath(os.path.join(workdir, "weights"))}
  out = "".join(subprocess.run(["pgrep", "-f", f"vcpo_jax.serving.server --model-path {root}"], capture_output=True,
                               text=True).stdout for root in roots)
  return sorted({int(p) for p in out.split()})


@pytest.mark.integration
def test_ctrl_c_stops_the_servers(tmp_path):
  workdir = tmp_path / "w"
  env = dict(os.environ, VCPO_PROGRESS="0")
  env["XLA_FLAGS"] = xla_env.xla_flags()
  # A shell without job control starts background jobs with SIGINT ignored, and children inherit an ignored
  # signal across exec (CI may run us so). A handled one is reset to the default on exec: give the job the
  # disposition a terminal's Ctrl-C would find.
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    proc = subprocess.Popen([sys.executable, "-m", "vcpo_jax.main", "--config=configs/tiny.py",
                             f"--workdir={workdir}", "--config.rl.steps=1000"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  finally:
    signal.signal(signal.SIGINT, previous)

  def first_metrics():
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    return (workdir / "metrics.jsonl").exists()

  try:
    waits.wait_until(first_metrics, 600, "the job's first metrics.jsonl line", interval_s=0.5)
  except AssertionError:
    proc.kill()
    raise
  assert _server_pids(workdir), "the job should be running an embedded server"
  proc.send_signal(signal.SIGINT)
  proc.communicate(timeout=120)
  time.sleep(1)
  assert _server_pids(workdir) == []


@pytest.mark.integration
def test_async_run_against_server_urls(tmp_path):
  """rollout.server_urls: the job starts no server, publishes its starting weights to the given one."""
  import jax
  from vcpo_jax.model import hf_export
  from vcpo_jax.model import tokenizer
  from vcpo_jax.model import transformer as model_lib
  from vcpo_jax.rollout.servers import launcher
  config = tiny_config(**{"rl.steps": 2})
  cfg = model_config.ModelConfig.from_dict(config.model)
  start = hf_export.export_hf(model_lib.init_params(cfg, jax.random.PRNGKey(7)), cfg, str(tmp_path / "start"),
                       tokenizer.build_tokenizer())
  server = launcher.EmbeddedServer(start, weights_root=str(tmp_path), log_dir=str(tmp_path)).start()
  try:
    server.wait_healthy(timeout=300)
    config.rollout.server_urls = server.url
    result = train.train_and_evaluate(config, str(tmp_path / "w"))
    assert result["steps"] == 2
    assert _server_pids(tmp_path / "w") == []
    with urllib.request.urlopen(server.url + "/get_model_info", timeout=10) as r:
      assert json.load(r)["weight_version"] == "v2"
  finally:
    server.stop()
