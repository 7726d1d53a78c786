"""The `reward` and `tools` config sections: typed once, each bad field an error naming it, in the reference."""
import dataclasses
import math
import re

import ml_collections
import pytest

from configs import countdown
from vcpo_jax.calls import settings
from vcpo_jax.job import config_reference, configuration
from vcpo_jax.job.startup_errors import one_line
from vcpo_jax.rollout import episodes, rewards

SECTIONS = {"reward": (configuration.reward_config, rewards.RewardConfig),
            "tools": (configuration.tools_config, episodes.ToolsConfig)}


def _config(section: str, **fields) -> ml_collections.ConfigDict:
  """configs/countdown.py with fields of `section` replaced, type checks off so wrong types reach the reader."""
  config = ml_collections.ConfigDict(countdown.get_config().to_dict(), type_safe=False)
  for key, value in fields.items():
    config[section][key] = value
  return config


def test_the_main_configs_sections_are_the_dataclasses_defaults():
  """configs/countdown.py sets every field of each section, at the dataclass's default (the reference shows
  the config's values, so they must be the defaults the code would use)."""
  for section, (read, cls) in SECTIONS.items():
    assert set(countdown.get_config()[section].keys()) == {f.name for f in dataclasses.fields(cls)}
    assert read(countdown.get_config()) == cls()


def test_valid_values_are_typed():
  reward = configuration.reward_config(_config("reward", pool="process", workers=4, timeout_s=5, memory_mb=512))
  assert reward == rewards.RewardConfig(pool="process", workers=4, timeout_s=5.0, memory_mb=512)
  timeout_s = rewards.reward_config({"timeout_s": 5}).timeout_s  # a plain mapping: no ConfigDict's coercion
  assert timeout_s == 5.0 and isinstance(timeout_s, float)  # an int where a float is meant is stored as one
  tools = configuration.tools_config(_config("tools", pool="inline", workers=1, timeout_s=0.5))
  assert tools == episodes.ToolsConfig(pool="inline", workers=1, timeout_s=0.5)
  assert configuration.tools_config(ml_collections.ConfigDict()) == episodes.ToolsConfig()  # no section: defaults


BAD = [
    ("reward", "pool", "gpu"), ("reward", "pool", 1),
    ("reward", "workers", 0), ("reward", "workers", "2"), ("reward", "workers", True), ("reward", "workers", 2.0),
    ("reward", "timeout_s", 0.0), ("reward", "timeout_s", -1.0), ("reward", "timeout_s", "30"),
    ("reward", "timeout_s", math.inf), ("reward", "timeout_s", math.nan),
    ("reward", "memory_mb", -1), ("reward", "memory_mb", 1.5),
    ("tools", "pool", "process"), ("tools", "workers", 0), ("tools", "timeout_s", "slow"),
]


@pytest.mark.parametrize("section,field,value", BAD)
def test_a_bad_value_is_an_error_naming_its_field(section, field, value):
  read, cls = SECTIONS[section]
  with pytest.raises(ValueError) as e:
    read(_config(section, **{field: value}))
  assert str(e.value).startswith(f"invalid config: {section}.{field}={value!r}: must be")
  assert settings.rule_of(cls, field).requirement in str(e.value)
  assert one_line(e.value) == f"error: {section}.{field}: {settings.rule_of(cls, field).requirement} (got {value!r})"


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_an_unknown_field_is_an_error_naming_it(section):
  read, cls = SECTIONS[section]
  with pytest.raises(ValueError) as e:
    read(_config(section, workerz=2))
  line = one_line(e.value)
  assert line.startswith(f"error: {section}.workerz: not a field of {section}; its fields: ") and "(got 2)" in line
  assert all(f.name in line for f in dataclasses.fields(cls))


@pytest.mark.parametrize("section,field,value", [("reward", "workers", 0), ("tools", "pool", "process")])
def test_the_job_checks_both_sections_before_any_work(section, field, value):
  with pytest.raises(ValueError, match="^" + re.escape(f"invalid config: {section}.{field}={value!r}: must be")):
    configuration.validate_config(_config(section, **{field: value}))


def test_the_pools_take_only_their_typed_section():
  """A plain dict would bypass the checks; the pools refuse one."""
  with pytest.raises(TypeError, match="ToolsConfig"):
    episodes.tool_pool({"pool": "thread"})
  pool = episodes.tool_pool(episodes.ToolsConfig(pool="inline", workers=3, timeout_s=2.0))
  try:
    assert (pool.kind, pool.workers, pool.timeout_s) == ("inline", 3, 2.0)
  finally:
    pool.close()


def test_the_reference_states_each_fields_check():
  text = config_reference.render()
  for section, (_, cls) in SECTIONS.items():
    for f in dataclasses.fields(cls):
      row = next(line for line in text.splitlines() if line.startswith(f"| `{section}.{f.name}` |"))
      assert f.metadata["rule"].requirement[1:] in row, row  # its first letter may be capitalised
