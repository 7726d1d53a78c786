"""Configs: load through absl config_flags, overrides, and invalid values rejected with the field named."""
import inspect
import re
import subprocess
import sys

import json

import ml_collections
import pytest

from configs import countdown
from vcpo_jax.algo import losses
from vcpo_jax.job import configuration
from vcpo_jax.learner import optimizer as optimizer_lib
from vcpo_jax.model import config as model_config


_LOADER = """
import sys
from absl import flags
from ml_collections import config_flags
config = config_flags.DEFINE_config_file("config", None, "", lock_config=True)
flags.FLAGS(sys.argv)
print(config.value.to_json())
"""


def _load(argv):
  """Parses argv exactly as vcpo_jax.main does (absl's global flags), in a fresh interpreter."""
  proc = subprocess.run([sys.executable, "-c", _LOADER, *argv], capture_output=True, text=True, timeout=120)
  if proc.returncode:
    raise ValueError(proc.stderr[-2000:])
  return ml_collections.ConfigDict(json.loads(proc.stdout))


@pytest.mark.integration
def test_override_through_flags():
  config = _load(["--config=configs/countdown.py", "--config.model.num_layers=4", "--config.rl.max_lag=7"])
  assert config.model.num_layers == 4 and config.rl.max_lag == 7
  assert model_config.ModelConfig.from_dict(config.model).num_layers == 4


@pytest.mark.integration
def test_variant_argument():
  assert _load(["--config=configs/countdown.py:sync"]).rl.max_lag == 0
  assert countdown.get_config("emulate").rl.mode == "emulate"
  with pytest.raises(ValueError, match="bogus"):
    countdown.get_config("bogus")


@pytest.mark.integration
def test_mistyped_override_key_is_an_error_naming_it():
  with pytest.raises(ValueError, match="num_layerz"):
    _load(["--config=configs/countdown.py", "--config.model.num_layerz=4"])


@pytest.mark.integration
def test_main_rejects_mistyped_key_before_starting(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "vcpo_jax.main", "--config=configs/countdown.py",
                         f"--workdir={tmp_path}", "--config.rl.max_lagg=3"], capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode != 0 and "max_lagg" in proc.stderr
  assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("path,value,field", [
    ("rl.max_lag", -1, "rl.max_lag"),
    ("rl.group_size", 1, "rl.group_size"),
    ("task.name", "chess", "task.name"),
    ("rl.mode", "fast", "rl.mode"),
    ("algo.advantage", "ppo_gae", "ppo_gae"),
    ("algo.policy_loss", "nope", "nope"),
    ("model.vocab_size", 64, "model.vocab_size"),
    ("rl.steps", 0, "rl.steps"),
])
def test_invalid_values_name_the_field(path, value, field):
  config = countdown.get_config()
  section, key = path.split(".")
  with config.unlocked():
    config[section][key] = value
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    configuration.validate_config(config)


def test_group_size_one_allowed_without_group_baseline():
  config = countdown.get_config()
  config.rl.group_size = 1
  config.algo.advantage = "reinforce"
  config.algo.micro_batch_size = 0  # a batch-mean baseline cannot be micro-batched
  configuration.validate_config(config)
  config.algo.micro_batch_size = 32
  with pytest.raises(ValueError, match="micro_batch_size"):
    configuration.validate_config(config)


def test_micro_batch_must_hold_whole_groups():
  config = countdown.get_config()
  config.algo.micro_batch_size = 12
  with pytest.raises(ValueError, match=r"algo\.micro_batch_size=12"):
    configuration.validate_config(config)


def test_algo_ess_fields_are_scale_by_ess_keyword_arguments():
  """algo.ess is `enabled` plus exactly scale_by_ess's keyword arguments (same names, same defaults), passed
  through unrenamed."""
  params = inspect.signature(optimizer_lib.scale_by_ess).parameters
  ess = countdown.get_config().algo.ess
  assert set(ess) - {"enabled"} == set(params)
  assert {k: ess[k] for k in params} == {k: p.default for k, p in params.items()}
  config = countdown.get_config()
  config.algo.ess.update(rule="linear", trigger=0.25)
  assert configuration.ess_arguments(config) == {**{k: p.default for k, p in params.items()},
                                                 "rule": "linear", "trigger": 0.25}


def test_optim_schedule_fields_are_learning_rate_schedule_keyword_arguments():
  params = inspect.signature(optimizer_lib.learning_rate_schedule).parameters
  assert set(countdown.get_config().optim.schedule) == set(params) - {"learning_rate"}


@pytest.mark.parametrize("field,value", [("base_ess_ratio", -1.0), ("base_ess_ratio", "half"), ("rule", "cubic"),
                                         ("trigger", -1.0), ("min_ess_floor", -0.1), ("min_ess_factor", 2.0)])
@pytest.mark.parametrize("enabled", [True, False])
def test_bad_algo_ess_field_fails_naming_it_even_when_off(field, value, enabled):
  config = ml_collections.ConfigDict(countdown.get_config().to_dict(), type_safe=False)
  config.algo.ess.update({"enabled": enabled, field: value})
  with pytest.raises(ValueError, match="^" + re.escape(f"invalid config: algo.ess.{field}={value!r}: must be")):
    configuration.validate_config(config)


def test_unknown_algo_ess_field_fails():
  config = countdown.get_config()
  config.algo.ess.unlock()
  config.algo.ess.ess_rule = "linear"
  with pytest.raises(ValueError, match=r"invalid config: algo\.ess=.*ess_rule"):
    configuration.validate_config(config)


@pytest.mark.integration
def test_base_ess_ratio_number_or_auto_on_the_command_line():
  for arg, want in (("auto", "auto"), ("0.5", 0.5), ("1", 1)):
    config = _load(["--config=configs/countdown.py", f"--config.algo.ess.base_ess_ratio={arg}"])
    assert config.algo.ess.base_ess_ratio == want
    assert optimizer_lib.check_base_ess_ratio(config.algo.ess.base_ess_ratio) == want
  config = countdown.get_config()
  config.algo.ess.base_ess_ratio = "half"
  with pytest.raises(ValueError, match=r"algo\.ess\.base_ess_ratio='half'"):
    configuration.validate_config(config)


@pytest.mark.integration
def test_every_registered_option_is_settable_from_the_command_line():
  config = _load(["--config=configs/countdown.py", "--config.algo.policy_loss=ppo",
                  "--config.algo.policy_loss_options.ppo.clip_eps_low=0.1",
                  "--config.algo.policy_loss_options.ppo.rollout_is=token",
                  "--config.algo.policy_loss_options.ppo_decoupled.behav_weight_cap=3",   # None default
                  "--config.algo.advantage=grpo", "--config.algo.advantage_options.grpo.norm_by_std=false",
                  "--config.algo.grad_path=two_pass", "--config.algo.grad_norm_mode=explicit",
                  "--config.optim.schedule.name=cosine", "--config.optim.schedule.warmup_steps=5"])
  lc = configuration.learner_config(config)
  assert lc.loss_options() == losses.POLICY_LOSSES.get("ppo").options(clip_eps_low=0.1, rollout_is="token")
  assert lc.estimator_options().norm_by_std is False
  assert (lc.grad_path, lc.grad_norm_mode) == ("two_pass", "explicit")
  assert config.algo.policy_loss_options.ppo_decoupled.behav_weight_cap == 3.0
  schedule = configuration.learning_rate(config)
  assert float(schedule(0)) == 0.0 and float(schedule(5)) == pytest.approx(config.optim.learning_rate)
  assert float(schedule(config.rl.steps)) == pytest.approx(0.0, abs=1e-12)
  # Every registered name has a sub-dict holding exactly its options (a shared knob's tau excepted).
  defaults = countdown.get_config().algo
  for registry, options in ((losses.POLICY_LOSSES, defaults.policy_loss_options),
                            (losses.ADVANTAGE_ESTIMATORS, defaults.advantage_options)):
    for name in registry:
      entry = registry.get(name)
      want = [n for n in entry.option_names() if not (n == "tau" and entry.fact("uses_tau"))]
      assert sorted(options[name].keys()) == sorted(want), name


def test_linear_schedule_and_bad_schedule_name_the_field():
  config = countdown.get_config()
  config.optim.schedule.update(name="linear", warmup_steps=0, decay_steps=10, final_lr_fraction=0.1)
  lr = config.optim.learning_rate
  schedule = configuration.learning_rate(config)
  assert [float(schedule(t)) for t in (0, 5, 10, 20)] == pytest.approx([lr, lr * 0.55, lr * 0.1, lr * 0.1])
  config.optim.schedule.update(name="cosine", warmup_steps=200, decay_steps=0)
  with pytest.raises(ValueError, match=r"optim\.schedule\.decay_steps=0: must be > warmup_steps=200 for cosine "
                     rf"\(0: rl\.steps={config.rl.steps}\)"):
    configuration.validate_config(config)


@pytest.mark.parametrize("overrides,micro", [
    ({}, 32),                                                    # the main job: 4 groups of 8
    ({"algo.policy_loss": "m2po"}, 0),                           # batch-global loss: off
    ({"algo.advantage": "reinforce"}, 0),                        # batch-mean baseline: off
    ({"algo.advantage": "grpo", "algo.policy_loss": "pg"}, 32),
    ({"rl.group_size": 16, "rl.prompts_per_step": 4}, 32),
    ({"rl.group_size": 48, "rl.prompts_per_step": 2}, 48),       # one group is larger than the budget
    ({"rl.group_size": 8, "rl.prompts_per_step": 3}, 0),         # 24 rows: one chunk would be the batch
])
def test_auto_micro_batching_follows_the_registered_facts(overrides, micro):
  config = countdown.get_config()
  for path, value in overrides.items():
    section, key = path.split(".")
    config[section][key] = value
  configuration.validate_config(config)
  assert configuration.learner_config(config).micro_batch_size == micro


def test_impossible_micro_batching_fails_at_validation():
  config = countdown.get_config()
  config.algo.policy_loss = "m2po"
  config.algo.micro_batch_size = 32
  with pytest.raises(ValueError, match=r"micro_batch_size=32.*m2po"):
    configuration.validate_config(config)
  config = countdown.get_config()
  config.algo.advantage_options.opob.scope = "minibatch"
  config.algo.micro_batch_size = 32
  with pytest.raises(ValueError, match="micro_batch_size=32.*batch-global"):
    configuration.validate_config(config)
  config.algo.micro_batch_size = -1   # auto: off for the minibatch-scope baseline, and it runs
  assert configuration.learner_config(config).micro_batch_size == 0
