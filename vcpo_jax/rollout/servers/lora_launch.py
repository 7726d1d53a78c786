"""LoRA at server launch: SGLang's flags from model.lora and rl.max_lag, and the check that servers given by URL
were launched with LoRA that fits (a one-line error before anything starts).

SGLang 0.5.23: `--enable-lora`, `--max-lora-rank R` and `--lora-target-modules m ...` (both needed when no
adapter is given at launch), `--lora-strict-loading` (mismatched or missing adapter keys are an error), and
`--max-loras-per-batch N`, which counts the base model's slot: k + 2 adapters in one batch need k + 3.
`--max-loaded-loras` stays unset: with it SGLang evicts the least recently used adapter by itself.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

# The decoder's linear layers as Hugging Face names them (model.lora.target_modules' default).
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraLaunchError(ValueError):
  """Servers that cannot serve the job's adapters (the message names the server, the field and the values)."""


@dataclasses.dataclass(frozen=True)
class LoraServing:
  """What the servers need for the job's adapters."""
  rank: int
  target_modules: tuple[str, ...]
  max_lag: int

  @property
  def max_kept(self) -> int:
    """Adapters kept loaded per server: the current one, k older ones still in flight, one loading."""
    return self.max_lag + 2

  @property
  def max_loras_per_batch(self) -> int:
    return self.max_kept + 1  # SGLang counts the base model's slot


def from_config(config: Any) -> Optional[LoraServing]:
  """model.lora and rl.max_lag of the job's config; None without LoRA (no model.lora, or rank 0)."""
  model = config.get("model", {}) if hasattr(config, "get") else {}
  lora = model.get("lora") if hasattr(model, "get") else None
  rank = lora.get("rank", 0) if lora is not None else 0
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
    raise LoraLaunchError(f"invalid config: model.lora.rank={rank!r}: must be an int >= 0")
  if rank == 0:
    return None
  targets = lora.get("target_modules") or ALL_TARGETS
  targets = tuple(t.strip() for t in targets.split(",")) if isinstance(targets, str) else tuple(targets)
  bad = [t for t in targets if t not in ALL_TARGETS]
  if bad or not targets:
    raise LoraLaunchError(f"invalid config: model.lora.target_modules={targets!r}: each must be one of {ALL_TARGETS}")
  max_lag = config.get("rl", {}).get("max_lag", 1)
  return LoraServing(rank, targets, int(max_lag))


def server_flags(lora: Optional[LoraServing]) -> tuple[str, ...]:
  """SGLang's launch flags (the embedded server takes the same ones)."""
  if lora is None:
    return ()
  return ("--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules", *lora.target_modules,
          "--lora-strict-loading", "--max-loras-per-batch", str(lora.max_loras_per_batch))


def served_settings(info: Any) -> dict:
  """The LoRA fields of a /get_server_info answer (top level, or SGLang's `lora` namespace)."""
  if not isinstance(info, dict):
    return {}
  nested = info.get("lora") if isinstance(info.get("lora"), dict) else {}
  keys = ("enable_lora", "max_lora_rank", "lora_target_modules", "max_loras_per_batch")
  return {k: nested.get(k, info.get(k)) for k in keys}


def served_problem(info: Any, lora: LoraServing) -> Optional[str]:
  """Why a server with this /get_server_info cannot serve the job's adapters (None: it can)."""
  got = served_settings(info)
  if not got.get("enable_lora"):
    return "was launched without LoRA (enable_lora is off): start it with " + " ".join(server_flags(lora))
  max_rank = got.get("max_lora_rank")
  if isinstance(max_rank, int) and max_rank < lora.rank:
    return f"has max_lora_rank={max_rank} < model.lora.rank={lora.rank}"
  served = got.get("lora_target_modules")
  if isinstance(served, (list, tuple, set)) and "all" not in served:
    missing = sorted(set(lora.target_modules) - set(served))
    if missing:
      return f"has lora_target_modules={sorted(served)} without {missing} (model.lora.target_modules)"
  per_batch = got.get("max_loras_per_batch")
  if isinstance(per_batch, int) and per_batch < 2:
    return f"has max_loras_per_batch={per_batch}: it counts the base slot, so no adapter fits beside it"
  return None


async def check_servers(admin, urls: Sequence[str], lora: LoraServing) -> None:
  """Raises LoraLaunchError (one line, every bad server) unless each server's /get_server_info fits."""
  problems = []
  for url in urls:
    try:
      info = await admin.call(url, "GET", "/get_server_info")
    except Exception as e:  # noqa: BLE001 -- an unreadable answer is a refusal to start, with its reason
      problems.append(f"{url}: /get_server_info failed: {e!r:.200}")
      continue
    problem = served_problem(info, lora)
    if problem is not None:
      problems.append(f"{url} {problem}")
  if problems:
    raise LoraLaunchError("refusing to start with model.lora.rank=" f"{lora.rank}: " + "; ".join(problems))
