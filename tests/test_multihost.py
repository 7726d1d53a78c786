"""Multi-host on localhost: two processes with jax.distributed, 4 CPU devices each, one global mesh.

The forward check is quick; the job checks (marked slow) run the tiny job as 2 processes x 4 devices: killing
one process ends the other with a clear error, and the pair restarted from its checkpoint keeps the data order
and equals 1 process x 8 devices (metrics and final params); async mode with one embedded server.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests import multihost_worker as worker
from tests import waits
from tests import xla_env
from vcpo_jax.model import transformer as M
from vcpo_jax.parallel import processes
from vcpo_jax.parallel import sharding
from vcpo_jax.job import batching
from vcpo_jax.rollout.servers.launcher import free_port

CPU_ONLY = pytest.mark.cpu_only(reason="each process fakes 4 CPU devices (XLA_FLAGS host device count)")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A mesh whose fsdp axis spans both processes, so exports and evaluation gather across processes.
JOB_FLAGS = ["--config.rl.steps=4", "--config.mesh.data=1", "--config.mesh.fsdp=4", "--config.mesh.tensor=2",
             "--config.task.eval_size=2", "--config.eval_every=100", "--config.checkpoint_every=1"]
TIMING = ("throughput/", "seconds", "_s", "time")


# ------------------------------------------------------------------------------------- one process
def test_single_process_is_unchanged():
  """With one process nothing is distributed: rows pass through, params come back whole."""
  mesh = sharding.make_mesh({"data": -1})
  assert batching.process_rows(mesh, 16) == {0: (0, 16)}
  batch = object()
  assert batching.feed_rows(batch, 0, mesh, 16, 1.0) is batch
  x = jax.device_put(np.arange(16.0), sharding.batch_sharding(mesh, 1))
  np.testing.assert_array_equal(processes.to_host(x), np.arange(16.0))
  np.testing.assert_array_equal(processes.host_tree({"x": x}, "t", 1.0)["x"], np.arange(16.0))
  processes.barrier("nothing", 1.0)


def test_distributed_config_errors_name_the_field():
  from configs import tiny  # noqa: PLC0415
  processes.initialize(tiny.get_config().distributed)  # the default: one process, nothing starts
  d = tiny.get_config().distributed
  d.num_processes = 2
  with pytest.raises(ValueError, match="distributed.coordinator_address"):
    processes.initialize(d)
  d.coordinator_address, d.process_id = "localhost:1", 2
  with pytest.raises(ValueError, match="distributed.process_id=2"):
    processes.initialize(d)


def test_xm_multihost_gives_each_process_its_flags():
  from experiments.launch import xm_multihost  # noqa: PLC0415
  args = xm_multihost.process_args("configs/tiny.py", "w", 2, 1, 1234, False, ["--config.rl.steps=5"])
  assert args["config.distributed.process_id"] == "1" and args["config.distributed.num_processes"] == "2"
  assert args["config.distributed.coordinator_address"] == "localhost:1234"
  assert args["config.rl.steps"] == "5" and os.path.isabs(args["workdir"])
  auto = xm_multihost.process_args("configs/tiny.py", "w", 2, 1, 1234, True, [])
  assert auto["config.distributed.auto"] == "True" and "config.distributed.process_id" not in auto


@pytest.mark.integration
@CPU_ONLY
def test_two_process_forward_equals_single_process(tmp_path):
  port = str(free_port())
  env = dict(os.environ, XLA_FLAGS=xla_env.xla_flags(4))
  procs = [subprocess.Popen([sys.executable, "-m", "tests.multihost_worker", str(i), port, "forward",
                             str(tmp_path / f"logp{i}.npy")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  for p in procs:
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
  params = M.init_params(worker.CFG, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 16), 0, worker.CFG.vocab_size)
  want = np.asarray(M.token_logprobs(params, worker.CFG, tokens, jnp.ones_like(tokens)))
  for i in range(2):
    np.testing.assert_allclose(np.load(tmp_path / f"logp{i}.npy"), want, atol=1e-5)


@pytest.mark.integration
@CPU_ONLY
def test_a_hung_leader_ends_the_follower_with_a_clear_error():
  port = str(free_port())
  env = dict(os.environ, XLA_FLAGS=xla_env.xla_flags(4))
  procs = [subprocess.Popen([sys.executable, "-m", "tests.multihost_worker", str(i), port, "hung_leader"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  follower, _ = procs[1].communicate(timeout=300)
  procs[0].communicate(timeout=300)
  assert procs[1].returncode != 0, follower[-3000:]  # 3, or an abort if JAX's shutdown barrier gives up first
  assert ("process 1 of 2: the leader's batch for step 0 did not happen within 2 s (distributed.timeout_s): "
          "another process is hung or dead") in follower


# ------------------------------------------------------------------------------------------- the job
def _launch(workdir, mode="emulate", processes=2, port=None, extra=()):
  """Starts the job as `processes` processes (each with 8 / processes fake devices); returns the Popens.
  The runs share the suite's persistent compilation cache (conftest.py): the later ones load what the first
  compiled, on whichever xdist worker it ran."""
  variant = "emulate" if mode == "emulate" else ""
  env = dict(os.environ, JAX_PLATFORMS="cpu", VCPO_PROGRESS="0",
             XLA_FLAGS=xla_env.xla_flags(8 // processes))
  base = [sys.executable, "-m", "vcpo_jax.main", f"--config=configs/tiny.py:{variant}", f"--workdir={workdir}",
          *JOB_FLAGS, *extra]
  if processes > 1:
    base += ["--config.distributed.num_processes=2", f"--config.distributed.coordinator_address=localhost:{port}",
             "--config.distributed.heartbeat_timeout_s=10", "--config.distributed.timeout_s=300"]
  procs = []
  for i in range(processes):
    log = open(os.path.join(workdir, f"process{i}.log"), "w")
    args = base + ([f"--config.distributed.process_id={i}"] if processes > 1 else [])
    procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    log.close()
  return procs


def _log(workdir, i):
  with open(os.path.join(workdir, f"process{i}.log")) as f:
    return f.read()


def _run(workdir, **kw):
  procs = _launch(workdir, port=free_port(), **kw)
  for i, p in enumerate(procs):
    assert p.wait(timeout=600) == 0, _log(workdir, i)[-4000:]


def _lines(workdir, name):
  """Last record per step (a resumed run appends the steps it re-ran)."""
  with open(os.path.join(workdir, name)) as f:
    records = {r["step"]: r for r in map(json.loads, f)}
  return [records[s] for s in sorted(records)]


def _final_params(workdir, step=4):
  """The checkpointed params on one device here, whatever topology saved them."""
  path = os.path.join(workdir, "checkpoints", str(step), "state")
  checkpointer = ocp.StandardCheckpointer()
  meta = checkpointer.metadata(path)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                        getattr(meta, "item_metadata", meta))
  return jax.tree.map(np.asarray, checkpointer.restore(path, target)["params"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """1 process x 8 devices, emulate mode; its warm start is copied into the other runs (computed once)."""
  workdir = tmp_path_factory.mktemp("one_process")
  _run(str(workdir), processes=1)
  return str(workdir)


def _workdir_with_base(tmp_path, reference, name):
  workdir = tmp_path / name
  workdir.mkdir()
  shutil.copytree(os.path.join(reference, "base"), workdir / "base")
  return str(workdir)


@pytest.mark.slow
@pytest.mark.integration
@CPU_ONLY
def test_one_killed_process_ends_the_other_and_the_resumed_pair_equals_one_process(tmp_path, reference):
  """2 processes x 4 devices, emulate mode. SIGKILL of one process mid-run ends the other with a clear error;
  the pair restarted from the last checkpoint keeps the data order and ends with the metrics and final params
  of 1 process x 8 devices (steps before the kill from the first run, the rest from the resumed one)."""
  workdir = _workdir_with_base(tmp_path, reference, "two")
  procs = _launch(workdir, port=free_port())
  ckpt = os.path.join(workdir, "checkpoints")

  def first_checkpoint():
    assert all(p.poll() is None for p in procs), "a process ended before its first checkpoint"
    return os.path.isdir(ckpt) and "1" in os.listdir(ckpt)

  # Freeze process 1 (SIGSTOP) as soon as step 1 is committed, so the pair cannot run to the end before the kill.
  try:
    waits.wait_until(first_checkpoint, 300, "the first checkpoint", interval_s=0.005)
  except BaseException:
    procs[0].kill()  # nothing left behind by a failed wait
    waits.wait_process(procs[0], 60, "the killed process to exit")
    raise
  finally:
    procs[1].send_signal(signal.SIGSTOP)
    procs[1].send_signal(signal.SIGKILL)
  waits.wait_process(procs[1], 60, "the SIGKILLed process to exit")
  t0 = time.time()
  code = waits.wait_process(procs[0], 120, "the other process to end on the heartbeat error")
  assert code != 0
  assert time.time() - t0 < 60  # heartbeat_timeout_s=10
  log = _log(workdir, 0)
  assert ("The following tasks are unhealthy (stopped sending heartbeats)" in log
          or "ProcessGroupError" in log), log[-4000:]
  assert max(r["step"] for r in _lines(workdir, "consumed.jsonl")) < 4, "the run ended before the kill"

  _run(workdir)
  assert "resumed from checkpoint at step" in _log(workdir, 0)
  assert [r["indices"] for r in _lines(workdir, "consumed.jsonl")] == \
      [r["indices"] for r in _lines(reference, "consumed.jsonl")]
  got, want = _lines(workdir, "metrics.jsonl"), _lines(reference, "metrics.jsonl")
  assert len(got) == len(want) == 4
  for g, w in zip(got, want):
    keys = [k for k in w if isinstance(w[k], (int, float)) and not any(t in k for t in TIMING)]
    assert len(keys) > 20 and set(keys) <= set(g)
    for k in keys:
      np.testing.assert_allclose(g[k], w[k], rtol=1e-4, atol=1e-5, err_msg=f"step {w['step']} {k}")
  chex.assert_trees_all_close(_final_params(workdir), _final_params(reference), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.integration
@CPU_ONLY
def test_two_processes_async_with_one_embedded_server(tmp_path, reference):
  workdir = _workdir_with_base(tmp_path, reference, "http")
  _run(workdir, mode="http", extra=["--config.rollout.num_servers=1"])
  assert [r["step"] for r in _lines(workdir, "consumed.jsonl")] == [1, 2, 3, 4]
  with open(os.path.join(workdir, "result.json")) as f:
    assert json.load(f)["steps"] == 4
  assert os.path.isdir(os.path.join(workdir, "weights", "v4"))  # exported by gathering across processes
