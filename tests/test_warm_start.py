"""The warm start's cache: reused under the settings that made it, refused (by field, both values) otherwise."""
import json
import os

import pytest

from configs import tiny
from vcpo_jax.job import warm_start, warm_start_cache
from vcpo_jax.rollout.rewards import Rewarder


def test_settings_are_flat_dotted_json_values():
  c = tiny.get_config()
  s = warm_start_cache.warm_start_settings(c)
  assert s["seed"] == c.seed and s["rl.max_new_tokens"] == c.rl.max_new_tokens
  assert s["sft.steps"] == c.sft.steps and s["task.eval_size"] == c.task.eval_size
  assert s["model.num_layers"] == c.model.num_layers
  assert json.loads(json.dumps(s)) == s
  assert s["optim.weight_decay"] == c.optim.weight_decay  # the warm start's AdamW reads it
  assert not any(k.startswith(("rl.max_lag", "optim.learning_rate", "algo.")) for k in s)  # the RL phase's own
  assert [k for k in s if k.startswith("task.options.")] == [
      f"task.options.{c.task.name}.{f}" for f in c.task.options[c.task.name]]  # not the other tasks' options
  assert warm_start_cache.warm_start_settings(c.to_dict()) == s  # the launcher's JSON data gives the same


def test_a_changed_field_is_named_with_both_values():
  cached = {"seed": 0, "task.eval_samples": 1}
  warm_start_cache.check_cached_settings(cached, dict(cached), "W/base/warm_start_settings.json")
  with pytest.raises(ValueError, match=r"task\.eval_samples=1 but this run asks task\.eval_samples=4"):
    warm_start_cache.check_cached_settings(cached, {"seed": 0, "task.eval_samples": 4}, "W")
  with pytest.raises(ValueError, match=r"made with sft\.steps=None .* asks sft\.steps=5"):
    warm_start_cache.check_cached_settings(cached, {**cached, "sft.steps": 5}, "W")
  # A field the cache recorded that this run no longer reads does not matter.
  warm_start_cache.check_cached_settings({**cached, "task.options.arithmetic.ops": "+"}, dict(cached), "W")


@pytest.mark.slow
def test_cache_is_reused_then_refused_under_other_settings_and_kept(tmp_path):
  c = tiny.get_config()
  model_cfg, tok, task, examples = warm_start.starting_point(c)
  rewarder = Rewarder.for_task(task, tok, c.reward)
  base_dir, info = warm_start.warm_start(c, str(tmp_path), model_cfg, tok, task, examples, rewarder)
  marker = os.path.join(base_dir, "warm_start.json")
  mtime = os.path.getmtime(marker)
  again_dir, again = warm_start.warm_start(c, str(tmp_path), model_cfg, tok, task, examples, rewarder)
  assert (again_dir, again) == (base_dir, info) and os.path.getmtime(marker) == mtime  # no second SFT
  c.task.eval_samples = 3
  with pytest.raises(ValueError, match=r"task\.eval_samples=.* but this run asks task\.eval_samples=3"):
    warm_start.warm_start(c, str(tmp_path), model_cfg, tok, task, examples, rewarder)
  assert os.path.getmtime(marker) == mtime and os.path.exists(os.path.join(base_dir, "config.json"))
