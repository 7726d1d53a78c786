"""Start-up validation of scalar config fields, and what the *_every fields schedule (0: only at the end)."""
import json
import re
import types

import ml_collections
import numpy as np
import pytest

from configs import countdown
from vcpo_jax.job import configuration
from vcpo_jax.job import train


def _config(**fields):
  """configs/countdown.py with dotted fields replaced, type checks off so wrong types reach validation."""
  config = ml_collections.ConfigDict(countdown.get_config().to_dict(), type_safe=False)
  for field, value in fields.items():
    *sections, key = field.split(".")
    node = config
    for name in sections:
      node = node[name]
    node[key] = value
  return config


BAD = [
    ("seed", -1), ("seed", 1.0),
    ("eval_every", -1), ("eval_every", 2.5), ("eval_every", "5"), ("eval_every", True), ("eval_every", None),
    ("checkpoint_every", -1), ("checkpoint_every", "10"),
    ("log_every", -3), ("log_every", 1.0),
    ("task.eval_size", 0), ("task.eval_size", -8), ("task.eval_samples", 0), ("task.eval_samples", 2.0),
    ("sft.steps", -1), ("sft.steps", 2.0),
    ("sft.batch_size", 0),
    ("sft.learning_rate", -1e-3), ("sft.learning_rate", "1e-3"),
    ("sft.error_rate", 1.5),
    ("rl.temperature", "hot"), ("rl.temperature", 0.0),
    ("algo.kl_beta", -0.1), ("algo.kl_beta", "0.1"),
    ("algo.micro_batch_max_rows", 0),
    ("optim.learning_rate", -1.0), ("optim.learning_rate", float("nan")),
    ("optim.b1", 1.0), ("optim.b2", -0.1),
    ("optim.eps", 0.0),
    ("optim.weight_decay", -0.1),
    ("optim.max_grad_norm", float("inf")), ("optim.max_grad_norm", -1.0),
    ("optim.momentum", 1.0), ("optim.momentum", -0.1), ("algo.update_diagnostics", 1),
    ("rl.emulation.speed_ratio", 0.0), ("rl.emulation.speed_ratio", "fast"),
    ("rl.emulation.duration_cv", -0.5),
    ("rl.emulation.server_rows", -1), ("rl.emulation.server_rows", 8.0),
    ("rl.emulation.first_token_fraction", 1.5),
    ("rollout.num_servers", "2"),
    ("rollout.base_port", 70000), ("rollout.base_port", -1),
    ("rollout.request_timeout", 0.0), ("rollout.request_timeout", "120"),
    ("rollout.max_retries", -1),
    ("rollout.keep_versions", 0),
    ("rollout.publish", "ftp"),
    ("rollout.wire_bucket_mb", 0.0),
    ("rollout.wire_timeout_s", -1.0),
    ("rollout.wire_backend", "mpi"),
    ("rollout.min_servers", -1),
    ("rollout.server_wait_s", 0.0),
    ("distributed.timeout_s", -5.0),
]


# Sections passed through as a function's keyword arguments, checked by that function (the error still names
# the config field and value).
CHECKED_WHERE_USED = [
    ("algo.ess.trigger", -1.0), ("algo.ess.min_ess_floor", -0.1), ("algo.ess.min_ess_factor", 2.0),
    ("algo.ess.rule", "cubic"), ("algo.ess.base_ess_ratio", "half"),
    ("optim.schedule.warmup_steps", -1), ("optim.schedule.decay_steps", 1.5), ("optim.schedule.decay_steps", -2),
    ("optim.schedule.final_lr_fraction", -0.5), ("optim.schedule.name", "step"), ("optim.name", "lion"),
    # Typed sections (their dataclasses' rules): rl.dynamic_sampling and rl.overlong.
    ("rl.dynamic_sampling.enabled", "yes"), ("rl.dynamic_sampling.tolerance", -1e-6),
    ("rl.dynamic_sampling.max_drops_per_step", 2.5), ("rl.overlong.penalty", 1), ("rl.overlong.cache_length", -4),
    ("rl.overlong.cache_length", 25),
]


@pytest.mark.parametrize("field,value", BAD + CHECKED_WHERE_USED)
def test_bad_scalar_fails_at_validation_naming_field_and_value(field, value):
  with pytest.raises(ValueError, match="^" + re.escape(f"invalid config: {field}={value!r}: must be")):
    configuration.validate_config(_config(**{field: value}))


def test_dynamic_sampling_needs_groups_of_two():
  with pytest.raises(ValueError, match=r"^invalid config: rl\.dynamic_sampling\.enabled=True: needs rl\.group_size >= 2"):
    configuration.validate_config(_config(**{"rl.dynamic_sampling.enabled": True, "rl.group_size": 1}))


def test_every_validated_field_has_a_bad_case():
  assert {field for field, _ in BAD} == set(configuration._SCALAR_FIELDS)


def test_every_periodic_field_is_validated():
  flat = json.loads(countdown.get_config().to_json())
  every = {key for key in flat if key.endswith("_every")}
  assert every == {"eval_every", "checkpoint_every", "log_every"}
  assert every <= set(configuration._SCALAR_FIELDS)


@pytest.mark.parametrize("field", ["eval_every", "checkpoint_every", "log_every"])
def test_zero_every_is_valid(field):
  configuration.validate_config(_config(**{field: 0}))


def test_due_zero_means_only_the_last_step():
  assert [s for s in range(1, 8) if train.due(s, 0, 7)] == [7]
  assert [s for s in range(1, 8) if train.due(s, 3, 7)] == [3, 6, 7]
  assert [s for s in range(1, 8) if train.due(s, 1, 7)] == list(range(1, 8))


def _fake_run(tmp_path, *, leader, steps, eval_every, checkpoint_every, log_every, calls):
  """An RLRun stand-in with just what after_step reads; every action is recorded in `calls`."""
  config = ml_collections.ConfigDict(dict(rl=dict(steps=steps, max_new_tokens=4), seed=0, eval_every=eval_every,
                                          task=dict(eval_samples=1),
                                          checkpoint_every=checkpoint_every, log_every=log_every))
  record = lambda kind: (lambda *a, **k: calls.append((kind, run.step)) or True)
  run = types.SimpleNamespace(
      config=config, step=0, eval_step=-1, leader=leader, state=None, last_eval={},
      host_params=record("eval_gather"), ckpt=types.SimpleNamespace(save=record("checkpoint")),
      writer=types.SimpleNamespace(write=record("log")), progress=types.SimpleNamespace(update=lambda *a: None),
      prompts=types.SimpleNamespace(get_state=lambda: {}),
      consumed_log=str(tmp_path / "consumed.jsonl"), scalars_log=str(tmp_path / "metrics.jsonl"),
      model_cfg=None, tok=None, task=None, eval_examples=None, rewarder=types.SimpleNamespace(stats=dict),
      layout=types.SimpleNamespace(shaping=None),
      _reward_counts_since_last_step=dict)
  return run


@pytest.mark.parametrize("leader", [False, True])
def test_after_step_with_every_zero_acts_only_after_the_last_step(tmp_path, monkeypatch, leader):
  calls = []
  monkeypatch.setattr(train, "evaluate_as_job", lambda *a, **k: calls.append(("eval", run.step)) or {"eval/x": 1.0})
  monkeypatch.setattr(train.group_metrics, "step_metrics", lambda groups, **kw: {})
  run = _fake_run(tmp_path, leader=leader, steps=3, eval_every=0, checkpoint_every=0, log_every=0, calls=calls)
  for _ in range(3):
    train.RLRun.after_step(run, [], {"loss": np.float32(0.5)}, {}, 1.0, lambda: {})
  assert calls and all(step == 3 for _, step in calls), calls
  assert run.eval_step == 3
  if leader:
    assert sorted(kind for kind, _ in calls) == ["checkpoint", "eval", "eval_gather", "log"]


def test_after_step_with_positive_every_keeps_its_schedule(tmp_path, monkeypatch):
  calls = []
  monkeypatch.setattr(train, "evaluate_as_job", lambda *a, **k: calls.append(("eval", run.step)) or {"eval/x": 1.0})
  monkeypatch.setattr(train.group_metrics, "step_metrics", lambda groups, **kw: {})
  run = _fake_run(tmp_path, leader=True, steps=5, eval_every=2, checkpoint_every=3, log_every=4, calls=calls)
  for _ in range(5):
    train.RLRun.after_step(run, [], {}, {}, 1.0, lambda: {})
  steps = lambda kind: [s for k, s in calls if k == kind]
  assert steps("eval") == [2, 4, 5] and steps("checkpoint") == [3, 5] and steps("log") == [2, 4, 5]
