"""Where the job's processes run: the GPU plan for the learner and embedded servers, and the servers' CPUs."""
import os
import sys

import pytest

from vcpo_jax.job import configuration
from vcpo_jax.parallel import placement


# ------------------------------------------------------------------ device plan (no GPU needed)
P, F = placement.PREALLOCATE_VAR, placement.MEM_FRACTION_VAR


@pytest.mark.parametrize("environ,expected", [
    ({"CUDA_VISIBLE_DEVICES": "2,3"}, ["2", "3"]),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, []),
    ({"CUDA_VISIBLE_DEVICES": ""}, []),
    ({"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "0"}, []),
    ({"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": "0"}, ["0"]),
])
def test_visible_gpus_reads_the_environment(environ, expected, tmp_path):
  assert placement.visible_gpus(environ, str(tmp_path / "none")) == expected


@pytest.mark.integration  # runs a stand-in nvidia-smi (a process)
def test_visible_gpus_counts_driver_entries(tmp_path):
  for name in ("0000:01:00.0", "0000:02:00.0"):
    (tmp_path / name).mkdir()
  no_smi = ("vcpo-test-no-such-nvidia-smi",)
  assert placement.visible_gpus({}, str(tmp_path), smi=no_smi) == ["0", "1"]
  assert placement.visible_gpus({}, str(tmp_path / "missing"), smi=no_smi) == []
  smi = (sys.executable, "-c", "print('GPU 0: A (UUID: x)'); print('GPU 1: B (UUID: y)'); print('GPU 2: C')")
  assert placement.visible_gpus({}, str(tmp_path / "missing"), smi=smi) == ["0", "1", "2"]


@pytest.mark.parametrize("server_fraction", [0.0, 0.3])
def test_cpu_machine_plan_changes_nothing(server_fraction):
  plan = placement.plan_devices([], 2, server_memory_fraction=server_fraction)
  assert plan == placement.DevicePlan({}, None, ({}, {}))


def test_one_gpu_learner_and_servers_share_without_preallocating():
  plan = placement.plan_devices(["0"], 2)
  assert plan.learner_env == {P: "false", F: None} and plan.learner_devices is None
  assert plan.server_envs == ({"CUDA_VISIBLE_DEVICES": "0", P: "false", F: None},) * 2
  capped = placement.plan_devices(["0"], 1, learner_memory_fraction=0.6, server_memory_fraction=0.3)
  assert capped.learner_env == {P: "false", F: "0.6"}
  assert capped.server_envs[0][F] == "0.3" and capped.server_envs[0][P] == "false"


def test_several_gpus_servers_get_their_own_devices():
  plan = placement.plan_devices(["4", "5", "6", "7"], 2)
  assert plan.learner_devices == "0,1"
  assert [e["CUDA_VISIBLE_DEVICES"] for e in plan.server_envs] == ["6", "7"]
  # Nobody shares: JAX's defaults everywhere (and no inherited settings).
  assert plan.learner_env == {P: None, F: None}
  assert all(e[P] is None and e[F] is None for e in plan.server_envs)
  # More servers than spare GPUs: round-robin over the spare ones, which are then shared between servers.
  crowded = placement.plan_devices(["0", "1"], 3, server_memory_fraction=0.3)
  assert crowded.learner_devices == "0" and crowded.learner_env == {P: None, F: None}
  assert [e["CUDA_VISIBLE_DEVICES"] for e in crowded.server_envs] == ["1"] * 3
  assert all(e[P] == "false" and e[F] == "0.3" for e in crowded.server_envs)


def test_explicit_server_devices():
  plan = placement.plan_devices(["0", "1", "2"], 2, server_devices="0")
  assert plan.learner_devices == "1,2" and [e["CUDA_VISIBLE_DEVICES"] for e in plan.server_envs] == ["0", "0"]
  with pytest.raises(ValueError, match="rollout.server_devices='3'"):
    placement.plan_devices(["0", "1"], 1, server_devices="3")
  with pytest.raises(ValueError, match="rollout.server_devices='a'"):
    placement.plan_devices(["0", "1"], 1, server_devices="a")


def test_memory_fractions_are_validated():
  with pytest.raises(ValueError, match="rollout.server_memory_fraction=1.5"):
    placement.plan_devices(["0"], 1, server_memory_fraction=1.5)
  with pytest.raises(ValueError, match="sum to 1.1"):
    placement.plan_devices(["0"], 2, learner_memory_fraction=0.5, server_memory_fraction=0.3)


def test_device_plan_has_no_servers_in_emulate_mode_or_with_urls():
  from configs import countdown
  env = {"CUDA_VISIBLE_DEVICES": "0"}
  assert configuration.device_plan(countdown.get_config(), env).learner_env == {P: "false", F: None}
  assert configuration.device_plan(countdown.get_config("emulate"), env).server_envs == ()
  c = countdown.get_config()
  c.rollout.server_urls = "http://h:1"
  assert configuration.device_plan(c, env).learner_env == {P: None, F: None}


def test_apply_env_sets_and_removes():
  env = {"A": "1", "B": "2"}
  assert placement.apply_env(env, {"A": None, "C": "3"}) == {"B": "2", "C": "3"}


def test_rollout_plan_matches_the_job_plan():
  from configs import countdown
  c = countdown.get_config()
  c.rollout.num_servers = 2
  env = {"CUDA_VISIBLE_DEVICES": "0,1,2"}
  assert placement.rollout_plan(c.rollout, 2, env) == configuration.device_plan(c, env)
  assert [e["CUDA_VISIBLE_DEVICES"] for e in placement.rollout_plan(c.rollout, 2, env).server_envs] == ["1", "2"]


# ------------------------------------------------------------------ CPU pinning (rollout.server_cpus)
@pytest.mark.parametrize("spec,expected", [("", None), (" ", None), ("1", {1}), ("8-10", {8, 9, 10}),
                                           ("0,2-3", {0, 2, 3}), ("3,3", {3})])
def test_parse_cpus(spec, expected):
  assert placement.parse_cpus(spec) == (None if expected is None else frozenset(expected))


@pytest.mark.parametrize("spec", ["a", "1-", "3-1", "-1", "1,,2", "1.5"])
def test_parse_cpus_names_the_field_and_value(spec):
  with pytest.raises(ValueError, match=f"rollout.server_cpus={spec!r}"):
    placement.parse_cpus(spec)


@pytest.mark.parametrize("spec", ["1", "8-10", "0,2-4", "0,2,4", "3,5-6,9"])
def test_format_cpus_is_parse_cpus_inverse(spec):
  assert placement.format_cpus(placement.parse_cpus(spec)) == spec


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_cpus_the_machine_lacks_are_named_as_written():
  with pytest.raises(ValueError, match=r"rollout.server_cpus='4000-4002': not CPUs this machine"):
    with placement.thread_affinity(placement.parse_cpus("4000-4002")):
      pass


def test_bad_server_cpus_fail_the_config_check():
  from configs import countdown
  from vcpo_jax.job import configuration
  c = countdown.get_config()
  c.rollout.server_cpus = "one"
  with pytest.raises(ValueError, match="rollout.server_cpus='one'"):
    configuration.validate_config(c)


# ------------------------------------------------------------------ XLA flags of the processes a job starts
@pytest.mark.parametrize("flags,devices,expected", [
    ("--xla_force_host_platform_device_count=8 --xla_gpu_enable_latency_hiding_scheduler=true", 0,
     "--xla_gpu_enable_latency_hiding_scheduler=true"),
    ("--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8", 4,
     "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=4"),
    ("", 0, ""),
    ("", 2, "--xla_force_host_platform_device_count=2"),
])
def test_xla_flags_replace_only_the_fake_device_count(flags, devices, expected):
  assert placement.xla_flags(flags, devices) == expected


def test_a_server_keeps_the_users_xla_flags_but_not_the_fake_devices():
  from vcpo_jax.rollout.servers import launcher
  environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_gpu_autotune_level=2", "HOME": "/h"}
  env = launcher.server_environ(environ, {"CUDA_VISIBLE_DEVICES": "1", "HOME": None})
  assert env == {"XLA_FLAGS": "--xla_gpu_autotune_level=2", P: "false", "CUDA_VISIBLE_DEVICES": "1"}
  assert launcher.server_environ({}, {}) == {P: "false"}  # no XLA_FLAGS invented
