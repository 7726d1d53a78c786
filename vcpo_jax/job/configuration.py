"""Job config -> validated plain objects: validate_config, learner_config, build_optimizer; option sub-dicts
generated from the registries so every registered option is settable (and sweepable) from the command line."""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import ml_collections

from vcpo_jax import tasks
from vcpo_jax.algo import losses
from vcpo_jax.calls import settings
from vcpo_jax.job.startup_errors import ConfigError
from vcpo_jax.learner import config as learner_config_lib
from vcpo_jax.learner import optimizer as optimizer_lib
from vcpo_jax.model import config as model_config
from vcpo_jax.model import hf
from vcpo_jax.model import tokenizer as tokenizer_lib
from vcpo_jax.parallel import placement
from vcpo_jax.rollout import backend as backend_lib
from vcpo_jax.rollout import dynamic_sampling, episodes, overlong, rewards
from vcpo_jax.rollout.emulation import lag_model as lag_model_lib
from vcpo_jax.rollout.servers import weight_store, wire as wire_lib

AUTO = -1   # algo.micro_batch_size: chosen from the registered facts (whole groups up to micro_batch_max_rows)


def _fail(field: str, value: Any, why: str):
  raise ConfigError(field, value, why)


# ------------------------------------------------------------------------------------- option sub-dicts
def _field_type(hint):
  """The flag type of an options field: Optional[X] or X | None -> X (so `None` defaults still parse from the
  CLI)."""
  args = [a for a in typing.get_args(hint) if a is not type(None)]
  union = typing.get_origin(hint) in (typing.Union, types.UnionType)
  return args[0] if union and len(args) == 1 else hint


def options_config(registry) -> ml_collections.ConfigDict:
  """One sub-dict per registered name with its options dataclass's fields and defaults. Options a fact
  ties to a shared knob ('uses_tau': algo.tis_threshold) are left out."""
  out = ml_collections.ConfigDict()
  for name in registry.names():
    entry = registry.get(name)
    hints = typing.get_type_hints(entry.options)
    sub = ml_collections.ConfigDict()
    for f in dataclasses.fields(entry.options):
      if f.name == "tau" and entry.fact("uses_tau"):
        continue
      sub[f.name] = ml_collections.FieldReference(f.default, field_type=_field_type(hints[f.name]))
    out[name] = sub
  return out


def _chosen_options(options_dict, name: str) -> dict:
  if options_dict is None or name not in options_dict:
    return {}
  return dict(options_dict[name])


# ------------------------------------------------------------------------------------- task
def task_options(config) -> dict:
  """The chosen task's options (task.options.<task.name>), as given."""
  return _chosen_options(config.task.get("options"), config.task.name)


def build_task(config, render_prompt=None, *, with_pool: bool = True):
  """The job's task: task.name built with its options (render_prompt: a pretrained chat template); a task with
  an environment calls its tools in the pool of the config section `tools` (with_pool=False: inline, for a
  check that plays no episode). Options the task refuses are an error naming task.options.<name>."""
  pool = episodes.tool_pool(tools_config(config)) if with_pool else None
  try:
    return tasks.get_task(config.task.name, render_prompt=render_prompt, tool_pool=pool, **task_options(config))
  except (TypeError, ValueError) as e:  # unknown options, or values the task's constructor refuses
    if pool is not None:
      pool.close()
    _fail(f"task.options.{config.task.name}", task_options(config), str(e))


# ------------------------------------------------------------------------------------- pools
def reward_config(config) -> rewards.RewardConfig:
  """The section `reward` (the reward's pool), typed; a bad field fails naming reward.<field>."""
  return rewards.reward_config(config.get("reward"))


def tools_config(config) -> episodes.ToolsConfig:
  """The section `tools` (tool calls' pool), typed; a bad field fails naming tools.<field>."""
  return episodes.tools_config(config.get("tools"))


def overlong_shaping(config) -> overlong.Shaping | None:
  """The section rl.overlong resolved (None: off); a bad field fails naming rl.overlong.<field>."""
  return overlong.shaping(config.rl.get("overlong"), config.rl.max_new_tokens)


# ------------------------------------------------------------------------------------- learner
def learner_config(config) -> learner_config_lib.LearnerConfig:
  """The LearnerConfig of the job; algo.micro_batch_size -1 (auto) resolved from the registered facts."""
  a, rl = config.algo, config.rl
  lc = learner_config_lib.LearnerConfig(
      advantage=a.advantage, advantage_options=_chosen_options(a.get("advantage_options"), a.advantage),
      policy_loss=a.policy_loss, policy_loss_options=_chosen_options(a.get("policy_loss_options"), a.policy_loss),
      aggregation=a.aggregation, tis_threshold=a.tis_threshold, kl_beta=a.kl_beta,
      grad_path=a.get("grad_path", "auto"), grad_norm_mode=a.get("grad_norm_mode", "auto"),
      grad_memory_budget_gb=a.get("grad_memory_budget_gb", 16.0),
      generation_budget=rl.max_new_tokens,  # Dr.GRPO's constant normalizer ('seq-mean-token-sum-norm')
      update_diagnostics=a.get("update_diagnostics", False))
  micro = a.micro_batch_size
  if micro == AUTO:
    micro = learner_config_lib.auto_micro_batch_size(lc, rl.prompts_per_step * rl.group_size, rl.group_size,
                                                     a.get("micro_batch_max_rows", 32))
  return dataclasses.replace(lc, micro_batch_size=micro)


# ------------------------------------------------------------------------------------- optimizer
def ess_arguments(config) -> dict:
  """algo.ess less its switch `enabled`: exactly scale_by_ess's keyword arguments, checked by scale_by_ess
  itself whether or not ESS scaling is on (a bad one fails naming algo.ess.<name> and its value)."""
  arguments = {k: v for k, v in config.algo.ess.items() if k != "enabled"}
  try:
    optimizer_lib.scale_by_ess(**arguments)
  except optimizer_lib.ArgumentError as e:
    _fail(f"algo.ess.{e.name}", e.value, e.requirement)
  except TypeError as e:  # a field that is not one of its arguments
    _fail("algo.ess", arguments, f"fields must be `enabled` and scale_by_ess's keyword arguments ({e})")
  return arguments


def learning_rate(config, *, sft: bool = False):
  """optim.learning_rate shaped by optim.schedule, whose fields are learning_rate_schedule's keyword arguments
  (its decay_steps 0: rl.steps), checked by it; the constant schedule is the number itself. RL only: the warm
  start uses sft.learning_rate flat."""
  if sft:
    return config.sft.learning_rate
  lr, s = config.optim.learning_rate, config.optim.get("schedule")
  if s is None:
    return lr
  arguments = dict(s)
  arguments["decay_steps"] = s.get("decay_steps") or config.rl.steps
  try:
    schedule = optimizer_lib.learning_rate_schedule(learning_rate=lr, **arguments)
  except optimizer_lib.ArgumentError as e:
    value = s.get(e.name, e.value)  # as the config gives it (a decay_steps of 0 reads rl.steps)
    _fail(f"optim.schedule.{e.name}", value, e.requirement + (f" (0: rl.steps={config.rl.steps})"
                                                              if e.name == "decay_steps" else ""))
  except TypeError as e:  # a field that is not one of its arguments
    _fail("optim.schedule", s.to_dict(), f"fields must be learning_rate_schedule's keyword arguments ({e})")
  return lr if s.name == "constant" else schedule


def build_optimizer(config, *, sft: bool = False):
  """The RL chain (with scale_by_ess when algo.ess.enabled), or the warm start's plain AdamW."""
  o, e = config.optim, config.algo.ess
  kwargs = dict(learning_rate=learning_rate(config, sft=sft), b1=o.b1, b2=o.b2,
                eps=o.eps, weight_decay=o.weight_decay, max_grad_norm=o.max_grad_norm)
  if not sft:  # optim.name / momentum: RL only (the warm start is AdamW whatever the RL optimizer)
    kwargs.update(name=o.get("name", "adamw"), momentum=o.get("momentum", 0.9))
  ess = ess_arguments(config)
  try:
    return optimizer_lib.build_optimizer(**kwargs, ess_scaling=not sft and e.enabled, ess=ess)
  except optimizer_lib.ArgumentError as err:
    if err.name in ("name", "momentum"):
      _fail(f"optim.{err.name}", err.value, err.requirement)
    raise


# ------------------------------------------------------------------------------------- devices
def device_plan(config, environ=None) -> placement.DevicePlan:
  """The job's device plan: embedded servers only when its backend starts them and no rollout.server_urls."""
  r = config.rollout
  embedded = backend_lib.needs(config, "embedded_servers") and not r.server_urls
  return placement.rollout_plan(r, r.num_servers if embedded else 0, environ)


# ------------------------------------------------------------------------------------- validation
# Scalar fields read after start-up (by the warm start, the rollout client, the RL loop): each is checked here
# so that a bad value fails before any work. field -> (accepts, requirement); missing sections are skipped.
_int_at_least, _number = settings.is_int_at_least, settings.is_number  # the typed sections' predicates


_SCALAR_FIELDS = {
    "seed": (_int_at_least(0), "must be an int >= 0"),
    # 0: only after the last step (see train.due)
    "eval_every": (_int_at_least(0), "must be an int >= 0 (0: only after the last step)"),
    "checkpoint_every": (_int_at_least(0), "must be an int >= 0 (0: only after the last step)"),
    "log_every": (_int_at_least(0), "must be an int >= 0 (0: only after the last step)"),
    "task.eval_size": (_int_at_least(1), "must be an int >= 1"),
    "task.eval_samples": (_int_at_least(1), "must be an int >= 1"),
    "sft.steps": (_int_at_least(0), "must be an int >= 0"),
    "sft.batch_size": (_int_at_least(1), "must be an int >= 1"),
    "sft.learning_rate": (_number(lambda v: v >= 0), "must be a number >= 0"),
    "sft.error_rate": (_number(lambda v: 0 <= v <= 1), "must be a number in [0, 1]"),
    "rl.temperature": (_number(lambda v: v > 0), "must be a number > 0 for on-policy sampling"),
    "algo.kl_beta": (_number(lambda v: v >= 0), "must be a number >= 0"),
    "algo.micro_batch_max_rows": (_int_at_least(1), "must be an int >= 1"),
    "algo.update_diagnostics": (lambda v: isinstance(v, bool), "must be True or False"),
    "optim.momentum": (_number(lambda v: 0 <= v < 1), "must be a number in [0, 1)"),
    "optim.learning_rate": (_number(lambda v: v >= 0), "must be a number >= 0"),
    "optim.b1": (_number(lambda v: 0 <= v < 1), "must be a number in [0, 1)"),
    "optim.b2": (_number(lambda v: 0 <= v < 1), "must be a number in [0, 1)"),
    "optim.eps": (_number(lambda v: v > 0), "must be a number > 0"),
    "optim.weight_decay": (_number(lambda v: v >= 0), "must be a number >= 0"),
    "optim.max_grad_norm": (_number(lambda v: v >= 0), "must be a number >= 0 (0: no clipping)"),
    "rl.emulation.speed_ratio": (_number(lambda v: v > 0), "must be a number > 0"),
    "rl.emulation.duration_cv": (_number(lambda v: v >= 0), "must be a number >= 0"),
    "rl.emulation.server_rows": (_int_at_least(0), "must be an int >= 0 (0: unbounded)"),
    "rl.emulation.first_token_fraction": (_number(lambda v: 0 <= v <= 1), "must be a number in [0, 1]"),
    "rollout.num_servers": (_int_at_least(0), "must be an int >= 0"),
    "rollout.base_port": (lambda v: _int_at_least(0)(v) and v <= 65535, "must be an int in [0, 65535] (0: free ports)"),
    "rollout.request_timeout": (_number(lambda v: v > 0), "must be a number > 0 (seconds)"),
    "rollout.max_retries": (_int_at_least(0), "must be an int >= 0"),
    "rollout.keep_versions": (_int_at_least(1), "must be an int >= 1"),
    "rollout.publish": (lambda v: v in ("disk", "wire", "tensor"), "must be 'disk', 'wire' or 'tensor'"),
    "rollout.wire_bucket_mb": (_number(lambda v: v > 0), "must be a number > 0 (MiB per bucket)"),
    "rollout.wire_timeout_s": (_number(lambda v: v > 0), "must be a number > 0 (seconds)"),
    "rollout.wire_backend": (lambda v: v in wire_lib.BACKENDS, f"must be one of {wire_lib.BACKENDS}"),
    "rollout.min_servers": (_int_at_least(0), "must be an int >= 0 (0: all of rollout.server_urls)"),
    "rollout.server_wait_s": (_number(lambda v: v > 0), "must be a number > 0 (seconds)"),
    "distributed.timeout_s": (_number(lambda v: v > 0), "must be a number > 0 (seconds)"),
}


def _validate_scalars(config):
  for field, (accepts, why) in _SCALAR_FIELDS.items():
    *sections, key = field.split(".")
    node = config
    for name in sections:
      node = node.get(name) if node is not None else None
    if node is None or key not in node:
      continue
    if not accepts(node[key]):
      _fail(field, node[key], why)


def _validate_algo(config):
  a, rl = config.algo, config.rl
  for field, registry in (("advantage", losses.ADVANTAGE_ESTIMATORS), ("policy_loss", losses.POLICY_LOSSES)):
    if a[field] not in registry:
      _fail(f"algo.{field}", a[field], f"unknown name; known names: {registry.names()}")
  if a.aggregation not in losses.AGGREGATIONS:
    _fail("algo.aggregation", a.aggregation, f"must be one of {sorted(losses.AGGREGATIONS)}")
  micro = a.micro_batch_size
  if isinstance(micro, bool) or not isinstance(micro, int) or micro < AUTO:
    _fail("algo.micro_batch_size", micro, "must be -1 (auto), 0 (off) or a positive int")
  lc = learner_config(config)  # option names and combinations (e.g. micro-batching) are checked there
  if lc.group_local and rl.group_size < 2:
    _fail("rl.group_size", rl.group_size, f"a group baseline ({a.advantage}) needs >= 2 samples")
  if micro > 0 and (micro % rl.group_size or (rl.prompts_per_step * rl.group_size) % micro):
    _fail("algo.micro_batch_size", micro, f"must be a multiple of rl.group_size={rl.group_size} that divides "
          f"the batch of {rl.prompts_per_step * rl.group_size} rows")
  build_optimizer(config)  # schedule and algo.ess (checked by scale_by_ess)


def validate_config(config: ml_collections.ConfigDict, *, with_task: bool = True) -> model_config.ModelConfig:
  """Checks every field the job depends on before anything starts; errors name the field and value.
  with_task=False leaves building the task (its options' check, its files read) to the caller, who builds it
  next (job.warm_start.starting_point): the user's files are read once."""
  _validate_scalars(config)
  model_cfg = hf.model_config(config.model)  # with model.hf_path: the checkpoint's architecture
  tok = tokenizer_lib.for_model(config.model.get("hf_path", ""))
  if model_cfg.vocab_size < tok.vocab_size:
    _fail("model.vocab_size", model_cfg.vocab_size, f"smaller than the tokenizer's {tok.vocab_size} ids")
  rl = config.rl
  backend_lib.backend_entry(rl.mode)  # the backends' registry is the one list of modes (old names: an error)
  if not isinstance(rl.max_lag, int) or rl.max_lag < 0:
    _fail("rl.max_lag", rl.max_lag, "must be an int >= 0 (0 is synchronous)")
  if "emulation" in rl and rl.emulation.get("lag_model", "fixed") not in lag_model_lib.LAG_MODELS:
    _fail("rl.emulation.lag_model", rl.emulation.lag_model, f"must be one of {list(lag_model_lib.LAG_MODELS)}")
  for field in ("steps", "prompts_per_step", "group_size", "max_new_tokens"):
    if not isinstance(rl[field], int) or rl[field] < 1:
      _fail(f"rl.{field}", rl[field], "must be a positive int")
  if "kwargs" in config.task:
    _fail("task.kwargs", dict(config.task.kwargs), f"replaced by task.options.{config.task.name}.<option>")
  if config.task.name not in tasks.TASKS:
    _fail("task.name", config.task.name, f"unknown task; known: {tasks.TASKS.names()}")
  reward_config(config), tools_config(config)  # errors name reward.<field> / tools.<field>
  if dynamic_sampling.dynamic_sampling_config(rl.get("dynamic_sampling")).enabled and rl.group_size < 2:
    _fail("rl.dynamic_sampling.enabled", True, f"needs rl.group_size >= 2 (got {rl.group_size}): one sample "
          "never spreads, so every group would be dropped")
  overlong_shaping(config)  # rl.overlong.<field>
  if with_task:
    build_task(config, with_pool=False)
  _validate_algo(config)
  if config.rollout.num_servers < 1 and not config.rollout.server_urls:
    _fail("rollout.num_servers", config.rollout.num_servers, "must be >= 1 without rollout.server_urls")
  urls = [u for u in config.rollout.server_urls.split(",") if u.strip()]
  if config.rollout.get("min_servers", 0) > len(urls):
    _fail("rollout.min_servers", config.rollout.min_servers,
          f"exceeds the {len(urls)} servers in rollout.server_urls")
  placement.parse_cpus(config.rollout.get("server_cpus", ""))   # a bad CPU list fails before any work
  weight_store.publish_dtype(config.rollout.get("publish_dtype", "auto"), None, model_cfg.param_dtype)
  if config.rollout.get("publish_dir", ""):  # made if missing and checked writable before any work
    weight_store.publish_root(config.rollout.publish_dir, "")
  return model_cfg
