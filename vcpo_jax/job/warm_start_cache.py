"""What a cached warm start was made with: the settings it reads, and the check a reuse of it must pass."""
from __future__ import annotations

import json
from typing import Any, Mapping

# The warm start's AdamW (configuration.build_optimizer(sft=True)) reads these; its lr is sft.learning_rate.
SFT_OPTIM_FIELDS = ("b1", "b2", "eps", "weight_decay", "max_grad_norm")


def warm_start_settings(config: Any) -> dict:
  """The fields the warm start and its evaluation read, flattened to dotted names (JSON values). `config` is
  the job's ConfigDict or its JSON data (the launcher's). Of task.options only the chosen task's count: the
  other tasks' options are never read, so a field added to one of them changes no warm start."""
  c: Mapping = config.to_dict() if hasattr(config, "to_dict") else config
  read = {"seed": c["seed"], "rl.max_new_tokens": c["rl"]["max_new_tokens"]}
  read.update({f"optim.{k}": c["optim"][k] for k in SFT_OPTIM_FIELDS})
  task = {k: v for k, v in c["task"].items() if k != "options"}
  task["options"] = {task["name"]: (c["task"].get("options") or {}).get(task["name"]) or {}}
  for section, values in (("model", c["model"]), ("sft", c["sft"]), ("task", task)):
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


def check_cached_settings(cached: dict, asked: dict, path: str) -> None:
  """A cached warm start made under other settings is refused (naming the field and both values), not reused:
  its base accuracy would be measured on another evaluation, or its weights come from another SFT. Fields the
  cache recorded that this run does not read (an option dropped since) do not matter."""
  for field in sorted(asked):
    if cached.get(field) != asked[field]:
      raise ValueError(f"{path} was made with {field}={cached.get(field)!r} but this run asks "
                       f"{field}={asked[field]!r}: use a new workdir, or the cached value")
