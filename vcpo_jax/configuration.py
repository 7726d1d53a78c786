"""Job config -> validated plain objects: validate_config, learner_config, build_optimizer."""
from __future__ import annotations

from typing import Any

import ml_collections

from vcpo_jax import learner, losses, model as model_lib, optimizer as optimizer_lib, tasks
from vcpo_jax import tokenizer as tokenizer_lib

MODES = ("async", "emulate")


def _fail(field: str, value: Any, why: str):
  raise ValueError(f"invalid config: {field}={value!r}: {why}")


def validate_config(config: ml_collections.ConfigDict) -> model_lib.ModelConfig:
  """Checks every field the job depends on before anything starts; errors name the field and value."""
  model_cfg = model_lib.ModelConfig.from_dict(config.model)
  tok = tokenizer_lib.build_tokenizer()
  if model_cfg.vocab_size < tok.vocab_size:
    _fail("model.vocab_size", model_cfg.vocab_size, f"smaller than the tokenizer's {tok.vocab_size} ids")
  rl = config.rl
  if rl.mode not in MODES:
    _fail("rl.mode", rl.mode, f"must be one of {MODES}")
  if not isinstance(rl.max_lag, int) or rl.max_lag < 0:
    _fail("rl.max_lag", rl.max_lag, "must be an int >= 0 (0 is synchronous)")
  for field in ("steps", "prompts_per_step", "group_size", "max_new_tokens"):
    if not isinstance(rl[field], int) or rl[field] < 1:
      _fail(f"rl.{field}", rl[field], "must be a positive int")
  if not rl.temperature > 0:
    _fail("rl.temperature", rl.temperature, "must be > 0 for on-policy sampling")
  if config.task.name not in tasks.TASKS:
    _fail("task.name", config.task.name, f"unknown task; known: {sorted(tasks.TASKS)}")
  tasks.get_task(config.task.name, **config.task.kwargs)  # knob errors name the knob
  losses.get_advantage_fn(config.algo.advantage)
  losses.get_policy_loss(config.algo.policy_loss)
  if config.algo.aggregation not in losses.AGGREGATIONS:
    _fail("algo.aggregation", config.algo.aggregation, f"must be one of {sorted(losses.AGGREGATIONS)}")
  group_based = config.algo.advantage in ("grpo", "rloo", "dr_grpo") or (
      config.algo.advantage == "opob" and config.algo.opob.scope == "group")
  if group_based and rl.group_size < 2:
    _fail("rl.group_size", rl.group_size, f"a group baseline ({config.algo.advantage}) needs >= 2 samples")
  learner_config(config)  # option names and combinations (e.g. micro-batching) are checked there
  micro = config.algo.micro_batch_size
  if micro and (micro % rl.group_size or (rl.prompts_per_step * rl.group_size) % micro):
    _fail("algo.micro_batch_size", micro, f"must be a multiple of rl.group_size={rl.group_size} that divides "
          f"the batch of {rl.prompts_per_step * rl.group_size} rows")
  if config.sft.steps < 0:
    _fail("sft.steps", config.sft.steps, "must be >= 0")
  if config.checkpoint_every < 1:
    _fail("checkpoint_every", config.checkpoint_every, "must be >= 1")
  if config.rollout.num_servers < 1 and not config.rollout.server_urls:
    _fail("rollout.num_servers", config.rollout.num_servers, "must be >= 1 without rollout.server_urls")
  return model_cfg


def learner_config(config) -> learner.LearnerConfig:
  a = config.algo
  return learner.LearnerConfig(
      advantage=a.advantage, policy_loss=a.policy_loss, aggregation=a.aggregation,
      tis_threshold=a.tis_threshold, opob=dict(a.opob), kl_beta=a.kl_beta,
      micro_batch_size=a.micro_batch_size)


def build_optimizer(config, *, sft: bool = False):
  """The RL chain (with scale_by_ess when algo.ess.enabled), or the warm start's plain AdamW."""
  o, e = config.optim, config.algo.ess
  kwargs = dict(learning_rate=config.sft.learning_rate if sft else o.learning_rate, b1=o.b1, b2=o.b2,
                eps=o.eps, weight_decay=o.weight_decay, max_grad_norm=o.max_grad_norm)
  if not sft and e.enabled:
    kwargs.update(base_ess_ratio=e.base_ess_ratio, ess_rule=e.rule, ess_trigger=e.trigger or None,
                  min_ess_brake=(e.min_ess_floor, e.min_ess_factor) if e.min_ess_floor > 0 else None)
  else:
    kwargs.update(ess_scaling=False)
  return optimizer_lib.build_optimizer(**kwargs)
