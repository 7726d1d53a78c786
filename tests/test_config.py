"""Configs: load through absl config_flags, overrides, and invalid values rejected with the field named."""
import subprocess
import sys

import json

import ml_collections
import pytest

from configs import countdown
from vcpo_jax import configuration, model as model_lib


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


def test_override_through_flags():
  config = _load(["--config=configs/countdown.py", "--config.model.num_layers=4", "--config.rl.max_lag=7"])
  assert config.model.num_layers == 4 and config.rl.max_lag == 7
  assert model_lib.ModelConfig.from_dict(config.model).num_layers == 4


def test_variant_argument():
  assert _load(["--config=configs/countdown.py:sync"]).rl.max_lag == 0
  assert countdown.get_config("emulate").rl.mode == "emulate"
  with pytest.raises(ValueError, match="bogus"):
    countdown.get_config("bogus")


def test_mistyped_override_key_is_an_error_naming_it():
  with pytest.raises(ValueError, match="num_layerz"):
    _load(["--config=configs/countdown.py", "--config.model.num_layerz=4"])


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
