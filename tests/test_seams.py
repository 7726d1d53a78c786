"""The seams chosen by name: rollout backends declare their needs, tasks and their options come from the command line."""
import dataclasses
import json
import subprocess
import sys

import ml_collections
import pytest

from configs import countdown, qwen2_5
from vcpo_jax import registry, tasks
from vcpo_jax.job import configuration
from vcpo_jax.rollout import backend

_LOADER = """
import json, sys
from absl import flags
from ml_collections import config_flags
config = config_flags.DEFINE_config_file("config", None, "", lock_config=True)
flags.FLAGS(sys.argv)
print(json.dumps({"name": config.value.task.name, "options": config.value.task.options.to_dict()}))
"""


def _task_section(argv):
  """task.name and task.options as vcpo_jax.main parses them (absl flags, locked config), in a fresh process."""
  proc = subprocess.run([sys.executable, "-c", _LOADER, *argv], capture_output=True, text=True, timeout=120)
  if proc.returncode:
    raise ValueError(proc.stderr[-2000:])
  return json.loads(proc.stdout)


@pytest.mark.integration  # parses the flags in a fresh process, as vcpo_jax.main does
def test_a_task_and_its_options_are_chosen_on_the_command_line():
  out = _task_section(["--config=configs/countdown.py", "--config.task.name=arithmetic",
                       "--config.task.options.arithmetic.max_digits=2", "--config.task.options.arithmetic.ops=+"])
  config = countdown.get_config()
  config.task.name = out["name"]
  config.task.options = ml_collections.ConfigDict(out["options"])
  configuration.validate_config(config)
  task = configuration.build_task(config)
  assert isinstance(task, tasks.Arithmetic)
  assert (task.max_digits, task.ops) == (2, "+")


@pytest.mark.integration
def test_a_task_option_typed_int_or_none_is_set_on_the_command_line():
  """`num_numbers: int | None` (a PEP 604 union): the flag parses as an int (it failed in config_flags)."""
  out = _task_section(["--config=configs/countdown.py", "--config.task.options.countdown.num_numbers=3",
                       "--config.task.options.countdown.trace_checks=2"])
  assert out["options"]["countdown"]["num_numbers"] == 3 and out["options"]["countdown"]["trace_checks"] == 2


def test_optional_option_fields_take_their_inner_type():
  from typing import Optional
  assert configuration._field_type(int | None) is int and configuration._field_type(Optional[float]) is float
  assert configuration._field_type(str) is str and configuration._field_type(int | str) == int | str
  ref = configuration.options_config(tasks.TASKS).countdown.get_ref("num_numbers")
  assert ref.get() is None and ref._field_type is int


@pytest.mark.integration
def test_an_unknown_task_option_fails_naming_the_flag():
  with pytest.raises(ValueError, match="max_digitz"):
    _task_section(["--config=configs/countdown.py", "--config.task.options.arithmetic.max_digitz=2"])


def test_a_task_option_the_task_refuses_fails_at_validation_naming_it():
  config = countdown.get_config()
  config.task.name = "arithmetic"
  config.task.options.arithmetic.max_digits = 0
  with pytest.raises(ValueError, match=r"invalid config: task\.options\.arithmetic=.*max_digits"):
    configuration.validate_config(config)


def test_the_old_task_kwargs_section_is_an_error_naming_its_replacement():
  config = countdown.get_config()
  config.task.kwargs = ml_collections.ConfigDict(dict(num_numbers=2))
  with pytest.raises(ValueError, match=r"task\.kwargs=.*task\.options\.countdown"):
    configuration.validate_config(config)


def test_every_registered_task_has_an_options_sub_dict_with_its_constructor_defaults():
  config = countdown.get_config()
  assert sorted(config.task.options) == tasks.TASKS.names()
  assert config.task.options.arithmetic.to_dict() == {
      "min_digits": 1, "max_digits": 3, "ops": tasks.arithmetic.ALL_OPS, "eval_fraction": 0.1,
      "environment": "", "environment_options": "", "max_turns": 4}  # every task may have an environment
  assert all("tool_pool" not in sub for sub in config.task.options.values())  # the job passes it in


def test_the_old_mode_name_async_says_the_new_one():
  config = countdown.get_config()
  config.rl.mode = "async"
  with pytest.raises(ValueError, match=r"rl\.mode='async' was renamed 'http'"):
    configuration.validate_config(config)
  config.rl.mode = "grpc"
  with pytest.raises(ValueError, match=r"rl\.mode='grpc'.*\['emulate', 'http'"):
    configuration.validate_config(config)


@pytest.mark.parametrize("mode,host_params,embedded", [("http", False, True), ("emulate", True, False)])
def test_backends_declare_their_needs(mode, host_params, embedded):
  config = countdown.get_config()
  config.rl.mode = mode
  assert backend.needs(config, "host_params") is host_params
  assert backend.needs(config, "embedded_servers") is embedded
  # The device plan counts servers from the declared need (no servers with rollout.server_urls).
  assert len(configuration.device_plan(config, environ={"JAX_PLATFORMS": "cpu"}).server_envs) == (1 if embedded else 0)
  config.rollout.server_urls = "http://127.0.0.1:1"
  assert configuration.device_plan(config, environ={"JAX_PLATFORMS": "cpu"}).server_envs == ()


def _backend_config_classes():
  from vcpo_jax.rollout import http_backend
  from vcpo_jax.rollout.emulation import emulator
  return [http_backend.HttpBackendConfig, emulator.EmulatedBackendConfig]


@pytest.mark.parametrize("index", [0, 1])
def test_a_backends_typed_config_is_its_fields_of_the_job_config(index):
  config_cls = _backend_config_classes()[index]
  config = countdown.get_config()
  config.seed, config.rl.max_lag, config.rl.temperature, config.rollout.server_cpus = 7, 5, 0.5, "1-2"
  cfg = backend.read_config(config_cls, config)
  assert (cfg.seed, cfg.max_lag, cfg.temperature) == (7, 5, 0.5)
  config_files = [config, qwen2_5.get_config()]  # model.hf_path is a pretrained config's field
  for f in dataclasses.fields(config_cls):  # every field is named as a config names it, in its section
    sections = [c[f.metadata["section"]] if f.metadata["section"] else c for c in config_files]
    assert any(f.name in section for section in sections), (f.metadata["section"], f.name)
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.max_lag = 1
  del config.rl["group_size"]
  with pytest.raises(ValueError, match=r"rl\.group_size is missing"):
    backend.read_config(config_cls, config)


def test_a_backend_config_field_with_a_default_may_be_absent():
  from vcpo_jax.rollout import http_backend
  config = countdown.get_config()
  del config.rollout["server_cpus"]
  assert backend.read_config(http_backend.HttpBackendConfig, config).server_cpus == ""
  assert backend.read_config(http_backend.HttpBackendConfig, config).server_urls == config.rollout.server_urls


def test_one_registry_type_serves_every_kind_of_choice():
  from vcpo_jax.algo import advantages, policy_losses
  for reg in (advantages.ESTIMATORS, policy_losses.LOSSES, backend.BACKENDS, tasks.TASKS):
    assert isinstance(reg, registry.Registry)
  with pytest.raises(ValueError, match="unknown fact"):
    backend.BACKENDS.register("x", needs_grad_norms=True)  # a loss fact is not a backend fact


def test_a_lazy_registration_imports_its_module_only_when_called():
  reg = registry.Registry("thing", facts={})
  reg.register_lazy("json_dumps", "json:dumps")
  reg.register_lazy("missing", "vcpo_jax.no_such_module:f")
  assert reg.get("json_dumps").fn([1]) == "[1]"
  with pytest.raises(ModuleNotFoundError):
    reg.get("missing").fn()
