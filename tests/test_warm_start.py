"""The warm start's cache: reused under the settings that made it, re-evaluated under other evaluation settings,
refused (by field, both values) under other weight settings."""
import json
import os

import pytest

from configs import tiny
from vcpo_jax.job import configuration, warm_start, warm_start_cache
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


def test_a_changed_weight_field_is_named_with_both_values():
  cached = {"seed": 0, "sft.steps": 4, "task.eval_samples": 1, "task.eval_size": 8, "rl.max_new_tokens": 8}
  warm_start_cache.check_cached_weights(cached, dict(cached), "W/base/warm_start_settings.json")
  with pytest.raises(ValueError, match=r"W was made with sft\.steps=4 but this run asks sft\.steps=5"):
    warm_start_cache.check_cached_weights(cached, {**cached, "sft.steps": 5}, "W")
  with pytest.raises(ValueError, match=r"made with model\.num_layers=None .* asks model\.num_layers=2"):
    warm_start_cache.check_cached_weights(cached, {**cached, "model.num_layers": 2}, "W")
  # A field the cache recorded that this run no longer reads does not matter.
  warm_start_cache.check_cached_weights({**cached, "task.options.arithmetic.ops": "+"}, dict(cached), "W")


def test_evaluation_fields_are_not_checked_but_reported_changed():
  cached = {"seed": 0, "task.eval_samples": 1, "task.eval_size": 8, "rl.max_new_tokens": 8}
  asked = {**cached, "task.eval_samples": 4, "task.eval_size": 32, "rl.max_new_tokens": 16}
  warm_start_cache.check_cached_weights(cached, asked, "W")
  assert warm_start_cache.changed_evaluation(cached, asked) == {
      "task.eval_samples": (1, 4), "task.eval_size": (8, 32), "rl.max_new_tokens": (8, 16)}
  assert warm_start_cache.changed_evaluation(cached, dict(cached)) == {}
  settings = warm_start_cache.warm_start_settings(tiny.get_config())
  assert set(warm_start_cache.EVALUATION_FIELDS) <= set(settings)  # the names are the config's own
  assert set(warm_start_cache.weight_settings(settings)) == set(settings) - set(warm_start_cache.EVALUATION_FIELDS)


def _evaluations(monkeypatch):
  """Records (eval_size, eval_samples, max_new_tokens, result) of every evaluation the warm start runs."""
  calls, evaluate = [], warm_start.evaluate_as_job

  def spy(config, params, model_cfg, tok, task, eval_examples, rewarder):
    out = evaluate(config, params, model_cfg, tok, task, eval_examples, rewarder)
    calls.append((len(eval_examples), config.task.eval_samples, config.rl.max_new_tokens, out))
    return out
  monkeypatch.setattr(warm_start, "evaluate_as_job", spy)
  return calls


def _no_sft(monkeypatch):
  def fail(*args, **kwargs):
    raise AssertionError("the SFT ran again")
  monkeypatch.setattr(warm_start.data, "make_sft_iterator", fail)
  monkeypatch.setattr(warm_start.train_state, "make_sft_step", fail)


def _json(path):
  with open(path) as f:
    return json.load(f)


def _stamp(path):
  with open(path, "rb") as f:
    return os.path.getmtime(path), f.read()


def _rerun(c, workdir):
  model_cfg, tok, task, examples = warm_start.starting_point(c)
  rewarder = Rewarder.for_task(task, tok, configuration.reward_config(c))
  try:
    return warm_start.warm_start(c, workdir, model_cfg, tok, task, examples, rewarder)
  finally:
    rewarder.close()


@pytest.mark.slow
def test_cache_is_reused_reevaluated_or_refused(tmp_path, monkeypatch):
  c = tiny.get_config()
  calls = _evaluations(monkeypatch)
  base_dir, info = _rerun(c, str(tmp_path))
  assert len(calls) == 1
  weights = os.path.join(base_dir, "model.safetensors")
  stamp = _stamp(weights)
  settings_path = os.path.join(base_dir, "warm_start_settings.json")
  _no_sft(monkeypatch)
  assert _rerun(c, str(tmp_path)) == (base_dir, info) and len(calls) == 1  # same settings: nothing runs

  # Evaluation-only settings: the cached weights are evaluated as asked, the new settings recorded.
  for field, value, call in (("task.eval_size", 4, (4, 1, 8)), ("task.eval_samples", 3, (4, 3, 8)),
                             ("rl.max_new_tokens", 6, (4, 3, 6))):
    section, key = field.split(".")
    c[section][key] = value
    again_dir, again = _rerun(c, str(tmp_path))
    assert again_dir == base_dir and calls[-1][:3] == call, field
    sft_record = {k: v for k, v in info.items() if not k.startswith("eval/")}
    assert again == {**sft_record, **calls[-1][3]}   # the SFT's own record is kept, the evaluation replaced
    assert _json(settings_path)[field] == value
    assert _json(os.path.join(base_dir, "warm_start.json")) == again
    assert _stamp(weights) == stamp
  n = len(calls)
  assert _rerun(c, str(tmp_path))[1] == again and len(calls) == n  # recorded: not evaluated again
  # Back to the first evaluation: the weights read back from the cache score exactly what the fresh ones did.
  c.task.eval_size, c.task.eval_samples, c.rl.max_new_tokens = 8, 1, 8
  assert _rerun(c, str(tmp_path))[1] == info and len(calls) == n + 1

  # A setting that makes the weights: refused, naming it with both values; the cache is kept as it was.
  c.sft.steps = 5
  with pytest.raises(ValueError, match=r"sft\.steps=4 but this run asks sft\.steps=5"):
    _rerun(c, str(tmp_path))
  assert _stamp(weights) == stamp
  assert _json(os.path.join(base_dir, "warm_start.json")) == info
