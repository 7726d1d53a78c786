"""Embedded server processes: a bad model dir reports the server's own error; servers exit with their parent."""
import os
import subprocess
import sys
import time

import pytest

from tests import waits
from vcpo_jax.model import config as model_config
from vcpo_jax.rollout.servers import launcher

pytestmark = pytest.mark.integration


def test_server_that_cannot_start_reports_its_output(tmp_path):
  (tmp_path / "model").mkdir()
  server = launcher.EmbeddedServer(str(tmp_path / "model"), weights_root=str(tmp_path), log_dir=str(tmp_path))
  with pytest.raises(launcher.ServerStartError, match="config.json"):
    server.start().wait_healthy(timeout=120)


_PARENT = """
import sys, time
from vcpo_jax.rollout.servers import launcher
s = launcher.EmbeddedServer(sys.argv[1], weights_root=sys.argv[2], log_dir=sys.argv[2]).start()
s.wait_healthy(timeout=300)
print(s.proc.pid, flush=True)
time.sleep(600)
"""


def test_server_exits_when_its_parent_is_killed(tmp_path):
  """A healthy server whose parent (a trainer) is SIGKILLed must not outlive it: its watchdog ends it."""
  import jax
  from vcpo_jax.model import hf
  from vcpo_jax.model import tokenizer
  from vcpo_jax.model import transformer as model
  cfg = model_config.ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                          num_kv_heads=1, head_dim=16, max_seq_len=64)
  model_dir = hf.export_hf(model.init_params(cfg, jax.random.PRNGKey(0)), cfg, str(tmp_path / "v0"),
                           tokenizer.build_tokenizer())
  parent = subprocess.Popen([sys.executable, "-c", _PARENT, model_dir, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
  server_pid = int(parent.stdout.readline())
  os.kill(server_pid, 0)  # healthy and running
  parent.kill()
  waits.wait_process(parent, 60, "the killed parent to exit")
  deadline = time.time() + 60
  while time.time() < deadline:
    try:
      os.kill(server_pid, 0)
    except ProcessLookupError:
      return
    # A zombie (exited, not yet reaped by init) counts as gone.
    with open(f"/proc/{server_pid}/stat") as f:
      if f.read().split()[2] == "Z":
        return
    time.sleep(0.5)
  pytest.fail(f"server {server_pid} outlived its killed parent")


# ------------------------------------------------------------------ device plan (pure; no GPU needed)
P, F = launcher.PREALLOCATE_VAR, launcher.MEM_FRACTION_VAR


@pytest.mark.parametrize("environ,expected", [
    ({"CUDA_VISIBLE_DEVICES": "2,3"}, ["2", "3"]),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, []),
    ({"CUDA_VISIBLE_DEVICES": ""}, []),
    ({"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "0"}, []),
    ({"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": "0"}, ["0"]),
])
def test_visible_gpus_reads_the_environment(environ, expected, tmp_path):
  assert launcher.visible_gpus(environ, str(tmp_path / "none")) == expected


def test_visible_gpus_counts_driver_entries(tmp_path):
  for name in ("0000:01:00.0", "0000:02:00.0"):
    (tmp_path / name).mkdir()
  no_smi = ("vcpo-test-no-such-nvidia-smi",)
  assert launcher.visible_gpus({}, str(tmp_path), smi=no_smi) == ["0", "1"]
  assert launcher.visible_gpus({}, str(tmp_path / "missing"), smi=no_smi) == []
  smi = (sys.executable, "-c", "print('GPU 0: A (UUID: x)'); print('GPU 1: B (UUID: y)'); print('GPU 2: C')")
  assert launcher.visible_gpus({}, str(tmp_path / "missing"), smi=smi) == ["0", "1", "2"]


@pytest.mark.parametrize("server_fraction", [0.0, 0.3])
def test_cpu_machine_plan_changes_nothing(server_fraction):
  plan = launcher.plan_devices([], 2, server_memory_fraction=server_fraction)
  assert plan == launcher.DevicePlan({}, None, ({}, {}))


def test_one_gpu_learner_and_servers_share_without_preallocating():
  plan = launcher.plan_devices(["0"], 2)
  assert plan.learner_env == {P: "false", F: None} and plan.learner_devices is None
  assert plan.server_envs == ({"CUDA_VISIBLE_DEVICES": "0", P: "false", F: None},) * 2
  capped = launcher.plan_devices(["0"], 1, learner_memory_fraction=0.6, server_memory_fraction=0.3)
  assert capped.learner_env == {P: "false", F: "0.6"}
  assert capped.server_envs[0][F] == "0.3" and capped.server_envs[0][P] == "false"


def test_several_gpus_servers_get_their_own_devices():
  plan = launcher.plan_devices(["4", "5", "6", "7"], 2)
  assert plan.learner_devices == "0,1"
  assert [e["CUDA_VISIBLE_DEVICES"] for e in plan.server_envs] == ["6", "7"]
  # Nobody shares: JAX's defaults everywhere (and no inherited settings).
  assert plan.learner_env == {P: None, F: None}
  assert all(e[P] is None and e[F] is None for e in plan.server_envs)
  # More servers than spare GPUs: round-robin over the spare ones, which are then shared between servers.
  crowded = launcher.plan_devices(["0", "1"], 3, server_memory_fraction=0.3)
  assert crowded.learner_devices == "0" and crowded.learner_env == {P: None, F: None}
  assert [e["CUDA_VISIBLE_DEVICES"] for e in crowded.server_envs] == ["1"] * 3
  assert all(e[P] == "false" and e[F] == "0.3" for e in crowded.server_envs)


def test_explicit_server_devices():
  plan = launcher.plan_devices(["0", "1", "2"], 2, server_devices="0")
  assert plan.learner_devices == "1,2" and [e["CUDA_VISIBLE_DEVICES"] for e in plan.server_envs] == ["0", "0"]
  with pytest.raises(ValueError, match="rollout.server_devices='3'"):
    launcher.plan_devices(["0", "1"], 1, server_devices="3")
  with pytest.raises(ValueError, match="rollout.server_devices='a'"):
    launcher.plan_devices(["0", "1"], 1, server_devices="a")


def test_memory_fractions_are_validated():
  with pytest.raises(ValueError, match="rollout.server_memory_fraction=1.5"):
    launcher.plan_devices(["0"], 1, server_memory_fraction=1.5)
  with pytest.raises(ValueError, match="sum to 1.1"):
    launcher.plan_devices(["0"], 2, learner_memory_fraction=0.5, server_memory_fraction=0.3)


def test_config_plan_has_no_servers_in_emulate_mode_or_with_urls():
  from configs import countdown
  env = {"CUDA_VISIBLE_DEVICES": "0"}
  assert launcher.config_plan(countdown.get_config(), env).learner_env == {P: "false", F: None}
  assert launcher.config_plan(countdown.get_config("emulate"), env).server_envs == ()
  c = countdown.get_config()
  c.rollout.server_urls = "http://h:1"
  assert launcher.config_plan(c, env).learner_env == {P: None, F: None}


def test_apply_env_sets_and_removes():
  env = {"A": "1", "B": "2"}
  assert launcher.apply_env(env, {"A": None, "C": "3"}) == {"B": "2", "C": "3"}


def test_server_environment_never_preallocates_and_takes_the_plan(tmp_path, monkeypatch):
  """The child environment, read back from the process itself (a tiny stand-in for the server module)."""
  monkeypatch.setenv(F, "0.9")  # e.g. inherited from a learner's own setting: must not reach the server
  server = launcher.EmbeddedServer("unused", weights_root=str(tmp_path), log_dir=str(tmp_path),
                                   env={"CUDA_VISIBLE_DEVICES": "1", F: None})
  server.argv = [sys.executable, "-c", f"import os, json; print(json.dumps({{k: os.environ.get(k) for k in "
                 f"('CUDA_VISIBLE_DEVICES', {P!r}, {F!r})}}))"]
  server.start()
  server.proc.wait(timeout=60)
  server._log.close()
  import json
  assert json.loads(server.output()) == {"CUDA_VISIBLE_DEVICES": "1", P: "false", F: None}


def test_rollout_plan_matches_the_job_plan():
  from configs import countdown
  c = countdown.get_config()
  c.rollout.num_servers = 2
  env = {"CUDA_VISIBLE_DEVICES": "0,1,2"}
  assert launcher.rollout_plan(c.rollout, 2, env) == launcher.config_plan(c, env)
  assert [e["CUDA_VISIBLE_DEVICES"] for e in launcher.rollout_plan(c.rollout, 2, env).server_envs] == ["1", "2"]


# ------------------------------------------------------------------ CPU pinning (rollout.server_cpus)
@pytest.mark.parametrize("spec,expected", [("", None), (" ", None), ("1", {1}), ("8-10", {8, 9, 10}),
                                           ("0,2-3", {0, 2, 3}), ("3,3", {3})])
def test_parse_cpus(spec, expected):
  assert launcher.parse_cpus(spec) == (None if expected is None else frozenset(expected))


@pytest.mark.parametrize("spec", ["a", "1-", "3-1", "-1", "1,,2", "1.5"])
def test_parse_cpus_names_the_field_and_value(spec):
  with pytest.raises(ValueError, match=f"rollout.server_cpus={spec!r}"):
    launcher.parse_cpus(spec)


@pytest.mark.parametrize("spec", ["1", "8-10", "0,2-4", "0,2,4", "3,5-6,9"])
def test_format_cpus_is_parse_cpus_inverse(spec):
  assert launcher.format_cpus(launcher.parse_cpus(spec)) == spec


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_cpus_the_machine_lacks_are_named_as_written():
  with pytest.raises(ValueError, match=r"rollout.server_cpus='4000-4002': not CPUs this machine"):
    with launcher.thread_affinity(launcher.parse_cpus("4000-4002")):
      pass


def test_bad_server_cpus_fail_the_config_check():
  from configs import countdown
  from vcpo_jax.job import configuration
  c = countdown.get_config()
  c.rollout.server_cpus = "one"
  with pytest.raises(ValueError, match="rollout.server_cpus='one'"):
    configuration.validate_config(c)


_AFFINITY = "import os; print(sorted(os.sched_getaffinity(0)), flush=True)"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_server_process_runs_on_its_cpus_and_the_caller_keeps_its_own(tmp_path):
  """The child's CPU mask, read back from the process itself; the starting thread's mask is restored."""
  mine = os.sched_getaffinity(0)
  cpu = max(mine)
  server = launcher.EmbeddedServer("unused", weights_root=str(tmp_path), log_dir=str(tmp_path),
                                   cpus=frozenset({cpu}))
  server.argv = [sys.executable, "-c", _AFFINITY]
  server.start()
  server.proc.wait(timeout=60)
  server._log.close()
  assert server.output().strip() == str([cpu])
  assert os.sched_getaffinity(0) == mine


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_unavailable_server_cpus_are_a_config_error_and_start_nothing(tmp_path):
  server = launcher.EmbeddedServer("unused", weights_root=str(tmp_path), log_dir=str(tmp_path),
                                   cpus=frozenset({4096}))
  server.argv = [sys.executable, "-c", _AFFINITY]
  mine = os.sched_getaffinity(0)
  with pytest.raises(ValueError, match="rollout.server_cpus='4096'"):
    server.start()
  assert server.proc is None and os.sched_getaffinity(0) == mine
