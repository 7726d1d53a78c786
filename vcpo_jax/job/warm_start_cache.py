"""What a cached warm start was made with: the settings it reads, split into those that make its weights (a
reuse must match them) and those that only evaluate it (a change re-evaluates the cached weights)."""
from __future__ import annotations

import json
from typing import Any, Mapping

# The warm start's AdamW (configuration.build_optimizer(sft=True)) reads these; its lr is sft.learning_rate.
SFT_OPTIM_FIELDS = ("b1", "b2", "eps", "weight_decay", "max_grad_norm")
# Read only by the base model's evaluation, never by the SFT (its problems come from the train split whatever
# the eval set's size, its sequences are model.max_seq_len long): the cached weights stay valid under others.
EVALUATION_FIELDS = ("task.eval_size", "task.eval_samples", "rl.max_new_tokens")


def warm_start_settings(config: Any) -> dict:
  """The fields the warm start and its evaluation read, flattened to dotted names (JSON values). `config` is
  the job's ConfigDict or its JSON data (the launcher's). Of task.options only the chosen task's count: the
  other tasks' options are never read, so a field added to one of them changes no warm start."""
  c: Mapping = config.to_dict() if hasattr(config, "to_dict") else config
  read = {"seed": c["seed"], "rl.max_new_tokens": c["rl"]["max_new_tokens"]}
  read.update({f"optim.{k}": c["optim"][k] for k in SFT_OPTIM_FIELDS})
  task = {k: v for k, v in c["task"].items() if k != "options"}
  task["options"] = {task["name"]: (c["task"].get("options") or {}).get(task["name"]) or {}}
  # model.lora is left out: the warm start is full fine-tuning either way (LoRA applies to RL), so LoRA and
  # full fine-tuning runs share one warm start.
  model = {k: v for k, v in c["model"].items() if k != "lora"}
  for section, values in (("model", model), ("sft", c["sft"]), ("task", task)):
    read.update(_flatten(values, section))
  return json.loads(json.dumps(read))  # tuples -> lists, as they read back from the file


def _flatten(d: Mapping, prefix: str) -> dict:
  out = {}
  for key, value in d.items():
    if isinstance(value, Mapping):
      out.update(_flatten(value, f"{prefix}.{key}"))
    else:
      out[f"{prefix}.{key}"] = value
  return out


def weight_settings(settings: dict) -> dict:
  """The part of warm_start_settings that makes the weights (what the launcher's sharing key hashes)."""
  return {k: v for k, v in settings.items() if k not in EVALUATION_FIELDS}


def check_cached_weights(cached: dict, asked: dict, path: str) -> None:
  """A cached warm start whose weights came from other settings is refused (naming the field and both values),
  not reused. Evaluation fields are not checked (see changed_evaluation); fields the cache recorded that this
  run does not read (an option dropped since) do not matter."""
  for field in sorted(weight_settings(asked)):
    if cached.get(field) != asked[field]:
      raise ValueError(f"{path} was made with {field}={cached.get(field)!r} but this run asks "
                       f"{field}={asked[field]!r}: use a new workdir, or the cached value")


def changed_evaluation(cached: dict, asked: dict) -> dict:
  """{field: (cached, asked)} for the evaluation fields that differ: the cached base model's accuracy was
  measured on another evaluation and must be measured again."""
  return {f: (cached.get(f), asked[f]) for f in EVALUATION_FIELDS if f in asked and cached.get(f) != asked[f]}
